// Products on a GGUF file's own quantised blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, TQ2_0, MXFP4, and the grid formats IQ1_S, IQ1_M,
// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S and TQ1_0, read where they lie (the file's
// bytes, memory-mapped), never widened to a float copy of the matrix.
// (part of kernels.c, the one translation unit: included there, in order)
//
// Every format comes down to the same thing for a run of 32 weights: unsigned 8-bit values
// q (0..255) and, for each half of 16, a scale and an offset, w = scale * q + offset. The
// activations are quantised the same way, 32 at a time to int8 with one float scale (the
// per-block error is at most half that scale), and each pair of blocks multiplies in
// integers (AVX-512 VNNI's dpbusd, u8 x s8 into int32), then once in float:
//   sum_i w_i x_i = sum_half scale * d_x * (q . a)_half + offset * (d_x * sum a)_half.
// The sums of the quantised activations over each 16 come with them, so the offsets cost a
// multiply-add a half, not a pass over the block. The IQ4 formats and MXFP4 index a table
// of 16 signed values: q is the table's value + 128, the offset -128 * scale.

enum { TW_BLOCKS = 16 };  // dtype code TW_BLOCKS + t: a GGUF tensor of ggml type t
enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q2_K = 10,
       GG_Q3_K = 11, GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14, GG_IQ2_XXS = 16, GG_IQ2_XS = 17,
       GG_IQ3_XXS = 18, GG_IQ1_S = 19, GG_IQ4_NL = 20, GG_IQ3_S = 21, GG_IQ2_S = 22,
       GG_IQ4_XS = 23, GG_IQ1_M = 29, GG_TQ1_0 = 34, GG_TQ2_0 = 35, GG_MXFP4 = 39 };
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline const int8_t* table_of(int t) { return t == GG_MXFP4 ? MXFP4_VALUES : IQ4_VALUES; }
enum { TW_PARTS = 6 };  // a product made of row ranges of different dtypes (tw_linear.parts)
#define BLOCK_MAX_ROWS 8  // activation rows that share one decode of a weight block
// Tokens a grid format's row is decoded once for in a prompt (dot_grid_wide): its decode
// costs more than the products, so it is shared by as many tokens as there are.
#define GRID_TOKENS 64

static inline int is_blocks(int dtype) { return dtype >= TW_BLOCKS; }
// dtype code TW_R8 + t: a GGUF tensor of ggml type t repacked eight rows at a time
// (repacked_products.h)
enum { TW_R8 = 64 };
// The ggml type a product's dtype code names (a file's blocks, as stored or repacked).
static inline int block_type(int dtype) { return dtype >= TW_R8 ? dtype - TW_R8 : dtype - TW_BLOCKS; }

// Whether type t comes in super-blocks of 256 (its activations quantised per 256, with
// sums per 16) rather than blocks of 32.
static inline int is_super(int t) {
  return t == GG_Q2_K || t == GG_Q3_K || t == GG_Q4_K || t == GG_Q5_K || t == GG_Q6_K ||
         t == GG_IQ4_XS || t == GG_TQ2_0 || t == GG_IQ2_XXS || t == GG_IQ2_XS ||
         t == GG_IQ2_S || t == GG_IQ3_XXS || t == GG_IQ3_S || t == GG_IQ1_S || t == GG_IQ1_M ||
         t == GG_TQ1_0;
}

// The grid formats: each run of 32 a set of signed small integers (points of a lattice
// the file indexes, with their signs) and an integer scale for each 16, w = unit * sc * q.
static inline int is_grid(int t) {
  return t == GG_IQ2_XXS || t == GG_IQ2_XS || t == GG_IQ2_S || t == GG_IQ3_XXS ||
         t == GG_IQ3_S || t == GG_IQ1_S || t == GG_IQ1_M || t == GG_TQ1_0;
}

// elements and bytes of one block of ggml type t (0: a type not executed here)
static inline int block_elems(int t) { return is_super(t) ? 256 : 32; }
static inline int block_bytes(int t) {
  switch (t) {
    case GG_Q4_0: return 18;
    case GG_Q4_1: return 20;
    case GG_Q5_0: return 22;
    case GG_Q5_1: return 24;
    case GG_Q8_0: return 34;
    case GG_Q2_K: return 84;
    case GG_Q3_K: return 110;
    case GG_Q4_K: return 144;
    case GG_Q5_K: return 176;
    case GG_Q6_K: return 210;
    case GG_IQ4_NL: return 18;
    case GG_IQ4_XS: return 136;
    case GG_TQ2_0: return 66;
    case GG_MXFP4: return 17;
    case GG_IQ2_XXS: return 66;
    case GG_IQ2_XS: return 74;
    case GG_IQ2_S: return 82;
    case GG_IQ3_XXS: return 98;
    case GG_IQ3_S: return 110;
    case GG_IQ1_S: return 50;
    case GG_IQ1_M: return 56;
    case GG_TQ1_0: return 54;
    default: return 0;
  }
}
static inline int64_t block_row_bytes(int t, int k) {
  return (int64_t)(k / block_elems(t)) * block_bytes(t);
}


static inline float half_to_f32(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  union { uint32_t u; float f; } v;
  if (exp == 0x1f) {
    v.u = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    v.u = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    v.f = (float)man * 5.9604644775390625e-8f;
    v.u |= sign;
  }
  return v.f;
#endif
}

// MXFP4's scale byte: a power of two, 2^(x - 128) (the e2m1 table holds doubled values)
static inline float e8m0_half(uint8_t x) {
  const uint32_t bits = x < 2 ? 0x00200000u << x : (uint32_t)(x - 1) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Where the 2-bit values of Q2_K, Q3_K and TQ2_0 start in their super-block
static inline int low2_offset(int t) { return t == GG_Q2_K ? 16 : t == GG_Q3_K ? 32 : 0; }

// Q4_K / Q5_K: sub-block j's 6-bit scale and minimum from the 12 packed bytes
static inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K: scale i (0-15) of the 12 bytes that pack sixteen 6-bit scales (4 low bits in
// bytes 0-7, two scales a byte; 2 high bits in bytes 8-11, four a byte), as stored (+32).
static inline int scale_q3k(const uint8_t* s, int i) {
  const int r = i / 4, c = i % 4;
  return ((s[(r & 1) * 4 + c] >> (4 * (r >> 1))) & 0xF) | (((s[8 + c] >> (2 * r)) & 3) << 4);
}

// IQ4_XS: sub-block ib's (0-7) 6-bit scale, as stored (+32)
static inline int scale_iq4xs(const uint8_t* sb, int ib) {
  const uint16_t high = (uint16_t)(sb[2] | sb[3] << 8);
  return ((sb[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((high >> (2 * ib)) & 3) << 4);
}

// The grid formats' lattices, [points, 8 or 4] signed values, and the table of sign bytes
// with even parity they index by 7 bits: the gguf package's, handed over by
// tw_set_grids when the library is opened (kernels/build.py).
static const int8_t *IQ2XXS_GRID, *IQ2XS_GRID, *IQ2S_GRID, *IQ3XXS_GRID, *IQ3S_GRID, *IQ1S_GRID;
static const uint8_t* IQ_KSIGNS;
static uint64_t SIGN_MASKS[256];  // byte k all ones where bit k of the index is set

void tw_set_grids(const int8_t* iq2xxs, const int8_t* iq2xs, const int8_t* iq2s,
                  const int8_t* iq3xxs, const int8_t* iq3s, const int8_t* iq1s,
                  const uint8_t* ksigns) {
  IQ2XXS_GRID = iq2xxs, IQ2XS_GRID = iq2xs, IQ2S_GRID = iq2s;
  IQ3XXS_GRID = iq3xxs, IQ3S_GRID = iq3s, IQ1S_GRID = iq1s, IQ_KSIGNS = ksigns;
  for (int b = 0; b < 256; ++b) {
    uint64_t m = 0;
    for (int k = 0; k < 8; ++k)
      if ((b >> k) & 1) m |= (uint64_t)0xFF << (8 * k);
    SIGN_MASKS[b] = m;
  }
}

static inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

// The values of a lattice point (8, or 4 in the low half), each negated where its bit of
// `signs` is set: all at once in one integer, -x as (x ^ 0xFF) + 1 in each byte (the points'
// values are never 0, so no byte carries into the next).
static inline uint64_t signed8(const int8_t* point, uint8_t signs) {
  uint64_t v;
  memcpy(&v, point, 8);
  const uint64_t m = SIGN_MASKS[signs];
  return (v ^ m) + (m & 0x0101010101010101ULL);
}
static inline uint64_t signed4(const int8_t* point, uint8_t signs) {
  uint32_t v;
  memcpy(&v, point, 4);
  const uint32_t m = (uint32_t)SIGN_MASKS[signs & 0xF];
  return (uint64_t)((v ^ m) + (m & 0x01010101u));
}

// x + c in each byte of 8, no carry between them
static inline uint64_t bytes_add(uint64_t x, uint64_t c) {
  const uint64_t low7 = 0x7F7F7F7F7F7F7F7FULL;
  return ((x & low7) + (c & low7)) ^ ((x ^ c) & ~low7);
}

// A grid format's super-block: the float unit its weights are multiples of.
static inline float grid_unit(int t, const uint8_t* sb) {
  switch (t) {
    case GG_IQ2_XXS: case GG_IQ2_XS: case GG_IQ2_S: return half_to_f32(sb) * 0.125f;
    case GG_IQ3_XXS: return half_to_f32(sb) * 0.25f;
    case GG_IQ3_S: return half_to_f32(sb);
    case GG_IQ1_S: return half_to_f32(sb) * 0.125f;  // (q holds 8 x (point + delta))
    case GG_TQ1_0: return half_to_f32(sb + 52);
    default: {  // IQ1_M: the float16 spread over the top 4 bits of its four scale words
      const uint8_t* s = sb + 48;
      const uint16_t h = (uint16_t)((load_u16(s) >> 12) | ((load_u16(s + 2) >> 8) & 0xF0) |
                                    ((load_u16(s + 4) >> 4) & 0xF00) | (load_u16(s + 6) & 0xF000));
      uint8_t b[2] = {(uint8_t)h, (uint8_t)(h >> 8)};
      return half_to_f32(b) * 0.125f;
    }
  }
}

// Run j (0-7) of a grid format's super-block: its 32 signed values, 8 to a word of v
// (little-endian: value 8i + k is byte k of v[i]), and the integer scales of its two 16s,
// w = grid_unit * sc[h] * value (the gguf package's layouts).
static inline __attribute__((always_inline)) void grid_run(int t, const uint8_t* sb, int j,
                                                           uint64_t v[4], int sc[2]) {
  if (t == GG_IQ2_XXS) {  // four 8-point indices, then four 7-bit sign indices and a scale
    const uint8_t* idx = sb + 2 + 8 * j;
    const uint32_t aux = load_u32(sb + 2 + 8 * j + 4);
    for (int l = 0; l < 4; ++l)
      v[l] = signed8(IQ2XXS_GRID + 8 * idx[l], IQ_KSIGNS[(aux >> (7 * l)) & 127]);
    sc[0] = sc[1] = 2 * (int)(aux >> 28) + 1;
  } else if (t == GG_IQ2_XS) {  // four words: a 9-bit index and a 7-bit sign index
    for (int l = 0; l < 4; ++l) {
      const uint16_t w = load_u16(sb + 2 + 2 * (4 * j + l));
      v[l] = signed8(IQ2XS_GRID + 8 * (w & 511), IQ_KSIGNS[w >> 9]);
    }
    const uint8_t s = sb[66 + j];
    sc[0] = 2 * (s & 0xF) + 1, sc[1] = 2 * (s >> 4) + 1;
  } else if (t == GG_IQ2_S) {  // 10-bit indices (high bits in qh), a sign byte each
    const uint8_t *qs = sb + 2, *signs = sb + 34, qh = sb[66 + j], s = sb[74 + j];
    for (int l = 0; l < 4; ++l)
      v[l] = signed8(IQ2S_GRID + 8 * (qs[4 * j + l] | (((qh >> (2 * l)) & 3) << 8)),
                     signs[4 * j + l]);
    sc[0] = 2 * (s & 0xF) + 1, sc[1] = 2 * (s >> 4) + 1;
  } else if (t == GG_IQ3_XXS) {  // eight 4-point indices; sign indices and scale after
    const uint8_t* idx = sb + 2 + 8 * j;
    const uint32_t aux = load_u32(sb + 66 + 4 * j);
    for (int l = 0; l < 4; ++l) {
      const uint8_t signs = IQ_KSIGNS[(aux >> (7 * l)) & 127];
      v[l] = signed4(IQ3XXS_GRID + 4 * idx[2 * l], signs) |
             signed4(IQ3XXS_GRID + 4 * idx[2 * l + 1], signs >> 4) << 32;
    }
    sc[0] = sc[1] = 2 * (int)(aux >> 28) + 1;
  } else if (t == GG_IQ3_S) {  // 9-bit indices of 4 points (high bit in qh), sign bytes
    const uint8_t *qs = sb + 2 + 8 * j, qh = sb[66 + j], *signs = sb + 74 + 4 * j;
    for (int l = 0; l < 4; ++l) {
      const int i0 = qs[2 * l] | (((qh >> (2 * l)) & 1) << 8);
      const int i1 = qs[2 * l + 1] | (((qh >> (2 * l + 1)) & 1) << 8);
      v[l] = signed4(IQ3S_GRID + 4 * i0, signs[l]) | signed4(IQ3S_GRID + 4 * i1, signs[l] >> 4)
                                                         << 32;
    }
    sc[0] = sc[1] = 2 * ((sb[106 + j / 2] >> (4 * (j % 2))) & 0xF) + 1;
  } else if (t == GG_IQ1_S || t == GG_IQ1_M) {  // 11-bit indices of {-1, 0, 1}, +- 1/8
    const uint8_t* qs = sb + (t == GG_IQ1_S ? 2 : 0);
    const uint16_t h = t == GG_IQ1_S ? load_u16(sb + 34 + 2 * j) : 0;
    for (int l = 0; l < 4; ++l) {
      int hi, neg;  // the index's top 3 bits; whether the 8 points' delta is -1/8
      if (t == GG_IQ1_S) {
        hi = (h >> (3 * l)) & 7, neg = h >> 15;
      } else {
        const uint8_t nib = sb[32 + 2 * j + l / 2] >> (4 * (l % 2));
        hi = nib & 7, neg = (nib >> 3) & 1;
      }
      uint64_t p;
      memcpy(&p, IQ1S_GRID + 8 * (qs[4 * j + l] | (hi << 8)), 8);
      const uint64_t eight = (p << 3) & 0xF8F8F8F8F8F8F8F8ULL;  // 8 x (-1, 0 or 1)
      v[l] = bytes_add(eight, neg ? ~(uint64_t)0 : 0x0101010101010101ULL);
    }
    if (t == GG_IQ1_S) {
      sc[0] = sc[1] = 2 * ((h >> 12) & 7) + 1;
    } else {  // a 3-bit scale a 16, four to a word
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 2 * j + hh;
        sc[hh] = 2 * ((load_u16(sb + 48 + 2 * (i / 4)) >> (3 * (i % 4))) & 7) + 1;
      }
    }
  } else {  // TQ1_0: base-3 digits, five to a byte (four in the last 4 bytes), value - 1
    // element e of 256: bytes 0-31 hold digits 0-4 of elements 0-159 (digit e / 32 of byte
    // e % 32), bytes 32-47 of 160-239, bytes 48-51 of 240-255
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    uint8_t byte[32], mult[32];
    for (int l = 0; l < 32; ++l) {
      const int e = 32 * j + l;
      if (j < 5) byte[l] = sb[l], mult[l] = pow3[j];
      else if (e < 240) byte[l] = sb[32 + (e - 160) % 16], mult[l] = pow3[(e - 160) / 16];
      else byte[l] = sb[48 + (e - 240) % 4], mult[l] = pow3[(e - 240) / 4];
    }
    int8_t q[32];
    for (int l = 0; l < 32; ++l)
      q[l] = (int8_t)((((uint16_t)(uint8_t)(byte[l] * mult[l])) * 3 >> 8) - 1);
    memcpy(v, q, 32);
    sc[0] = sc[1] = 1;
  }
}

// The scales and offsets of 32-element group g of a row: w = sw[h] * q + bw[h] for the
// half h (0: elements 0-15, 1: 16-31). Also where the group's quantised bytes start.
static inline void group_params(int t, const uint8_t* row, int g, float sw[2], float bw[2]) {
  if (!is_super(t)) {
    const uint8_t* b = row + (int64_t)g * block_bytes(t);
    const float d = t == GG_MXFP4 ? e8m0_half(b[0]) : half_to_f32(b);
    float off;
    if (t == GG_Q4_1 || t == GG_Q5_1) off = half_to_f32(b + 2);
    else off = -(t == GG_Q4_0 ? 8.f : t == GG_Q5_0 ? 16.f : 128.f) * d;
    sw[0] = sw[1] = d;
    bw[0] = bw[1] = off;
    return;
  }
  const uint8_t* sb = row + (int64_t)(g / 8) * block_bytes(t);
  const int j = g % 8;
  if (is_grid(t)) {  // signed values + 128
    uint64_t q[4];
    int sc[2];
    grid_run(t, sb, j, q, sc);
    const float unit = grid_unit(t, sb);
    for (int h = 0; h < 2; ++h) {
      sw[h] = unit * sc[h];
      bw[h] = -128.f * sw[h];
    }
    return;
  }
  if (t == GG_Q2_K) {
    const float d = half_to_f32(sb + 80), dmin = half_to_f32(sb + 82);
    for (int h = 0; h < 2; ++h) {
      sw[h] = d * (sb[2 * j + h] & 0xF);
      bw[h] = -dmin * (sb[2 * j + h] >> 4);
    }
    return;
  }
  if (t == GG_Q3_K) {
    const float d = half_to_f32(sb + 108);
    for (int h = 0; h < 2; ++h) {
      sw[h] = d * (scale_q3k(sb + 96, 2 * j + h) - 32);
      bw[h] = -4.f * sw[h];
    }
    return;
  }
  if (t == GG_IQ4_XS) {
    sw[0] = sw[1] = half_to_f32(sb) * (scale_iq4xs(sb, j) - 32);
    bw[0] = bw[1] = -128.f * sw[0];
    return;
  }
  if (t == GG_TQ2_0) {  // ternary: 2-bit q - 1
    sw[0] = sw[1] = half_to_f32(sb + 64);
    bw[0] = bw[1] = -sw[0];
    return;
  }
  if (t == GG_Q6_K) {
    const float d = half_to_f32(sb + 208);
    const int8_t* sc = (const int8_t*)(sb + 192) + 8 * (j / 4) + 2 * (j % 4);
    for (int h = 0; h < 2; ++h) {
      sw[h] = d * sc[h];
      bw[h] = -32.f * sw[h];
    }
    return;
  }
  int sc, m;
  scale_min_k4(j, sb + 4, &sc, &m);
  const float d = half_to_f32(sb) * sc, o = -half_to_f32(sb + 2) * m;
  sw[0] = sw[1] = d;
  bw[0] = bw[1] = o;
}

// 16 bytes of nibbles (element l low, l + 16 high) as a table's values + 128
static inline void table_values(const int8_t* table, const uint8_t* qs, uint8_t* q) {
  for (int l = 0; l < 16; ++l) {
    q[l] = (uint8_t)(table[qs[l] & 0xF] + 128);
    q[l + 16] = (uint8_t)(table[qs[l] >> 4] + 128);
  }
}

// The 32 unsigned values q of group g, in plain C (the portable path and the reference).
static void group_values(int t, const uint8_t* row, int g, uint8_t* q) {
  if (!is_super(t)) {
    const uint8_t* b = row + (int64_t)g * block_bytes(t);
    if (t == GG_Q8_0) {
      for (int l = 0; l < 32; ++l) q[l] = b[2 + l] ^ 0x80;
      return;
    }
    if (t == GG_IQ4_NL || t == GG_MXFP4) {
      table_values(table_of(t), b + (t == GG_MXFP4 ? 1 : 2), q);
      return;
    }
    const int lead = t == GG_Q4_0 ? 2 : t == GG_Q4_1 ? 4 : t == GG_Q5_0 ? 6 : 8;
    const uint8_t* qs = b + lead;
    uint32_t qh = 0;
    if (t == GG_Q5_0 || t == GG_Q5_1) memcpy(&qh, b + lead - 4, 4);
    for (int l = 0; l < 16; ++l) {
      q[l] = (qs[l] & 0xF) | (((qh >> l) & 1) << 4);
      q[l + 16] = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
    }
    return;
  }
  const uint8_t* sb = row + (int64_t)(g / 8) * block_bytes(t);
  const int j = g % 8;
  if (is_grid(t)) {
    uint64_t v[4];
    int sc[2];
    grid_run(t, sb, j, v, sc);
    memcpy(q, v, 32);
    for (int l = 0; l < 32; ++l) q[l] ^= 0x80;  // + 128
    return;
  }
  if (t == GG_Q2_K || t == GG_Q3_K || t == GG_TQ2_0) {  // 2 bits a byte; Q3_K: + a mask bit
    const uint8_t* qs = sb + low2_offset(t) + 32 * (j / 4);
    for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> (2 * (j % 4))) & 3;
    if (t == GG_Q3_K)
      for (int l = 0; l < 32; ++l) q[l] |= ((sb[l] >> j) & 1) << 2;
    return;
  }
  if (t == GG_IQ4_XS) {
    table_values(IQ4_VALUES, sb + 8 + 16 * j, q);
    return;
  }
  if (t == GG_Q6_K) {
    const int n = j / 4, part = j % 4;
    const uint8_t* ql = sb + 64 * n + (part & 1) * 32;
    const uint8_t* qh = sb + 128 + 32 * n;
    for (int l = 0; l < 32; ++l)
      q[l] = (part < 2 ? ql[l] & 0xF : ql[l] >> 4) | (((qh[l] >> (2 * part)) & 3) << 4);
    return;
  }
  const uint8_t* qs = sb + (t == GG_Q4_K ? 16 : 48) + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) q[l] = j % 2 ? qs[l] >> 4 : qs[l] & 0xF;
  if (t == GG_Q5_K)
    for (int l = 0; l < 32; ++l) q[l] |= ((sb[16 + l] >> j) & 1) << 4;
}

// One row of k weights as float32.
static void block_row_to_f32(int t, const uint8_t* row, int k, float* out) {
  uint8_t q[32];
  float sw[2], bw[2];
  for (int g = 0; g < k / 32; ++g) {
    group_values(t, row, g, q);
    group_params(t, row, g, sw, bw);
    for (int l = 0; l < 32; ++l) out[g * 32 + l] = sw[l / 16] * q[l] + bw[l / 16];
  }
}

// ---------------------------------------------------------------- activations ------
// Two formats, as the weights need them: for the 32-element formats (Q4_0 ... Q8_0), int8
// values with one scale per 32 (d32) and d32 times their sum (s32); for the K formats, one
// scale per 256 (d256) and the sums of the values over each 16 (bs), so that a K block
// multiplies in integers from its first weight to its last.
typedef struct {
  int8_t* q32;
  float* d32;
  float* s32;
  int8_t* q256;
  float* d256;
  int16_t* bs;
} tw_qact;

static inline size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

// Bytes of the room for B rows of k activations in both formats.
size_t tw_qact_bytes(int B, int k) {
  const size_t r = (size_t)B;
  return 2 * align64(r * k) + 2 * align64(r * (k / 32) * 4) + align64(r * ((k + 255) / 256) * 4) +
         align64(r * (k / 16) * 2);
}

// The room at buf laid out for B rows of width k (the same pointers in every thread).
static tw_qact qact_carve(void* buf, int B, int k) {
  char* p = (char*)buf;
  const size_t r = (size_t)B;
  tw_qact a;
  a.q32 = (int8_t*)p, p += align64(r * k);
  a.d32 = (float*)p, p += align64(r * (k / 32) * 4);
  a.s32 = (float*)p, p += align64(r * (k / 32) * 4);
  a.q256 = (int8_t*)p, p += align64(r * k);
  a.d256 = (float*)p, p += align64(r * ((k + 255) / 256) * 4);
  a.bs = (int16_t*)p;
  return a;
}

// row b of a (width k), as a set of rows starting there
static inline tw_qact qact_row(const tw_qact* a, int b, int k) {
  const tw_qact r = {a->q32 + (int64_t)b * k, a->d32 + (int64_t)b * (k / 32),
                     a->s32 + (int64_t)b * (k / 32), a->q256 + (int64_t)b * k,
                     a->d256 + (int64_t)b * ((k + 255) / 256), a->bs + (int64_t)b * (k / 16)};
  return r;
}

int tw_blocks_portable = 0;  // the plain C path even where the vector one is built (tests)

// Two vector paths: AVX-512 VNNI (TW_BLOCKS_VECTOR) where the CPU has it, else AVX2
// (TW_BLOCKS_AVX2: maddubs and madd, u8 x s8 into int16 pairs, then int32), else plain C.
// TW_BLOCKS_256 marks what both vector paths share (the 32 values of a group in a vector).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
#define TW_BLOCKS_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TW_BLOCKS_AVX2 1
#endif
#if defined(TW_BLOCKS_VECTOR) || defined(TW_BLOCKS_AVX2)
#define TW_BLOCKS_256 1
#endif

int tw_blocks_use_portable(int on) {
  tw_blocks_portable = on;
#if defined(TW_BLOCKS_256)
  return on;
#else
  return 1;  // the only path built here
#endif
}

// Which block products this build runs: 512 (AVX-512 VNNI), 256 (AVX2) or 0 (plain C).
int tw_blocks_isa(void) {
#if defined(TW_BLOCKS_VECTOR)
  return 512;
#elif defined(TW_BLOCKS_AVX2)
  return 256;
#else
  return 0;
#endif
}

// n values (a multiple of `span`) to int8 with one scale per span (32 or 256); per span
// its scale, and (span 32) the scale times the sum or (span 256) the sums over each 16.
static void quantize_spans(const float* x, int n, int span, int8_t* q, float* d, float* s,
                           int16_t* bs) {
  for (int g = 0; g < n / span; ++g) {
    const float* xs = x + (int64_t)g * span;
    int8_t* qs = q + (int64_t)g * span;
    float amax = 0.f;
    int l = 0;
#if defined(TW_BLOCKS_VECTOR)
    if (!tw_blocks_portable) {
      __m512 m = _mm512_setzero_ps();
      for (; l < span; l += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xs + l)));
      amax = _mm512_reduce_max_ps(m);
    }
#elif defined(TW_BLOCKS_AVX2)
    if (!tw_blocks_portable) {
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 m = _mm256_setzero_ps();
      for (; l < span; l += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + l)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    for (; l < span; ++l) amax = fmaxf(amax, fabsf(xs[l]));
    const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    d[g] = dd;
    int total = 0;
    for (int c = 0; c < span / 16; ++c) {  // 16 at a time: one sum each
      int sum = 0;
      l = 0;
#if defined(TW_BLOCKS_VECTOR)
      if (!tw_blocks_portable) {  // round to nearest even, as nearbyintf
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + 16 * c), _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i*)(qs + 16 * c), _mm512_cvtepi32_epi8(v));
        sum = _mm512_reduce_add_epi32(v);
        l = 16;
      }
#elif defined(TW_BLOCKS_AVX2)
      if (!tw_blocks_portable) {  // round to nearest even (the default rounding), as nearbyintf
        const __m256 sc = _mm256_set1_ps(id);
        const __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 16 * c), sc));
        const __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 16 * c + 8), sc));
        // int32 -> int16 -> int8 (the packs work within 128-bit halves: put them back in order)
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v0, v1), 0xD8);
        const __m128i b8 = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storeu_si128((__m128i*)(qs + 16 * c), b8);
        const __m256i s8 = _mm256_add_epi32(v0, v1);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
        l = 16;
      }
#endif
      for (; l < 16; ++l) {
        const int v = (int)nearbyintf(xs[16 * c + l] * id);
        qs[16 * c + l] = (int8_t)v;
        sum += v;
      }
      if (bs) bs[g * (span / 16) + c] = (int16_t)sum;
      total += sum;
    }
    if (s) s[g] = dd * total;
  }
}

// ---------------------------------------------------------------- products ---------

static void block_dot_portable(int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                               float* out) {
  const int groups = k / 32, kays = is_super(t);
  for (int b = 0; b < B; ++b) out[b] = 0.f;
  uint8_t q[32];
  float sw[2], bw[2];
  for (int g = 0; g < groups; ++g) {
    group_values(t, row, g, q);
    group_params(t, row, g, sw, bw);
    for (int b = 0; b < B; ++b) {
      const tw_qact r = qact_row(a, b, ka);
      const int8_t* ab = (kays ? r.q256 : r.q32) + g * 32;
      int p0 = 0, p1 = 0;
      for (int l = 0; l < 16; ++l) {
        p0 += q[l] * ab[l];
        p1 += q[l + 16] * ab[l + 16];
      }
      if (kays) {
        const float da = r.d256[g / 8];
        out[b] += da * (sw[0] * p0 + sw[1] * p1 + bw[0] * r.bs[2 * g] + bw[1] * r.bs[2 * g + 1]);
      } else {
        out[b] += r.d32[g] * sw[0] * (p0 + p1) + bw[0] * r.s32[g];
      }
    }
  }
}

#if defined(TW_BLOCKS_256)
#define INLINE static inline __attribute__((always_inline))

// Byte i all ones where bit i of m is set, else zero.
INLINE __m256i bytes_of_bits(uint32_t m) {
#if defined(TW_BLOCKS_VECTOR)
  return _mm256_movm_epi8(m);
#else  // byte i takes byte i / 8 of m, then tests its bit i % 8
  const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), which);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
#endif
}

// The 32 values of group g of a 32-element format in a vector (group_values, in AVX2).
INLINE __m256i group32(const int t, const uint8_t* b) {
  const __m256i low4 = _mm256_set1_epi8(0xF);
  if (t == GG_Q8_0)
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(b + 2)), _mm256_set1_epi8(-128));
  const int lead = t == GG_Q4_0 ? 2 : t == GG_Q4_1 ? 4 : t == GG_Q5_0 ? 6 : 8;
  const __m128i v = _mm_loadu_si128((const __m128i*)(b + lead));
  __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
  if (t == GG_Q5_0 || t == GG_Q5_1) {
    uint32_t qh;
    memcpy(&qh, b + lead - 4, 4);
    q = _mm256_or_si256(q, _mm256_and_si256(bytes_of_bits(qh), _mm256_set1_epi8(0x10)));
  }
  return q;
}

// a group's offset: w = d * q + offset
INLINE float offset32(const int t, const uint8_t* b, float d) {
  if (t == GG_Q4_1 || t == GG_Q5_1) return half_to_f32(b + 2);
  return -(t == GG_Q4_0 ? 8.f : t == GG_Q5_0 ? 16.f : 128.f) * d;
}

// Eight float16 values `stride` bytes apart, as floats.
INLINE __m256 halves8(const uint8_t* p, int stride) {
  uint16_t h[8];
  for (int i = 0; i < 8; ++i) memcpy(&h[i], p + i * stride, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
}

// Q4_K and Q5_K's 12 bytes of 6-bit scales and minimums, unpacked at once: bytes 0-7 of
// the result are the eight sub-blocks' scales, bytes 8-15 their minimums.
INLINE __m128i scales_mins_k4(const uint8_t* s) {
  uint32_t u[3];
  memcpy(u, s, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3f, m_lo = u[1] & 0x3f3f3f3f;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  return _mm_set_epi32((int)m_hi, (int)m_lo, (int)sc_hi, (int)sc_lo);
}

// 16 bytes of nibbles (element l low, l + 16 high) looked up in a table of 16 bytes
// (repeated in both lanes): the signed values, or the values + 128.
INLINE __m256i table_lookup(const int8_t* table, const uint8_t* qs, int plus128) {
  const __m128i v = _mm_loadu_si128((const __m128i*)qs);
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0xF));
  const __m128i tab = _mm_loadu_si128((const __m128i*)table);
  const __m128i t = plus128 ? _mm_xor_si128(tab, _mm_set1_epi8(-128)) : tab;
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib);
}

// Q2_K, Q3_K and TQ2_0: 2 bits of each of 32 bytes, run j of a super-block (Q3_K: + the
// mask's bit j as the third)
INLINE __m256i group_low2(int t, const uint8_t* sb, int j) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)(sb + low2_offset(t) + 32 * (j / 4)));
  __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (j % 4))), _mm256_set1_epi8(3));
  if (t == GG_Q3_K) {
    const __m256i m = _mm256_loadu_si256((const __m256i*)sb);
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(m, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 2));
  }
  return q;
}

// The 32 values of group g of any executed format in a vector (group_values, in AVX2).
static inline __m256i group_any(int t, const uint8_t* row, int g) {
  if (!is_super(t)) {
    switch (t) {
      case GG_Q4_0: return group32(GG_Q4_0, row + (int64_t)g * 18);
      case GG_Q4_1: return group32(GG_Q4_1, row + (int64_t)g * 20);
      case GG_Q5_0: return group32(GG_Q5_0, row + (int64_t)g * 22);
      case GG_Q5_1: return group32(GG_Q5_1, row + (int64_t)g * 24);
      case GG_IQ4_NL: return table_lookup(IQ4_VALUES, row + (int64_t)g * 18 + 2, 1);
      case GG_MXFP4: return table_lookup(MXFP4_VALUES, row + (int64_t)g * 17 + 1, 1);
      default: return group32(GG_Q8_0, row + (int64_t)g * 34);
    }
  }
  const __m256i low4 = _mm256_set1_epi8(0xF);
  const uint8_t* sb = row + (int64_t)(g / 8) * block_bytes(t);
  const int j = g % 8;
  if (is_grid(t)) {  // decoded a word at a time (grid_run), then + 128
    uint64_t v[4];
    int sc[2];
    grid_run(t, sb, j, v, sc);
    return _mm256_xor_si256(_mm256_set_epi64x((long long)v[3], (long long)v[2], (long long)v[1],
                                              (long long)v[0]),
                            _mm256_set1_epi8(-128));
  }
  if (t == GG_Q2_K || t == GG_Q3_K || t == GG_TQ2_0) return group_low2(t, sb, j);
  if (t == GG_IQ4_XS) return table_lookup(IQ4_VALUES, sb + 8 + 16 * j, 1);
  if (t == GG_Q6_K) {
    const int n = j / 4, part = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i*)(sb + 64 * n + (part & 1) * 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(sb + 128 + 32 * n));
    const __m256i lo = _mm256_and_si256(part < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * part)),
                                        _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  const __m256i v = _mm256_loadu_si256((const __m256i*)(sb + (t == GG_Q4_K ? 16 : 48) + 32 * (j / 2)));
  __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
  if (t == GG_Q5_K) {
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(sb + 16));
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
  }
  return q;
}
#endif

#if defined(TW_BLOCKS_VECTOR)
// A 32-element format, eight groups (256 values) at a time: their scales and offsets as
// vectors of eight, each pair of groups one dpbusd, its two groups' scales spread over the
// lanes by a permute; the offsets times the activations' sums in a vector of their own.
// A tail of fewer than eight groups goes a pair (or one) at a time.
INLINE void dot32(const int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                  float* out) {
  const int groups = k / 32, bb = block_bytes(t);
  const int has_min = t == GG_Q4_1 || t == GG_Q5_1;
  const float zp = t == GG_Q4_0 ? 8.f : t == GG_Q5_0 ? 16.f : 128.f;
  __m512i pick[4];  // lanes 0-7: group 2p's scale, 8-15: group 2p+1's
  for (int p = 0; p < 4; ++p)
    pick[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
  __m512 acc[BLOCK_MAX_ROWS];
  __m256 offs[BLOCK_MAX_ROWS];
  float off[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b)
    acc[b] = _mm512_setzero_ps(), offs[b] = _mm256_setzero_ps(), off[b] = 0.f;
  int g = 0;
  for (; g + 8 <= groups; g += 8) {
    const uint8_t* b0 = row + (int64_t)g * bb;
    const __m256 d = halves8(b0, bb);
    const __m256 o = has_min ? halves8(b0 + 2, bb) : _mm256_mul_ps(d, _mm256_set1_ps(-zp));
    __m512i q[4];
    for (int p = 0; p < 4; ++p)
      q[p] = _mm512_inserti64x4(_mm512_castsi256_si512(group32(t, b0 + 2 * p * bb)),
                                group32(t, b0 + (2 * p + 1) * bb), 1);
    for (int b = 0; b < B; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      const __m256 dd = _mm256_mul_ps(d, _mm256_loadu_ps(a->d32 + (int64_t)b * (ka / 32) + g));
      const __m512 dd512 = _mm512_castps256_ps512(dd);
      for (int p = 0; p < 4; ++p) {
        const __m512i prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[p], _mm512_loadu_si512(ab + 64 * p));
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), _mm512_permutexvar_ps(pick[p], dd512), acc[b]);
      }
      offs[b] = _mm256_fmadd_ps(o, _mm256_loadu_ps(a->s32 + (int64_t)b * (ka / 32) + g), offs[b]);
    }
  }
  for (; g < groups; ++g) {  // the tail, a group at a time
    const uint8_t* b0 = row + (int64_t)g * bb;
    const __m256i q = group32(t, b0);
    const float d0 = half_to_f32(b0), o0 = offset32(t, b0, d0);
    for (int b = 0; b < B; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, _mm256_loadu_si256((const __m256i*)ab));
      const float da = a->d32[(int64_t)b * (ka / 32) + g];
      acc[b] = _mm512_add_ps(acc[b], _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d0 * da))));
      off[b] += o0 * a->s32[(int64_t)b * (ka / 32) + g];
    }
  }
  for (int b = 0; b < B; ++b) out[b] = _mm512_reduce_add_ps(acc[b]) + hsum8(offs[b]) + off[b];
}

// A K super-block's 256 values (q, four runs of 64 unsigned values) times its activations
// (int8), each pair of products times its run's int16 scales (s16), summed in int32 lanes.
INLINE __m512i super_block_sum(const __m512i q[4], const __m512i s16[4], const int8_t* ab) {
  __m512i isum = _mm512_setzero_si512();
  for (int r = 0; r < 4; ++r)
    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q[r], _mm512_loadu_si512(ab + 64 * r)), s16[r]);
  return isum;
}

// Q4_K and Q5_K: per super-block of 256, four pairs of sub-blocks, each 64 values times
// the activations (maddubs) times the sub-blocks' 6-bit scales (dpwssd), in int32 to the
// block's end; the minimums times the activations' sums per 16 (madd), in a vector of
// their own, summed once at the row's end.
INLINE void dot_q45k(const int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                     float* out) {
  const int nsb = k / 256, bb = block_bytes(t);
  const __m512i low4 = _mm512_set1_epi8(0xF);
  // int16 lane -> a pair's scale: lanes 0-15 the first sub-block's, 16-31 the second's
  const __m512i half = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0,
                                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  // each minimum twice: it multiplies two sums of 16
  const __m128i twice = _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  __m512 acc[BLOCK_MAX_ROWS];
  __m256 mins[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps(), mins[b] = _mm256_setzero_ps();
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* sb = row + (int64_t)i * bb;
    const float d = half_to_f32(sb), dmin = half_to_f32(sb + 2);
    const __m128i scm = scales_mins_k4(sb + 4);
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(scm));
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scm, twice));
    const uint8_t* qs = sb + (t == GG_Q4_K ? 16 : 48);
    __m512i q[4], s16[4];
    const __m256i qh = t == GG_Q5_K ? _mm256_loadu_si256((const __m256i*)(sb + 16)) : _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * p));
      __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
      w = _mm512_and_si512(w, low4);
      if (t == GG_Q5_K) {
        const __m256i one = _mm256_set1_epi8(1);
        const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p)), one);
        const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p + 1)), one);
        const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
        w = _mm512_or_si512(w, _mm512_slli_epi16(h, 4));
      }
      q[p] = w;
      s16[p] = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16((short)(2 * p))), sc16);
    }
    for (int b = 0; b < B; ++b) {
      const __m512i isum = super_block_sum(q, s16, a->q256 + (int64_t)b * ka + i * 256);
      const float da = a->d256[(int64_t)b * ((ka + 255) / 256) + i];
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * da), acc[b]);
      const __m256i bs = _mm256_loadu_si256((const __m256i*)(a->bs + (int64_t)b * (ka / 16) + i * 16));
      mins[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, m16)),
                                _mm256_set1_ps(dmin * da), mins[b]);
    }
  }
  for (int b = 0; b < B; ++b) out[b] = _mm512_reduce_add_ps(acc[b]) - hsum8(mins[b]);
}

// Q6_K: per super-block, four runs of 64 values (6 bits: 4 from ql, 2 from qh), each 16 of
// them with its own signed 8-bit scale; values are q - 32, the 32 taken off through the sums.
INLINE void dot_q6k(const uint8_t* row, int k, const tw_qact* a, int B, int ka, float* out) {
  const int nsb = k / 256;
  const __m512i low4 = _mm512_set1_epi8(0xF);
  const __m256i three = _mm256_set1_epi8(3);
  // int16 lane -> which of a run's four scales: lanes 0-7 the first, 8-15 the second, ...
  const __m512i lanes = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1,
                                         1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[BLOCK_MAX_ROWS];
  __m256 offs[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps(), offs[b] = _mm256_setzero_ps();
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* sb = row + (int64_t)i * 210;
    const float d = half_to_f32(sb + 208);
    const __m256i sc256 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(sb + 192)));
    const __m512i sc16 = _mm512_castsi256_si512(sc256);
    __m512i q[4], s16[4];
    for (int n = 0; n < 2; ++n) {
      const __m512i l64 = _mm512_loadu_si512(sb + 64 * n);
      const __m256i h = _mm256_loadu_si256((const __m256i*)(sb + 128 + 32 * n));
      const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(h, three)),
                                             _mm256_and_si256(_mm256_srli_epi16(h, 2), three), 1);
      const __m512i h23 = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(h, 4), three)),
          _mm256_and_si256(_mm256_srli_epi16(h, 6), three), 1);
      q[2 * n] = _mm512_or_si512(_mm512_and_si512(l64, low4), _mm512_slli_epi16(h01, 4));
      q[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l64, 4), low4), _mm512_slli_epi16(h23, 4));
    }
    for (int r = 0; r < 4; ++r)
      s16[r] = _mm512_permutexvar_epi16(_mm512_add_epi16(lanes, _mm512_set1_epi16((short)(4 * r))), sc16);
    for (int b = 0; b < B; ++b) {
      const __m512i isum = super_block_sum(q, s16, a->q256 + (int64_t)b * ka + i * 256);
      const float dd = d * a->d256[(int64_t)b * ((ka + 255) / 256) + i];
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dd), acc[b]);
      const __m256i bs = _mm256_loadu_si256((const __m256i*)(a->bs + (int64_t)b * (ka / 16) + i * 16));
      offs[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, sc256)),
                                _mm256_set1_ps(32.f * dd), offs[b]);
    }
  }
  for (int b = 0; b < B; ++b) out[b] = _mm512_reduce_add_ps(acc[b]) - hsum8(offs[b]);
}
#endif

#if defined(TW_BLOCKS_AVX2)
// 32 weight values (u8; Q8_0: its signed bytes) times 32 activations (s8), summed in
// fours: int32 lanes 0-3 hold the first 16 values' sums, 4-7 the last 16's. maddubs sums
// pairs into int16: 4 or 6 bits times 127 stays in range, and Q8_0 multiplies |w| by the
// activation with w's sign (128 x 127 x 2 < 2^15).
INLINE __m256i dot32_i32(const int t, __m256i q, __m256i a) {
  const __m256i pairs = t == GG_Q8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(a, q))
                                     : _mm256_maddubs_epi16(q, a);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// A group's values as dot32_i32 takes them: Q8_0's signed bytes as stored (no offset).
INLINE __m256i group32s(const int t, const uint8_t* b) {
  return t == GG_Q8_0 ? _mm256_loadu_si256((const __m256i*)(b + 2)) : group32(t, b);
}

// Eight vectors of int32 lanes -> one: lane j the sum of vector j's eight lanes.
INLINE __m256i sum8x8(const __m256i p[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// A 32-element format, eight groups (256 values) at a time: each group's integer sum in a
// lane of one vector, times the eight groups' scales at once; the offsets times the
// activations' sums in a vector of their own. A tail of fewer than eight goes one by one.
INLINE void dot32(const int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                  float* out) {
  const int groups = k / 32, bb = block_bytes(t);
  const int has_min = t == GG_Q4_1 || t == GG_Q5_1;
  const float zp = t == GG_Q4_0 ? 8.f : t == GG_Q5_0 ? 16.f : 0.f;  // Q8_0: signed, none
  __m256 acc[BLOCK_MAX_ROWS], offs[BLOCK_MAX_ROWS];
  float off[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b) acc[b] = offs[b] = _mm256_setzero_ps(), off[b] = 0.f;
  int g = 0;
  for (; g + 8 <= groups; g += 8) {
    const uint8_t* b0 = row + (int64_t)g * bb;
    const __m256 d = halves8(b0, bb);
    const __m256 o = has_min ? halves8(b0 + 2, bb) : _mm256_mul_ps(d, _mm256_set1_ps(-zp));
    __m256i q[8];
    for (int j = 0; j < 8; ++j) q[j] = group32s(t, b0 + j * bb);
    for (int b = 0; b < B; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      __m256i p[8];
      for (int j = 0; j < 8; ++j) p[j] = dot32_i32(t, q[j], _mm256_loadu_si256((const __m256i*)(ab + 32 * j)));
      const float* da = a->d32 + (int64_t)b * (ka / 32) + g;
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(p)), _mm256_mul_ps(d, _mm256_loadu_ps(da)), acc[b]);
      if (t != GG_Q8_0)
        offs[b] = _mm256_fmadd_ps(o, _mm256_loadu_ps(a->s32 + (int64_t)b * (ka / 32) + g), offs[b]);
    }
  }
  for (; g < groups; ++g) {
    const uint8_t* b0 = row + (int64_t)g * bb;
    const __m256i q = group32s(t, b0);
    const float d0 = half_to_f32(b0), o0 = t == GG_Q8_0 ? 0.f : offset32(t, b0, d0);
    for (int b = 0; b < B; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      const __m256i p = dot32_i32(t, q, _mm256_loadu_si256((const __m256i*)ab));
      const float da = a->d32[(int64_t)b * (ka / 32) + g];
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d0 * da), acc[b]);
      off[b] += o0 * a->s32[(int64_t)b * (ka / 32) + g];
    }
  }
  for (int b = 0; b < B; ++b) out[b] = hsum8(acc[b]) + hsum8(offs[b]) + off[b];
}

// Q4_K and Q5_K: per super-block, eight sub-blocks of 32 values, each times the
// activations (maddubs) times its 6-bit scale (madd), in int32 to the block's end; the
// minimums times the activations' sums per 16 (madd), in a vector of their own.
INLINE void dot_q45k(const int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                     float* out) {
  const int nsb = k / 256, bb = block_bytes(t);
  const __m256i low4 = _mm256_set1_epi8(0xF);
  const __m128i twice = _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  __m256 acc[BLOCK_MAX_ROWS], mins[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b) acc[b] = mins[b] = _mm256_setzero_ps();
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* sb = row + (int64_t)i * bb;
    const float d = half_to_f32(sb), dmin = half_to_f32(sb + 2);
    const __m128i scm = scales_mins_k4(sb + 4);
    uint8_t sc[16];
    _mm_storeu_si128((__m128i*)sc, scm);
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scm, twice));
    const uint8_t* qs = sb + (t == GG_Q4_K ? 16 : 48);
    const __m256i qh = t == GG_Q5_K ? _mm256_loadu_si256((const __m256i*)(sb + 16)) : _mm256_setzero_si256();
    __m256i q[8];
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * (j / 2)));
      q[j] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
      if (t == GG_Q5_K) {
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        q[j] = _mm256_or_si256(q[j], _mm256_slli_epi16(bit, 4));
      }
    }
    for (int b = 0; b < B; ++b) {
      const int8_t* ab = a->q256 + (int64_t)b * ka + i * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i*)(ab + 32 * j)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(sc[j])));
      }
      const float da = a->d256[(int64_t)b * ((ka + 255) / 256) + i];
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * da), acc[b]);
      const __m256i bs = _mm256_loadu_si256((const __m256i*)(a->bs + (int64_t)b * (ka / 16) + i * 16));
      mins[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, m16)),
                                _mm256_set1_ps(dmin * da), mins[b]);
    }
  }
  for (int b = 0; b < B; ++b) out[b] = hsum8(acc[b]) - hsum8(mins[b]);
}

// Q6_K: per super-block, eight runs of 32 values (6 bits: 4 from ql, 2 from qh), each 16
// with its own signed 8-bit scale; values are q - 32, the 32 taken off through the sums.
INLINE void dot_q6k(const uint8_t* row, int k, const tw_qact* a, int B, int ka, float* out) {
  const int nsb = k / 256;
  __m256 acc[BLOCK_MAX_ROWS], offs[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b) acc[b] = offs[b] = _mm256_setzero_ps();
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* sb = row + (int64_t)i * 210;
    const float d = half_to_f32(sb + 208);
    const int8_t* sc = (const int8_t*)(sb + 192);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
    __m256i q[8], s16[8];
    for (int j = 0; j < 8; ++j) {
      q[j] = group_any(GG_Q6_K, sb, j);
      s16[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
    }
    for (int b = 0; b < B; ++b) {
      const int8_t* ab = a->q256 + (int64_t)b * ka + i * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i*)(ab + 32 * j)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, s16[j]));
      }
      const float dd = d * a->d256[(int64_t)b * ((ka + 255) / 256) + i];
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dd), acc[b]);
      const __m256i bs = _mm256_loadu_si256((const __m256i*)(a->bs + (int64_t)b * (ka / 16) + i * 16));
      offs[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, sc16)),
                                _mm256_set1_ps(32.f * dd), offs[b]);
    }
  }
  for (int b = 0; b < B; ++b) out[b] = hsum8(acc[b]) - hsum8(offs[b]);
}
#endif

#if defined(TW_BLOCKS_256)
// Q2_K, Q3_K, IQ4_XS and TQ2_0, and IQ4_NL and MXFP4, in AVX2's instructions on both
// vector paths.
// 32 weights times 32 activations, in int32 lanes (0-3: the first 16, 4-7: the last 16),
// each 16's pair sums times its int16 scale in s16. Signed weights (IQ4's table values)
// multiply as |w| times the activation with w's sign (127 x 127 x 2 < 2^15).
INLINE __m256i scaled32(__m256i q, __m256i a, __m256i s16, const int is_signed) {
  const __m256i pairs = is_signed ? _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(a, q))
                                  : _mm256_maddubs_epi16(q, a);
  return _mm256_madd_epi16(pairs, s16);
}

// A super-block of 256 as eight runs of 32, w = d * sc * q - doff * mn for each 16 (sc and
// mn small integers): the scaled integer sums to the block's end, then once in float; the
// offsets times the activations' sums per 16 in a vector of their own.
INLINE void dot_lowbit(const int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                       float* out) {
  const int nsb = k / 256, bb = block_bytes(t), sgn = t == GG_IQ4_XS;
  __m256 acc[BLOCK_MAX_ROWS], offs[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b) acc[b] = offs[b] = _mm256_setzero_ps();
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* sb = row + (int64_t)i * bb;
    int16_t sc[16], mn[16];
    float d, doff = 0.f;
    if (t == GG_Q2_K) {  // a byte a 16: the scale in the low 4 bits, the minimum in the high
      d = half_to_f32(sb + 80), doff = half_to_f32(sb + 82);
      const __m128i b = _mm_loadu_si128((const __m128i*)sb);
      const __m128i low4 = _mm_set1_epi8(0xF);
      _mm256_storeu_si256((__m256i*)sc, _mm256_cvtepu8_epi16(_mm_and_si128(b, low4)));
      _mm256_storeu_si256((__m256i*)mn, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low4)));
    } else if (t == GG_Q3_K) {  // sixteen 6-bit scales (scale_q3k), four bytes at a time
      d = half_to_f32(sb + 108), doff = 4.f * d;
      uint32_t u[3];
      memcpy(u, sb + 96, 12);
      const uint32_t lo = 0x0f0f0f0f, hi = 0x03030303;
      const __m128i s6 = _mm_set_epi32((int)(((u[1] >> 4) & lo) | (((u[2] >> 6) & hi) << 4)),
                                       (int)(((u[0] >> 4) & lo) | (((u[2] >> 4) & hi) << 4)),
                                       (int)((u[1] & lo) | (((u[2] >> 2) & hi) << 4)),
                                       (int)((u[0] & lo) | ((u[2] & hi) << 4)));
      const __m256i s16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(s6), _mm256_set1_epi16(32));
      _mm256_storeu_si256((__m256i*)sc, s16);
      _mm256_storeu_si256((__m256i*)mn, s16);
    } else if (t == GG_TQ2_0) {  // q - 1, one scale
      d = doff = half_to_f32(sb + 64);
      for (int h = 0; h < 16; ++h) sc[h] = mn[h] = 1;
    } else {  // IQ4_XS: signed values, no offset
      d = half_to_f32(sb);
      for (int ib = 0; ib < 8; ++ib) sc[2 * ib] = sc[2 * ib + 1] = (int16_t)(scale_iq4xs(sb, ib) - 32);
      memset(mn, 0, sizeof mn);
    }
    const __m256i m16 = _mm256_loadu_si256((const __m256i*)mn);
    __m256i q[8], s16[8];
    for (int j = 0; j < 8; ++j)
      q[j] = sgn ? table_lookup(IQ4_VALUES, sb + 8 + 16 * j, 0) : group_low2(t, sb, j);
    for (int j = 0; j < 8; ++j)
      s16[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
    for (int b = 0; b < B; ++b) {
      const int8_t* ab = a->q256 + (int64_t)b * ka + i * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        isum = _mm256_add_epi32(isum, scaled32(q[j], _mm256_loadu_si256((const __m256i*)(ab + 32 * j)),
                                               s16[j], sgn));
      const float da = a->d256[(int64_t)b * ((ka + 255) / 256) + i];
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * da), acc[b]);
      if (!sgn) {
        const __m256i bs = _mm256_loadu_si256((const __m256i*)(a->bs + (int64_t)b * (ka / 16) + i * 16));
        offs[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, m16)),
                                  _mm256_set1_ps(doff * da), offs[b]);
      }
    }
  }
  for (int b = 0; b < B; ++b) out[b] = hsum8(acc[b]) - hsum8(offs[b]);
}

// IQ4_NL and MXFP4: blocks of 32 table values with one scale each (float16; MXFP4: a
// power of two in a byte).
INLINE void dot_table32(const int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                        float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int bb = block_bytes(t);
  __m256 acc[BLOCK_MAX_ROWS];
  for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();
  for (int g = 0; g < k / 32; ++g) {
    const uint8_t* b0 = row + (int64_t)g * bb;
    const float d = t == GG_MXFP4 ? e8m0_half(b0[0]) : half_to_f32(b0);
    const __m256i q = table_lookup(table_of(t), b0 + (t == GG_MXFP4 ? 1 : 2), 0);
    for (int b = 0; b < B; ++b) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(a->q32 + (int64_t)b * ka + g * 32));
      const __m256i p = scaled32(q, x, ones, 1);
      const float da = a->d32[(int64_t)b * (ka / 32) + g];
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * da), acc[b]);
    }
  }
  for (int b = 0; b < B; ++b) out[b] = hsum8(acc[b]);
}

// The grid formats (grid_run decodes each run of 32 a word at a time): signed values with an
// integer scale a 16 and a float unit a super-block, multiplied as IQ4_XS's are. A
// super-block decoded: each run's values (q) and its two 16s' scales (s16).
INLINE void grid_decode(const int t, const uint8_t* sb, __m256i q[8], __m256i s16[8]) {
  for (int j = 0; j < 8; ++j) {
    uint64_t v[4];
    int sc[2];
    grid_run(t, sb, j, v, sc);
    q[j] = _mm256_set_epi64x((long long)v[3], (long long)v[2], (long long)v[1], (long long)v[0]);
    s16[j] = _mm256_set_m128i(_mm_set1_epi16((int16_t)sc[1]), _mm_set1_epi16((int16_t)sc[0]));
  }
}

// token b's int32 sums over super-block i, then into its accumulator
INLINE __m256 grid_token(const __m256i q[8], const __m256i s16[8], float d, const tw_qact* a,
                         int b, int i, int ka, __m256 acc) {
  const int8_t* ab = a->q256 + (int64_t)b * ka + i * 256;
  __m256i isum = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j)
    isum = _mm256_add_epi32(
        isum, scaled32(q[j], _mm256_loadu_si256((const __m256i*)(ab + 32 * j)), s16[j], 1));
  const float da = a->d256[(int64_t)b * ((ka + 255) / 256) + i];
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * da), acc);
}

// B tokens against a row, acc: room for their accumulators (registers where B is a constant)
INLINE void dot_grid_into(const int t, const uint8_t* row, int k, const tw_qact* a, int B,
                          int ka, __m256* acc, float* out) {
  const int bb = block_bytes(t);
  for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();
  for (int i = 0; i < k / 256; ++i) {
    __m256i q[8], s16[8];
    grid_decode(t, row + (int64_t)i * bb, q, s16);
    const float d = grid_unit(t, row + (int64_t)i * bb);
    for (int b = 0; b < B; ++b) acc[b] = grid_token(q, s16, d, a, b, i, ka, acc[b]);
  }
  for (int b = 0; b < B; ++b) out[b] = hsum8(acc[b]);
}

INLINE void dot_grid(const int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                     float* out) {
  __m256 acc[BLOCK_MAX_ROWS];
  dot_grid_into(t, row, k, a, B, ka, acc, out);
}

// dot_grid for up to GRID_TOKENS tokens, their accumulators in memory: each token's steps
// are dot_grid's, so its result has the same bits in a batch of any size.
static void dot_grid_wide(const int t, const uint8_t* row, int k, const tw_qact* a, int B,
                          int ka, float* out) {
  __m256 acc[GRID_TOKENS];
  dot_grid_into(t, row, k, a, B, ka, acc, out);
}

// Each kernel once for every row count up to BLOCK_MAX_ROWS: with the count a constant,
// the rows' accumulators live in registers rather than on the stack.
#define ROWS_SWITCH(call)                                  \
  switch (B) {                                             \
    case 1: call(1); break;                                \
    case 2: call(2); break;                                \
    case 3: call(3); break;                                \
    case 4: call(4); break;                                \
    case 5: call(5); break;                                \
    case 6: call(6); break;                                \
    case 7: call(7); break;                                \
    default: call(8); break;                               \
  }
#define KERNEL(name, body)                                                            \
  static void name(const uint8_t* r, int k, const tw_qact* a, int B, int ka, float* o) { \
    ROWS_SWITCH(body)                                                                 \
  }
#define CALL_Q4_0(n) dot32(GG_Q4_0, r, k, a, n, ka, o)
#define CALL_Q4_1(n) dot32(GG_Q4_1, r, k, a, n, ka, o)
#define CALL_Q5_0(n) dot32(GG_Q5_0, r, k, a, n, ka, o)
#define CALL_Q5_1(n) dot32(GG_Q5_1, r, k, a, n, ka, o)
#define CALL_Q8_0(n) dot32(GG_Q8_0, r, k, a, n, ka, o)
#define CALL_Q4_K(n) dot_q45k(GG_Q4_K, r, k, a, n, ka, o)
#define CALL_Q5_K(n) dot_q45k(GG_Q5_K, r, k, a, n, ka, o)
#define CALL_Q6_K(n) dot_q6k(r, k, a, n, ka, o)
#define CALL_Q2_K(n) dot_lowbit(GG_Q2_K, r, k, a, n, ka, o)
#define CALL_Q3_K(n) dot_lowbit(GG_Q3_K, r, k, a, n, ka, o)
#define CALL_IQ4_XS(n) dot_lowbit(GG_IQ4_XS, r, k, a, n, ka, o)
#define CALL_IQ4_NL(n) dot_table32(GG_IQ4_NL, r, k, a, n, ka, o)
#define CALL_MXFP4(n) dot_table32(GG_MXFP4, r, k, a, n, ka, o)
#define CALL_TQ2_0(n) dot_lowbit(GG_TQ2_0, r, k, a, n, ka, o)
#define CALL_GRID(n) dot_grid(t, r, k, a, n, ka, o)
KERNEL(dot_q4_0, CALL_Q4_0)
KERNEL(dot_q4_1, CALL_Q4_1)
KERNEL(dot_q5_0, CALL_Q5_0)
KERNEL(dot_q5_1, CALL_Q5_1)
KERNEL(dot_q8_0, CALL_Q8_0)
KERNEL(dot_q4k, CALL_Q4_K)
KERNEL(dot_q5k, CALL_Q5_K)
KERNEL(dot_q6kn, CALL_Q6_K)
KERNEL(dot_q2k, CALL_Q2_K)
KERNEL(dot_q3k, CALL_Q3_K)
KERNEL(dot_iq4xs, CALL_IQ4_XS)
KERNEL(dot_iq4nl, CALL_IQ4_NL)
KERNEL(dot_mxfp4, CALL_MXFP4)
KERNEL(dot_tq2_0, CALL_TQ2_0)
// (one for every grid format: the format is an argument, not a constant)
INLINE void dot_grids(int t, const uint8_t* r, int k, const tw_qact* a, int B, int ka, float* o) {
  ROWS_SWITCH(CALL_GRID)
}
#define GRID_KERNEL(name, type) \
  static void name(const uint8_t* r, int k, const tw_qact* a, int B, int ka, float* o) { \
    dot_grids(type, r, k, a, B, ka, o); \
  }
GRID_KERNEL(dot_iq2xxs, GG_IQ2_XXS)
GRID_KERNEL(dot_iq2xs, GG_IQ2_XS)
GRID_KERNEL(dot_iq2s, GG_IQ2_S)
GRID_KERNEL(dot_iq3xxs, GG_IQ3_XXS)
GRID_KERNEL(dot_iq3s, GG_IQ3_S)
GRID_KERNEL(dot_iq1s, GG_IQ1_S)
GRID_KERNEL(dot_iq1m, GG_IQ1_M)
GRID_KERNEL(dot_tq1_0, GG_TQ1_0)
#endif

#if defined(TW_BLOCKS_VECTOR)
// One row of k weights to float32 or bfloat16 (out_dtype), 16 at a time.
static void block_row_vector(int t, const uint8_t* row, int k, void* out, int out_dtype) {
  for (int g = 0; g < k / 32; ++g) {
    const __m256i q = group_any(t, row, g);
    float sw[2], bw[2];
    group_params(t, row, g, sw, bw);
    for (int h = 0; h < 2; ++h) {
      const __m128i part = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part)),
                                       _mm512_set1_ps(sw[h]), _mm512_set1_ps(bw[h]));
      const int64_t at = (int64_t)g * 32 + 16 * h;
      if (out_dtype == TW_F32) _mm512_storeu_ps((float*)out + at, v);
      else _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}
#endif
#if defined(TW_BLOCKS_AVX2)
// One row of k weights to float32 or bfloat16 (out_dtype), 8 at a time.
static void block_row_vector(int t, const uint8_t* row, int k, void* out, int out_dtype) {
  for (int g = 0; g < k / 32; ++g) {
    uint8_t q[32];
    _mm256_storeu_si256((__m256i*)q, group_any(t, row, g));
    float sw[2], bw[2];
    group_params(t, row, g, sw, bw);
    for (int e = 0; e < 4; ++e) {
      const __m256i q8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * e)));
      const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8), _mm256_set1_ps(sw[e / 2]),
                                       _mm256_set1_ps(bw[e / 2]));
      const int64_t at = (int64_t)g * 32 + 8 * e;
      if (out_dtype == TW_F32) _mm256_storeu_ps((float*)out + at, v);
      else _mm_storeu_si128((__m128i*)((uint16_t*)out + at), bf16x8(v));
    }
  }
}
#endif

typedef void (*tw_block_dot)(const uint8_t* row, int k, const tw_qact* a, int B, int ka, float* out);

// dot_grid_wide where the vector products are built (block_rows_part asks only then).
static void grid_wide(int t, const uint8_t* row, int k, const tw_qact* a, int B, int ka,
                      float* out) {
#if defined(TW_BLOCKS_256)
  dot_grid_wide(t, row, k, a, B, ka, out);
#else
  (void)t, (void)row, (void)k, (void)a, (void)B, (void)ka, (void)out;
#endif
}

// The vector product of type t where it is built (and not switched off), else NULL.
static tw_block_dot vector_dot(int t) {
#if defined(TW_BLOCKS_256)
  if (tw_blocks_portable) return NULL;
  switch (t) {
    case GG_Q4_0: return dot_q4_0;
    case GG_Q4_1: return dot_q4_1;
    case GG_Q5_0: return dot_q5_0;
    case GG_Q5_1: return dot_q5_1;
    case GG_Q8_0: return dot_q8_0;
    case GG_Q4_K: return dot_q4k;
    case GG_Q5_K: return dot_q5k;
    case GG_Q6_K: return dot_q6kn;
    case GG_Q2_K: return dot_q2k;
    case GG_Q3_K: return dot_q3k;
    case GG_IQ4_XS: return dot_iq4xs;
    case GG_IQ4_NL: return dot_iq4nl;
    case GG_MXFP4: return dot_mxfp4;
    case GG_TQ2_0: return dot_tq2_0;
    case GG_IQ2_XXS: return dot_iq2xxs;
    case GG_IQ2_XS: return dot_iq2xs;
    case GG_IQ2_S: return dot_iq2s;
    case GG_IQ3_XXS: return dot_iq3xxs;
    case GG_IQ3_S: return dot_iq3s;
    case GG_IQ1_S: return dot_iq1s;
    case GG_IQ1_M: return dot_iq1m;
    case GG_TQ1_0: return dot_tq1_0;
  }
#endif
  (void)t;
  return NULL;
}

// Quantise rows [0, B) of x (float32 [B, k]) into a, in the formats `need` asks for (1: per
// 32, 2: per 256), shared among the threads (inside a parallel region; a barrier ends it).
static inline void quantize_row(const float* xr, int b, int k, const tw_qact* a, int need) {
  const tw_qact r = qact_row(a, b, k);
  if (need & 1) quantize_spans(xr, k, 32, r.q32, r.d32, r.s32, NULL);
  if (need & 2) quantize_spans(xr, k, 256, r.q256, r.d256, NULL, r.bs);
}

static void quantize_rows(const float* x, int B, int k, const tw_qact* a, int need) {
#pragma omp for schedule(static)
  for (int b = 0; b < B; ++b) quantize_row(x + (int64_t)b * k, b, k, a, need);
}

// The rows of one block weight (or one part of a product) against quantised activation
// rows [0, B): y[b * ldy + j] (+)= W[j] . x[b] (+ bias[j]), the output rows shared among
// the threads. With nowait the threads move on without waiting for each other.
static void r8_rows_part(const tw_linear* L, const tw_qact* a, float* y, int64_t ldy, int B,
                         int accumulate, int nowait);
static void block_rows_part(const tw_linear* L, const tw_qact* a, float* y, int64_t ldy, int B,
                            int accumulate, int nowait) {
  if (L->dtype >= TW_R8) {
    r8_rows_part(L, a, y, ldy, B, accumulate, nowait);
    return;
  }
  const int t = L->dtype - TW_BLOCKS, k = L->k;
  const int64_t rb = block_row_bytes(t, k);
  const int ahead = (int)((PREFETCH_BYTES + rb - 1) / rb);
  const tw_block_dot dot = vector_dot(t);
  const int wide = dot && is_grid(t), step = wide ? GRID_TOKENS : BLOCK_MAX_ROWS;
#define BLOCK_ROWS_BODY                                                           \
  for (int j = 0; j < L->n; ++j) {                                                \
    if (j + ahead < L->n) { /* rows ahead, as linear_rows does */                \
      const char* next = (const char*)L->w + (j + ahead) * rb;                    \
      for (int64_t o = 0; o < rb; o += 64) __builtin_prefetch(next + o, 0, 3);    \
    }                                                                             \
    const uint8_t* row = (const uint8_t*)L->w + j * rb;                           \
    for (int b0 = 0; b0 < B; b0 += step) {                                        \
      const int nb = B - b0 < step ? B - b0 : step;                               \
      const tw_qact sub = qact_row(a, b0, k);                                     \
      float out[GRID_TOKENS];                                                     \
      if (wide && nb > BLOCK_MAX_ROWS) grid_wide(t, row, k, &sub, nb, k, out);    \
      else if (dot) dot(row, k, &sub, nb, k, out);                                \
      else block_dot_portable(t, row, k, &sub, nb, k, out);                       \
      for (int b = 0; b < nb; ++b) {                                              \
        float v = out[b] + (L->bias ? L->bias[j] : 0.f);                          \
        float* o = y + (int64_t)(b0 + b) * ldy + j;                               \
        *o = accumulate ? *o + v : v;                                             \
      }                                                                           \
    }                                                                             \
  }
  if (nowait) {
#pragma omp for schedule(static) nowait
    BLOCK_ROWS_BODY
  } else {
#pragma omp for schedule(static)
    BLOCK_ROWS_BODY
  }
#undef BLOCK_ROWS_BODY
}

// Whether a product (or any part of one) multiplies block weights.
static int has_blocks(const tw_linear* L) {
  if (L->dtype != TW_PARTS) return is_blocks(L->dtype);
  for (int i = 0; i < L->n_parts; ++i)
    if (is_blocks(L->parts[i].dtype)) return 1;
  return 0;
}

static int formats_needed(const tw_linear* L) {
  if (L->dtype != TW_PARTS) return is_super(block_type(L->dtype)) ? 2 : 1;
  int need = 0;
  for (int i = 0; i < L->n_parts; ++i) need |= formats_needed(&L->parts[i]);
  return need;
}

// A product on block weights (or parts, each of them block weights) inside a parallel
// region: x [B, k] float32 is quantised into the room at qbuf (tw_qact_bytes(B, k) bytes
// or more), then y [B, n] (+)= x W.T.
static void block_rows_quantised(const tw_linear* L, const tw_qact* a, float* y, int B,
                                 int accumulate) {
  if (L->dtype != TW_PARTS) {
    block_rows_part(L, a, y, L->n, B, accumulate, 0);
    return;
  }
  int col = 0;
  for (int i = 0; i < L->n_parts; ++i) {
    block_rows_part(&L->parts[i], a, y + col, L->n, B, accumulate, i + 1 < L->n_parts);
    col += L->parts[i].n;
  }
}

static void block_rows(const tw_linear* L, const float* x, void* qbuf, float* y, int B,
                       int accumulate) {
  const tw_qact a = qact_carve(qbuf, B, L->k);
  quantize_rows(x, B, L->k, &a, formats_needed(L));
  block_rows_quantised(L, &a, y, B, accumulate);
}

// y [M, n] = x [M, k] W.T (+ bias) for a block weight or parts of them (each part's rows in
// turn); x and y float32 or bfloat16. The rows of x go BLOCK_MAX_ROWS at a time through each
// decode of a weight row.
void tw_block_linear(const void* x, int x_dtype, int M, const tw_linear* L, void* y, int y_dtype,
                     int threads) {
  if (M <= 0) return;
  const int k = L->k, n = L->n;
  float* xf = (float*)malloc(sizeof(float) * (size_t)M * k);
  float* yf = y_dtype == TW_F32 ? (float*)y : (float*)malloc(sizeof(float) * (size_t)M * n);
  void* qbuf = aligned_alloc(64, tw_qact_bytes(M, k));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int b = 0; b < M; ++b) row_to_f32(x, x_dtype, b, k, xf + (int64_t)b * k);
    block_rows(L, xf, qbuf, yf, M, 0);
    if (yf != y) {
#pragma omp for schedule(static)
      for (int b = 0; b < M; ++b) row_from_f32(y, y_dtype, b, n, yf + (int64_t)b * n);
    }
  }
  if (yf != y) free(yf);
  free(xf);
  free(qbuf);
}

// rows [rows, k] of a block weight of ggml type t to float32 or bfloat16 out [rows, k]
void tw_block_dequantize(const void* w, int t, int64_t rows, int k, void* out, int out_dtype,
                         int threads) {
  const int64_t rb = block_row_bytes(t, k);
#pragma omp parallel num_threads(threads)
  {
    float* tmp = out_dtype == TW_F32 ? NULL : (float*)malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
#if (defined(TW_BLOCKS_VECTOR) && defined(__AVX512BF16__)) || defined(TW_BLOCKS_AVX2)
      if (!tw_blocks_portable) {
        void* dst = out_dtype == TW_F32 ? (void*)((float*)out + r * k) : (void*)((uint16_t*)out + r * k);
        block_row_vector(t, (const uint8_t*)w + r * rb, k, dst, out_dtype);
        continue;
      }
#endif
      float* dst = tmp ? tmp : (float*)out + r * k;
      block_row_to_f32(t, (const uint8_t*)w + r * rb, k, dst);
      if (tmp) row_from_f32(out, out_dtype, r, k, tmp);
    }
    free(tmp);
  }
}
