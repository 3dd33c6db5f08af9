// Block weights repacked eight rows at a time, once at load (tw_r8_pack), for Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS.
// (part of kernels.c, the one translation unit: included there, in order)
//
// In the file each row's blocks lie one after another, so a product reads one row at a time
// and reduces its 32-bit sums across a vector's lanes at the end. Repacked, the same block of
// eight rows lies together: their scales side by side, their quantised values in runs of four
// bytes, row after row (chunk c of rows 0-7 is one 32-byte vector). One vector of int32 lanes
// then holds eight rows' sums: each four activations, broadcast, multiply eight rows' four
// weights in one instruction (dpbusd, or maddubs and madd), the values are unpacked once for
// every token of a tile, and the result needs no reduction across lanes.
//
// Every lane computes its own row and token in one fixed order (integer sums per block,
// exact; then one float multiply-add per block, in the block order), whatever the number of
// tokens in the tile, whichever of the AVX-512, AVX2 or plain C paths runs it: a token's
// result never depends on its batch (batch invariance) or on the CPU's vector width.
//
// A block's record for eight rows (r: row, c: chunk of 4 elements, j: run of 32):
//   Q4_0 .. Q5_1, IQ4_NL: d[r] (float16), Q4_1/Q5_1: m[r] (float16), Q5: qh[r] (u32, bit
//     8i + c: the fifth bit of element 4c + i), then chunks c = 0-3 [r][4 bytes]: low
//     nibbles elements 4c + i, high nibbles 16 + 4c + i (IQ4_NL: indices into its table).
//     MXFP4: IQ4_NL's record, its own table, the power-of-two scale as float16 (repacked
//     only where every scale is one float16 holds exactly: tw_r8_exact).
//     Q8_0: d[r], then chunks c = 0-7 (int8).
//   Q4_K, Q5_K: d[r], dmin[r] (float16), sc[j][r], mn[j][r] (6-bit, a byte each), Q5_K:
//     qh chunks c = 0-7 [r][4] (bit j: run j's fifth bit), then for each pair of runs
//     (2p, 2p + 1) chunks c = 0-7 [r][4]: run 2p in the low nibbles, 2p + 1 in the high.
//   Q6_K: d[r] (float16), sc[j][r][2] (int8, the scales of run j's two halves), low
//     planes as Q4_K's values, then for each quad of runs chunks [r][4]: bits 2i-2i+1 the
//     high two bits of run 4h + i. A weight is d * sc * (q - 32).
//   Q3_K: as Q6_K, scales sc - 32, with two-bit planes (chunks [r][4] for each quad of runs,
//     bits 2i-2i+1 run 4h + i) and one plane of third bits (bit j: run j's); a weight is
//     d * sc * (q - 4). Q2_K: d[r], dmin[r], the file's scale bytes [j][r][2] (scale in the
//     low nibble, minimum in the high), then the two-bit planes.
//   IQ4_XS: d[r], sc[j][r] (int8, the scale - 32), then for each run its chunks c = 0-3
//     [r][4] as IQ4_NL's.
//
// Weights with signs (Q8_0 and the IQ4 tables) enter the unsigned side of the byte products
// as |w| with w's sign moved onto the activation; the 512-bit kernels instead add 128 to the
// activation and take 128 times the weights' sum away once a block. Both give the same
// integer sums, and so the same bits.

static inline int r8_packs(int t) {
  return t == GG_Q4_0 || t == GG_Q4_1 || t == GG_Q5_0 || t == GG_Q5_1 || t == GG_Q8_0 ||
         t == GG_IQ4_NL || t == GG_MXFP4 || t == GG_Q2_K || t == GG_Q3_K || t == GG_Q4_K ||
         t == GG_Q5_K || t == GG_Q6_K || t == GG_IQ4_XS;
}
// 32-element types whose nibbles index a table of signed values
static inline int r8_table(int t) { return t == GG_IQ4_NL || t == GG_MXFP4; }
// weights with signs, multiplied as |w| times the activations with w's signs
static inline int r8_signed(int t) { return t == GG_Q8_0 || r8_table(t) || t == GG_IQ4_XS; }
// scales a half-run (16 values): Q2_K, Q3_K, Q6_K
static inline int r8_halves(int t) { return t == GG_Q2_K || t == GG_Q3_K || t == GG_Q6_K; }

// bytes of one block's record for eight rows
static inline int r8_record(int t) {
  switch (t) {
    case GG_Q4_K: return 32 + 128 + 1024;
    case GG_Q5_K: return 32 + 128 + 256 + 1024;
    case GG_Q6_K: return 16 + 128 + 1024 + 512;
    case GG_Q3_K: return 16 + 128 + 512 + 256;
    case GG_Q2_K: return 32 + 128 + 512;
    case GG_IQ4_XS: return 16 + 64 + 1024;
    case GG_MXFP4: return 8 * block_bytes(GG_IQ4_NL);
    default: return 8 * block_bytes(t);
  }
}
static inline int r8_has_min(int t) { return t == GG_Q4_1 || t == GG_Q5_1; }
static inline int r8_fifth(int t) { return t == GG_Q5_0 || t == GG_Q5_1; }
static inline int r8_values(int t) { return 16 + 16 * r8_has_min(t) + 32 * r8_fifth(t); }

int tw_r8_packs(int t) { return r8_packs(t); }

// MXFP4's scale 2^(e - 128) (e8m0_half) as float16 bits; exact for e in 104 .. 143
static inline uint16_t r8_e8m0_half16(uint8_t e) {
  const int x = (int)e - 128;
  return (uint16_t)(x >= -14 ? (x + 15) << 10 : 1 << (x + 24));
}

// Whether rows of w [rows, k] of type t repack exactly: always, but for MXFP4, whose
// scales the record holds as float16, only where every one is a power of two float16
// holds (2^-24 to 2^15); the file's own kernels multiply the rest.
int tw_r8_exact(int t, const uint8_t* w, int64_t rows, int k) {
  if (t != GG_MXFP4) return r8_packs(t);
  const int64_t n = rows * (k / 32);
  for (int64_t i = 0; i < n; ++i)
    if (w[i * 17] < 104 || w[i * 17] > 143) return 0;
  return 1;
}

// Bytes of `rows` rows of width k of type t, repacked (rows rounded up to eight).
int64_t tw_r8_bytes(int t, int64_t rows, int k) {
  return (rows + 7) / 8 * (int64_t)(k / block_elems(t)) * r8_record(t);
}

// Four bytes of a row's run of values to chunk c of row r (the chunks of eight rows lie
// together, four bytes a row).
static inline void r8_chunk(uint8_t* v, int c, int r, const uint8_t* from) {
  memcpy(v + (c * 8 + r) * 4, from, 4);
}

// One block's record from eight rows' blocks (src[r] NULL: a row of zeros). Where the file's
// bytes already hold what a chunk holds (nibbles of elements l and l + 16, or of runs 2p and
// 2p + 1), they are copied four at a time.
static void r8_pack_block(int t, const uint8_t* const src[8], uint8_t* rec) {
  memset(rec, 0, (size_t)r8_record(t));
  for (int r = 0; r < 8; ++r) {
    const uint8_t* b = src[r];
    if (!b) continue;
    if (!is_super(t)) {
      const int lead = t == GG_Q4_1 ? 4 : t == GG_Q5_0 ? 6 : t == GG_Q5_1 ? 8 : t == GG_MXFP4 ? 1 : 2;
      if (t == GG_MXFP4) {
        const uint16_t d = r8_e8m0_half16(b[0]);
        memcpy(rec + 2 * r, &d, 2);
      } else {
        memcpy(rec + 2 * r, b, 2);
      }
      if (r8_has_min(t)) memcpy(rec + 16 + 2 * r, b + 2, 2);
      for (int c = 0; c < (t == GG_Q8_0 ? 8 : 4); ++c) r8_chunk(rec + r8_values(t), c, r, b + lead + 4 * c);
      if (r8_fifth(t)) {  // bit l of the file's word: element l's fifth bit
        const uint32_t qh = load_u32(b + lead - 4);
        uint32_t bits = 0;
        for (int l = 0; l < 32; ++l) bits |= (qh >> l & 1) << (8 * (l % 4) + l / 4);
        memcpy(rec + 16 + 16 * r8_has_min(t) + 4 * r, &bits, 4);
      }
      continue;
    }
    if (t == GG_Q6_K) {
      memcpy(rec + 2 * r, b + 208, 2);
      for (int j = 0; j < 8; ++j) {
        rec[16 + (j * 8 + r) * 2] = b[192 + 2 * j];
        rec[16 + (j * 8 + r) * 2 + 1] = b[192 + 2 * j + 1];
        uint8_t q[32];
        group_values(t, b, j, q);
        uint8_t* low = rec + 144 + (j / 2) * 256;
        uint8_t* high = rec + 1168 + (j / 4) * 256;
        for (int l = 0; l < 32; ++l) {
          const int at = ((l / 4) * 8 + r) * 4 + l % 4;
          low[at] |= (q[l] & 0xF) << (4 * (j % 2));
          high[at] |= (q[l] >> 4) << (2 * (j % 4));
        }
      }
      continue;
    }
    if (t == GG_Q2_K || t == GG_Q3_K) {  // the file's planes, a chunk at a time
      const int three = t == GG_Q3_K;
      memcpy(rec + 2 * r, b + (three ? 108 : 80), 2);
      if (!three) memcpy(rec + 16 + 2 * r, b + 82, 2);
      for (int j = 0; j < 8; ++j)
        for (int h = 0; h < 2; ++h)
          rec[(three ? 16 : 32) + (j * 8 + r) * 2 + h] =
              three ? (uint8_t)(int8_t)(scale_q3k(b + 96, 2 * j + h) - 32) : b[2 * j + h];
      for (int n = 0; n < 2; ++n)
        for (int c = 0; c < 8; ++c)
          r8_chunk(rec + (three ? 144 : 160) + 256 * n, c, r, b + low2_offset(t) + 32 * n + 4 * c);
      if (three)
        for (int c = 0; c < 8; ++c) r8_chunk(rec + 656, c, r, b + 4 * c);
      continue;
    }
    if (t == GG_IQ4_XS) {
      memcpy(rec + 2 * r, b, 2);
      for (int j = 0; j < 8; ++j) {
        rec[16 + 8 * j + r] = (uint8_t)(int8_t)(scale_iq4xs(b, j) - 32);
        for (int c = 0; c < 4; ++c) r8_chunk(rec + 80 + 128 * j, c, r, b + 8 + 16 * j + 4 * c);
      }
      continue;
    }
    memcpy(rec + 2 * r, b, 2);  // Q4_K, Q5_K: d, dmin, then each run's scale and minimum
    memcpy(rec + 16 + 2 * r, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, b + 4, &sc, &mn);
      rec[32 + 8 * j + r] = (uint8_t)sc;
      rec[96 + 8 * j + r] = (uint8_t)mn;
    }
    const int five = t == GG_Q5_K;
    const uint8_t* qs = b + (five ? 48 : 16);
    for (int p = 0; p < 4; ++p)
      for (int c = 0; c < 8; ++c) r8_chunk(rec + 160 + 256 * five + 256 * p, c, r, qs + 32 * p + 4 * c);
    if (five)  // byte l, bit j: run j's fifth bit of element l
      for (int c = 0; c < 8; ++c) r8_chunk(rec + 160, c, r, b + 16 + 4 * c);
  }
}

// w [rows, k] of type t (the file's rows) -> out (tw_r8_bytes of it), eight rows a tile.
void tw_r8_pack(int t, const uint8_t* w, int64_t rows, int k, uint8_t* out, int threads) {
  const int per = block_elems(t), nblk = k / per, rec = r8_record(t);
  const int64_t rb = block_row_bytes(t, k), tiles = (rows + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    for (int g = 0; g < nblk; ++g) {
      const uint8_t* src[8];
      for (int r = 0; r < 8; ++r) {
        const int64_t row = tile * 8 + r;
        src[r] = row < rows ? w + row * rb + (int64_t)g * block_bytes(t) : NULL;
      }
      r8_pack_block(t, src, out + (tile * nblk + g) * rec);
    }
  }
}

// ---------------------------------------------------------------- plain C ----------
// A tile's product for T tokens (a: their quantised activations, rows 0 to T - 1 of width
// ka) -> out[T][8], lane by lane in the order the vector paths keep.

// element l (0-31) of row r in a 32-element format's record, as an integer (Q8_0 signed)
static inline int r8_legacy_value(int t, const uint8_t* p, int r, int l) {
  const uint8_t* v = p + r8_values(t);
  const int c = l / 4, i = l % 4;
  if (t == GG_Q8_0) return (int8_t)v[(c * 8 + r) * 4 + i];
  int q = (v[((c % 4) * 8 + r) * 4 + i] >> (4 * (c / 4))) & 0xF;
  if (r8_table(t)) return table_of(t)[q];
  if (r8_fifth(t)) q |= ((load_u32(p + 16 + 16 * r8_has_min(t) + 4 * r) >> (8 * i + c)) & 1) << 4;
  return q;
}

// value l (0-31) of run j of row r in a K type's record (IQ4_XS: signed)
static inline int r8_super_value(int t, const uint8_t* p, int r, int j, int l) {
  const int at = ((l / 4) * 8 + r) * 4 + l % 4;
  switch (t) {
    case GG_Q6_K:
      return ((p[144 + (j / 2) * 256 + at] >> (4 * (j % 2))) & 0xF) |
             (((p[1168 + (j / 4) * 256 + at] >> (2 * (j % 4))) & 3) << 4);
    case GG_Q2_K: return (p[160 + (j / 4) * 256 + at] >> (2 * (j % 4))) & 3;
    case GG_Q3_K:
      return ((p[144 + (j / 4) * 256 + at] >> (2 * (j % 4))) & 3) | (((p[656 + at] >> j) & 1) << 2);
    case GG_IQ4_XS: {
      const int c = (l % 16) / 4;
      return IQ4_VALUES[(p[80 + 128 * j + (c * 8 + r) * 4 + l % 4] >> (4 * (l / 16))) & 0xF];
    }
  }
  int q = (p[160 + 256 * (t == GG_Q5_K) + (j / 2) * 256 + at] >> (4 * (j % 2))) & 0xF;
  if (t == GG_Q5_K) q |= ((p[160 + at] >> j) & 1) << 4;
  return q;
}

static void r8_portable(int t, const uint8_t* tile, int k, const tw_qact* a, int T, int ka,
                        float* out) {
  const int rec = r8_record(t);
  for (int b = 0; b < T; ++b) {
    const tw_qact x = qact_row(a, b, ka);
    for (int r = 0; r < 8; ++r) {
      float acc = 0.f;
      if (!is_super(t)) {
        const float zp = t == GG_Q4_0 ? -8.f : t == GG_Q5_0 ? -16.f : 0.f;
        for (int g = 0; g < k / 32; ++g) {
          const uint8_t* p = tile + (int64_t)g * rec;
          int s = 0;
          for (int l = 0; l < 32; ++l) s += r8_legacy_value(t, p, r, l) * x.q32[g * 32 + l];
          const float d = half_to_f32(p + 2 * r);
          acc = fmaf((float)s, d * x.d32[g], acc);
          if (!r8_signed(t)) acc = fmaf(r8_has_min(t) ? half_to_f32(p + 16 + 2 * r) : d * zp, x.s32[g], acc);
        }
      } else {
        for (int i = 0; i < k / 256; ++i) {
          const uint8_t* p = tile + (int64_t)i * rec;
          const int8_t* ab = x.q256 + i * 256;
          const int16_t* bs = x.bs + i * 16;
          int s = 0, m = 0;
          for (int j = 0; j < 8; ++j) {
            int h[2] = {0, 0};
            for (int l = 0; l < 32; ++l) h[l / 16] += r8_super_value(t, p, r, j, l) * ab[32 * j + l];
            if (r8_halves(t)) {
              int sc[2], mn[2];
              for (int e = 0; e < 2; ++e) {
                const uint8_t v = p[(t == GG_Q2_K ? 32 : 16) + (j * 8 + r) * 2 + e];
                sc[e] = t == GG_Q2_K ? v & 0xF : (int8_t)v;
                mn[e] = t == GG_Q2_K ? v >> 4 : sc[e];
              }
              s += h[0] * sc[0] + h[1] * sc[1];
              m += mn[0] * bs[2 * j] + mn[1] * bs[2 * j + 1];
            } else if (t == GG_IQ4_XS) {
              s += (h[0] + h[1]) * (int8_t)p[16 + 8 * j + r];
            } else {
              s += (h[0] + h[1]) * p[32 + 8 * j + r];
              m += p[96 + 8 * j + r] * (bs[2 * j] + bs[2 * j + 1]);
            }
          }
          const float dd = half_to_f32(p + 2 * r) * x.d256[i];
          if (t == GG_Q6_K || t == GG_Q3_K) {  // a weight is d * sc * (q - 32 or 4)
            acc = fmaf((float)(s - (t == GG_Q6_K ? 32 : 4) * m), dd, acc);
          } else {
            acc = fmaf((float)s, dd, acc);
            if (t != GG_IQ4_XS) acc = fmaf(-(float)m, half_to_f32(p + 16 + 2 * r) * x.d256[i], acc);
          }
        }
      }
      out[b * 8 + r] = acc;
    }
  }
}

// ---------------------------------------------------------------- vectors ----------
#if defined(TW_BLOCKS_256)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define R8_DP(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define R8_TOKENS 4  // tokens a tile: 32 vector registers hold their sums
#elif defined(__AVXVNNI__)
#define R8_DP(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define R8_TOKENS 2
#else  // u8 x s8 in pairs into int16 (at most 2 x 63 x 127: no saturation), then int32
#define R8_DP(acc, u, s) \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define R8_TOKENS 2
#endif

// four activation bytes, in every lane
INLINE __m256i r8_four(const int8_t* a) { return _mm256_set1_epi32((int)load_u32((const uint8_t*)a)); }

// bit `bit` of each byte moved to bit `to`, the rest cleared
INLINE __m256i r8_bit(__m256i v, const int bit, const int to) {
  const __m256i at = bit <= to ? _mm256_sll_epi32(v, _mm_cvtsi32_si128(to - bit))
                               : _mm256_srl_epi32(v, _mm_cvtsi32_si128(bit - to));
  return _mm256_and_si256(at, _mm256_set1_epi8((char)(1 << to)));
}
INLINE __m256i r8_fifth_bit(__m256i v, const int bit) { return r8_bit(v, bit, 4); }
// t's table (IQ4's, or MXFP4's) in each 128-bit half, for the byte shuffle
INLINE __m256i r8_table_of(const int t) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)table_of(t)));
}

INLINE void r8_legacy(const int t, const uint8_t* tile, int k, const tw_qact* a, const int T,
                      int ka, float* out) {
  const int rec = r8_record(t), hm = r8_has_min(t), five = r8_fifth(t), vo = r8_values(t);
  const int sgnd = r8_signed(t);
  const float zp = t == GG_Q4_0 ? -8.f : t == GG_Q5_0 ? -16.f : 0.f;
  const __m256i low4 = _mm256_set1_epi8(0xF), table = r8_table_of(t);
  __m256 acc[R8_TOKENS];
  for (int b = 0; b < T; ++b) acc[b] = _mm256_setzero_ps();
  for (int g = 0; g < k / 32; ++g) {
    const uint8_t* p = tile + (int64_t)g * rec;
    for (int o = 0; o < rec; o += 64) __builtin_prefetch(p + PREFETCH_BYTES + o, 0, 3);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 m = hm ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))
                        : _mm256_mul_ps(d, _mm256_set1_ps(zp));
    __m256i w[8], sgn[8];
    if (t == GG_Q8_0) {  // |w| times the activations with w's signs
      for (int c = 0; c < 8; ++c) {
        sgn[c] = _mm256_loadu_si256((const __m256i*)(p + vo + 32 * c));
        w[c] = _mm256_abs_epi8(sgn[c]);
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + vo + 32 * c));
        w[c] = _mm256_and_si256(v, low4);
        w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      if (five) {
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(p + 16 + 16 * hm));
        for (int c = 0; c < 8; ++c) w[c] = _mm256_or_si256(w[c], r8_fifth_bit(qh, c));
      }
      if (r8_table(t))
        for (int c = 0; c < 8; ++c) {
          sgn[c] = _mm256_shuffle_epi8(table, w[c]);
          w[c] = _mm256_abs_epi8(sgn[c]);
        }
    }
    for (int b = 0; b < T; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      __m256i s = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i x = r8_four(ab + 4 * c);
        s = R8_DP(s, w[c], sgnd ? _mm256_sign_epi8(x, sgn[c]) : x);
      }
      const int64_t at = (int64_t)b * (ka / 32) + g;
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(a->d32[at])), acc[b]);
      if (!sgnd) acc[b] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->s32[at]), acc[b]);
    }
  }
  for (int b = 0; b < T; ++b) _mm256_storeu_ps(out + 8 * b, acc[b]);
}

// Run j's 32 values of eight rows, in chunks of four (w: unsigned; a K type with signed
// values, IQ4_XS: |w|, with the values themselves in sgn).
INLINE void r8_run_values(const int t, const uint8_t* p, const int j, __m256i* w, __m256i* sgn) {
  const __m256i low4 = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
  if (t == GG_IQ4_XS) {
    const __m256i table = r8_table_of(t);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 80 + 128 * j + 32 * c));
      sgn[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
      sgn[c + 4] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
    }
    for (int c = 0; c < 8; ++c) w[c] = _mm256_abs_epi8(sgn[c]);
    return;
  }
  if (t == GG_Q2_K || t == GG_Q3_K) {
    const __m128i shift = _mm_cvtsi32_si128(2 * (j % 4));
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + (t == GG_Q3_K ? 144 : 160) + (j / 4) * 256 + 32 * c));
      w[c] = _mm256_and_si256(_mm256_srl_epi16(v, shift), three);
      if (t == GG_Q3_K) w[c] = _mm256_or_si256(w[c], r8_bit(_mm256_loadu_si256((const __m256i*)(p + 656 + 32 * c)), j, 2));
    }
    return;
  }
  const int six = t == GG_Q6_K, five = t == GG_Q5_K, vo = six ? 144 : 160 + 256 * five;
  for (int c = 0; c < 8; ++c) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + vo + (j / 2) * 256 + 32 * c));
    w[c] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
    if (six) {
      const __m256i h = _mm256_loadu_si256((const __m256i*)(p + 1168 + (j / 4) * 256 + 32 * c));
      const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * (j % 4))), three);
      w[c] = _mm256_or_si256(w[c], _mm256_slli_epi16(h2, 4));
    } else if (five) {
      w[c] = _mm256_or_si256(w[c], r8_fifth_bit(_mm256_loadu_si256((const __m256i*)(p + 160 + 32 * c)), j));
    }
  }
}

// Run j's scales of eight rows as int32 lanes: sc0 and sc1 those of its two halves (the
// same where the run has one), mn int16 pairs (half 0, half 1) that multiply the halves'
// activation sums: the minimums, or (Q3_K, Q6_K) the scales again.
INLINE void r8_run_scales(const int t, const uint8_t* p, const int j, __m256i* sc0, __m256i* sc1,
                          __m256i* mn) {
  if (t == GG_Q6_K || t == GG_Q3_K) {  // int8 pairs (scale of half 0, of half 1)
    *mn = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 + 16 * j)));
    *sc0 = _mm256_srai_epi32(_mm256_slli_epi32(*mn, 16), 16);
    *sc1 = _mm256_srai_epi32(*mn, 16);
  } else if (t == GG_Q2_K) {  // bytes: the scale in the low nibble, the minimum in the high
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * j)));
    const __m256i sc = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
    *sc0 = _mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF));
    *sc1 = _mm256_srli_epi32(sc, 16);
    *mn = _mm256_srli_epi16(v, 4);
  } else if (t == GG_IQ4_XS) {
    *sc0 = *sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 16 + 8 * j)));
    *mn = _mm256_setzero_si256();
  } else {  // the minimum twice (it multiplies both sums of 16)
    *sc0 = *sc1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 32 + 8 * j)));
    const __m256i m1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 96 + 8 * j)));
    *mn = _mm256_or_si256(m1, _mm256_slli_epi32(m1, 16));
  }
}

// A super-block's float steps from its integer sums S (values times scales) and M (activation
// sums times minimums or scales): lanes of eight rows, times the activation scale da.
INLINE __m256 r8_super_steps(const int t, const uint8_t* p, __m256i S, __m256i M, __m256 da, __m256 acc) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  if (t == GG_Q6_K || t == GG_Q3_K)  // a weight is d * sc * (q - 32 or 4)
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(S, _mm256_slli_epi32(M, t == GG_Q6_K ? 5 : 2))),
                           _mm256_mul_ps(d, da), acc);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, da), acc);
  if (t == GG_IQ4_XS) return acc;
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
  return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(dmin, da), acc);
}

// The K types: Q4_K, Q5_K (a scale and a minimum a run), Q2_K (the same a half-run), Q3_K,
// Q6_K (a signed scale a half-run) and IQ4_XS (a signed scale a run, signed values).
INLINE void r8_kquant(const int t, const uint8_t* tile, int k, const tw_qact* a, const int T,
                      int ka, float* out) {
  const int rec = r8_record(t), nsb = k / 256, halves = r8_halves(t), sgnd = r8_signed(t);
  __m256 acc[R8_TOKENS];
  for (int b = 0; b < T; ++b) acc[b] = _mm256_setzero_ps();
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* p = tile + (int64_t)i * rec;
    for (int o = 0; o < rec; o += 64) __builtin_prefetch(p + PREFETCH_BYTES + o, 0, 3);
    __m256i S[R8_TOKENS], M[R8_TOKENS];
    for (int b = 0; b < T; ++b) S[b] = M[b] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i w[8], sgn[8], sc0, sc1, mn;
      r8_run_values(t, p, j, w, sgn);
      r8_run_scales(t, p, j, &sc0, &sc1, &mn);
      for (int b = 0; b < T; ++b) {
        const int8_t* ab = a->q256 + (int64_t)b * ka + 256 * i + 32 * j;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const __m256i x = r8_four(ab + 4 * c);
          s0 = R8_DP(s0, w[c], sgnd ? _mm256_sign_epi8(x, sgn[c]) : x);
        }
        for (int c = 4; c < 8; ++c) {
          const __m256i x = r8_four(ab + 4 * c);
          s1 = R8_DP(s1, w[c], sgnd ? _mm256_sign_epi8(x, sgn[c]) : x);
        }
        if (halves) {
          S[b] = _mm256_add_epi32(S[b], _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1)));
        } else {
          S[b] = _mm256_add_epi32(S[b], _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), sc0));
        }
        if (t != GG_IQ4_XS) {
          const int16_t* bs = a->bs + (int64_t)b * (ka / 16) + 16 * i + 2 * j;
          M[b] = _mm256_add_epi32(M[b], _mm256_madd_epi16(mn, r8_four((const int8_t*)bs)));
        }
      }
    }
    for (int b = 0; b < T; ++b)
      acc[b] = r8_super_steps(t, p, S[b], M[b], _mm256_set1_ps(a->d256[(int64_t)b * ((ka + 255) / 256) + i]), acc[b]);
  }
  for (int b = 0; b < T; ++b) _mm256_storeu_ps(out + 8 * b, acc[b]);
}

// Each kernel once for every token count up to R8_TOKENS (a constant: sums in registers).
#define R8_T(n) ((n) <= R8_TOKENS ? (n) : 1)
_Static_assert(R8_TOKENS <= 4, "the kernels' cases go to 4");
#define R8_KERNEL(name, fn, type)                                                        \
  static void name(const uint8_t* p, int k, const tw_qact* a, int T, int ka, float* o) { \
    switch (T) {                                                                         \
      case 1: fn(type, p, k, a, 1, ka, o); break;                                        \
      case 2: fn(type, p, k, a, R8_T(2), ka, o); break;                                  \
      case 3: fn(type, p, k, a, R8_T(3), ka, o); break;                                  \
      case 4: fn(type, p, k, a, R8_T(4), ka, o); break;                                  \
      default: fn(type, p, k, a, R8_TOKENS, ka, o); break;                               \
    }                                                                                    \
  }
R8_KERNEL(r8_q4_0, r8_legacy, GG_Q4_0)
R8_KERNEL(r8_q4_1, r8_legacy, GG_Q4_1)
R8_KERNEL(r8_q5_0, r8_legacy, GG_Q5_0)
R8_KERNEL(r8_q5_1, r8_legacy, GG_Q5_1)
R8_KERNEL(r8_q8_0, r8_legacy, GG_Q8_0)
R8_KERNEL(r8_q4k, r8_kquant, GG_Q4_K)
R8_KERNEL(r8_q5k, r8_kquant, GG_Q5_K)
R8_KERNEL(r8_q6k, r8_kquant, GG_Q6_K)
R8_KERNEL(r8_iq4nl, r8_legacy, GG_IQ4_NL)
R8_KERNEL(r8_mxfp4, r8_legacy, GG_MXFP4)
R8_KERNEL(r8_q2k, r8_kquant, GG_Q2_K)
R8_KERNEL(r8_q3k, r8_kquant, GG_Q3_K)
R8_KERNEL(r8_iq4xs, r8_kquant, GG_IQ4_XS)

#if defined(TW_BLOCKS_VECTOR)
// Two tiles at once in 512-bit vectors (lanes 0-7: tile A's rows, 8-15: tile B's), each
// lane computing what the 256-bit kernels compute for it, in the same order.
INLINE __m512i r8x2_load(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                            _mm256_loadu_si256((const __m256i*)b), 1);
}
INLINE __m512 r8x2_halves(const uint8_t* a, const uint8_t* b) {  // eight float16 of each
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i*)b),
                                          _mm_loadu_si128((const __m128i*)a)));
}
INLINE __m512i r8x2_bytes8(const uint8_t* a, const uint8_t* b) {  // eight bytes of each, as int32
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a),
                                                 _mm_loadl_epi64((const __m128i*)b)));
}
INLINE __m512i r8x2_four(const int8_t* a) { return _mm512_set1_epi32((int)load_u32((const uint8_t*)a)); }
INLINE __m512i r8x2_bit(__m512i v, const int bit, const int to) {
  const __m512i at = bit <= to ? _mm512_sll_epi32(v, _mm_cvtsi32_si128(to - bit))
                               : _mm512_srl_epi32(v, _mm_cvtsi32_si128(bit - to));
  return _mm512_and_si512(at, _mm512_set1_epi8((char)(1 << to)));
}
INLINE __m512i r8x2_fifth_bit(__m512i v, const int bit) { return r8x2_bit(v, bit, 4); }
INLINE __m512i r8x2_table_of(const int t) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)table_of(t)));
}
// minus 128 times the sum of each lane's four signed weights, over n chunks: what adding
// 128 to the activations (to make them the unsigned side) adds to a lane's sum
INLINE __m512i r8x2_offset(const __m512i* w, const int n) {
  __m512i s = _mm512_setzero_si512();
  for (int c = 0; c < n; ++c) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi8((char)0x80), w[c]);
  return _mm512_sub_epi32(_mm512_setzero_si512(), s);
}
// four activation bytes plus 128 (unsigned), in every lane
INLINE __m512i r8x2_four_u(const int8_t* a) {
  return _mm512_set1_epi32((int)(load_u32((const uint8_t*)a) ^ 0x80808080u));
}

// A 32-element type's tiles, one pair or two (G; Q8_0: one), for up to R8_WIDE tokens
// (prompts): each group unpacked once for all of them, their sums kept in out between
// groups; each lane's sums and float steps are those of r8_legacy.
INLINE void r8x2_legacy_wide(const int t, const uint8_t* const* tl, const int G, int k,
                             const tw_qact* a, int T, int ka, float* out) {
  const int rec = r8_record(t), hm = r8_has_min(t), five = r8_fifth(t), vo = r8_values(t);
  const int lanes = 16 * G;
  const float zp = t == GG_Q4_0 ? -8.f : t == GG_Q5_0 ? -16.f : 0.f;
  const int table = r8_table(t);
  const __m512i low4 = _mm512_set1_epi8(0xF), iq4 = r8x2_table_of(t);
  for (int b = 0; b < T; ++b)
    for (int h = 0; h < G; ++h) _mm512_storeu_ps(out + lanes * b + 16 * h, _mm512_setzero_ps());
  for (int g = 0; g < k / 32; ++g) {
    __m512 d[2], m[2];
    __m512i w[2][8], off[2];
    __mmask64 neg[8];
    for (int h = 0; h < G; ++h) {
      const uint8_t *p = tl[2 * h] + (int64_t)g * rec, *q = tl[2 * h + 1] + (int64_t)g * rec;
      for (int o = 0; o < rec; o += 64) {
        __builtin_prefetch(p + PREFETCH_BYTES + o, 0, 3);
        __builtin_prefetch(q + PREFETCH_BYTES + o, 0, 3);
      }
      d[h] = r8x2_halves(p, q);
      m[h] = hm ? r8x2_halves(p + 16, q + 16) : _mm512_mul_ps(d[h], _mm512_set1_ps(zp));
      if (t == GG_Q8_0) {  // |w| times the activations negated where w < 0
        for (int c = 0; c < 8; ++c) {
          const __m512i v = r8x2_load(p + vo + 32 * c, q + vo + 32 * c);
          neg[c] = _mm512_movepi8_mask(v);
          w[h][c] = _mm512_abs_epi8(v);
        }
      } else {
        for (int c = 0; c < 4; ++c) {
          const __m512i v = r8x2_load(p + vo + 32 * c, q + vo + 32 * c);
          w[h][c] = _mm512_and_si512(v, low4);
          w[h][c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        if (five) {
          const __m512i qh = r8x2_load(p + 16 + 16 * hm, q + 16 + 16 * hm);
          for (int c = 0; c < 8; ++c) w[h][c] = _mm512_or_si512(w[h][c], r8x2_fifth_bit(qh, c));
        }
        if (table) {  // signed values, the activations + 128 on the unsigned side
          for (int c = 0; c < 8; ++c) w[h][c] = _mm512_shuffle_epi8(iq4, w[h][c]);
          off[h] = r8x2_offset(w[h], 8);
        }
      }
    }
    for (int b = 0; b < T; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      __m512i s[2];
      for (int h = 0; h < G; ++h) s[h] = table ? off[h] : _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        if (table) {
          const __m512i x = r8x2_four_u(ab + 4 * c);
          for (int h = 0; h < G; ++h) s[h] = _mm512_dpbusd_epi32(s[h], x, w[h][c]);
          continue;
        }
        __m512i x = r8x2_four(ab + 4 * c);
        if (t == GG_Q8_0) x = _mm512_mask_sub_epi8(x, neg[c], _mm512_setzero_si512(), x);
        for (int h = 0; h < G; ++h) s[h] = _mm512_dpbusd_epi32(s[h], w[h][c], x);
      }
      const int64_t at = (int64_t)b * (ka / 32) + g;
      const __m512 da = _mm512_set1_ps(a->d32[at]);
      for (int h = 0; h < G; ++h) {
        float* o = out + lanes * b + 16 * h;
        __m512 acc = _mm512_loadu_ps(o);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[h]), _mm512_mul_ps(d[h], da), acc);
        if (!r8_signed(t)) acc = _mm512_fmadd_ps(m[h], _mm512_set1_ps(a->s32[at]), acc);
        _mm512_storeu_ps(o, acc);
      }
    }
  }
}

// Run j's values of tiles p and q (lanes 0-7 and 8-15), in chunks of four: unsigned, or
// IQ4_XS's signed values.
INLINE void r8x2_run_values(const int t, const uint8_t* p, const uint8_t* q, const int j, __m512i* w) {
  const __m512i low4 = _mm512_set1_epi8(0xF), three = _mm512_set1_epi8(3);
  if (t == GG_IQ4_XS) {
    const __m512i table = r8x2_table_of(t);
    for (int c = 0; c < 4; ++c) {
      const int at = 80 + 128 * j + 32 * c;
      const __m512i v = r8x2_load(p + at, q + at);
      w[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
      w[c + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
    }
    return;
  }
  if (t == GG_Q2_K || t == GG_Q3_K) {
    const __m128i shift = _mm_cvtsi32_si128(2 * (j % 4));
    for (int c = 0; c < 8; ++c) {
      const int at = (t == GG_Q3_K ? 144 : 160) + (j / 4) * 256 + 32 * c;
      w[c] = _mm512_and_si512(_mm512_srl_epi16(r8x2_load(p + at, q + at), shift), three);
      if (t == GG_Q3_K) w[c] = _mm512_or_si512(w[c], r8x2_bit(r8x2_load(p + 656 + 32 * c, q + 656 + 32 * c), j, 2));
    }
    return;
  }
  const int six = t == GG_Q6_K, five = t == GG_Q5_K, vo = six ? 144 : 160 + 256 * five;
  for (int c = 0; c < 8; ++c) {
    const int at = vo + (j / 2) * 256 + 32 * c;
    const __m512i v = r8x2_load(p + at, q + at);
    w[c] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, low4);
    if (six) {
      const int hat = 1168 + (j / 4) * 256 + 32 * c;
      const __m512i h2 = _mm512_and_si512(_mm512_srl_epi16(r8x2_load(p + hat, q + hat), _mm_cvtsi32_si128(2 * (j % 4))), three);
      w[c] = _mm512_or_si512(w[c], _mm512_slli_epi16(h2, 4));
    } else if (five) {
      w[c] = _mm512_or_si512(w[c], r8x2_fifth_bit(r8x2_load(p + 160 + 32 * c, q + 160 + 32 * c), j));
    }
  }
}

// Run j's scales of tiles p and q, as r8_run_scales gives them for one tile.
INLINE void r8x2_run_scales(const int t, const uint8_t* p, const uint8_t* q, const int j, __m512i* sc0,
                            __m512i* sc1, __m512i* mn) {
  if (t == GG_Q6_K || t == GG_Q3_K) {
    *mn = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128((const __m128i*)(q + 16 + 16 * j)),
                                                _mm_loadu_si128((const __m128i*)(p + 16 + 16 * j))));
    *sc0 = _mm512_srai_epi32(_mm512_slli_epi32(*mn, 16), 16);
    *sc1 = _mm512_srai_epi32(*mn, 16);
  } else if (t == GG_Q2_K) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_loadu_si128((const __m128i*)(q + 32 + 16 * j)),
                                                            _mm_loadu_si128((const __m128i*)(p + 32 + 16 * j))));
    const __m512i sc = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
    *sc0 = _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF));
    *sc1 = _mm512_srli_epi32(sc, 16);
    *mn = _mm512_srli_epi16(v, 4);
  } else if (t == GG_IQ4_XS) {
    *sc0 = *sc1 = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(p + 16 + 8 * j)),
                                                          _mm_loadl_epi64((const __m128i*)(q + 16 + 8 * j))));
    *mn = _mm512_setzero_si512();
  } else {
    *sc0 = *sc1 = r8x2_bytes8(p + 32 + 8 * j, q + 32 + 8 * j);
    const __m512i m1 = r8x2_bytes8(p + 96 + 8 * j, q + 96 + 8 * j);
    *mn = _mm512_or_si512(m1, _mm512_slli_epi32(m1, 16));
  }
}

// A K type's tiles, two pairs (G = 2) or one, for up to R8_WIDE tokens (prompts): each run
// of 32 is unpacked once for all of them, their integer sums kept in memory (L1) between
// runs rather than in registers; each lane's sums and float steps are those of
// r8_kquant. Two pairs halve the activation loads a product takes.
#define R8_WIDE 64
INLINE void r8x2_kquant_wide(const int t, const uint8_t* const* tl, const int G, int k,
                             const tw_qact* a, int T, int ka, float* out) {
  const int rec = r8_record(t), nsb = k / 256, halves = r8_halves(t), iq4 = t == GG_IQ4_XS;
  const int lanes = 16 * G;
  __m512i S[R8_WIDE][2], M[R8_WIDE][2];
  for (int b = 0; b < T; ++b)
    for (int h = 0; h < G; ++h) _mm512_storeu_ps(out + lanes * b + 16 * h, _mm512_setzero_ps());
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* pq[4];
    for (int h = 0; h < 2 * G; ++h) pq[h] = tl[h] + (int64_t)i * rec;
    for (int b = 0; b < T; ++b)
      for (int h = 0; h < G; ++h) S[b][h] = M[b][h] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i w[2][8], sc0[2], sc1[2], mn[2], off[2];
      for (int h = 0; h < G; ++h) {
        r8x2_run_values(t, pq[2 * h], pq[2 * h + 1], j, w[h]);
        r8x2_run_scales(t, pq[2 * h], pq[2 * h + 1], j, &sc0[h], &sc1[h], &mn[h]);
        if (iq4) off[h] = r8x2_offset(w[h], 8);
      }
      const int8_t* ab = a->q256 + 256 * i + 32 * j;
      const int16_t* bs = a->bs + 16 * i + 2 * j;
      for (int b = 0; b < T; ++b, ab += ka, bs += ka / 16) {
        if (iq4) {  // one scale a run: one sum, from the activations + 128
          __m512i s[2];
          for (int h = 0; h < G; ++h) s[h] = off[h];
          for (int c = 0; c < 8; ++c) {
            const __m512i x = r8x2_four_u(ab + 4 * c);
            for (int h = 0; h < G; ++h) s[h] = _mm512_dpbusd_epi32(s[h], x, w[h][c]);
          }
          for (int h = 0; h < G; ++h) S[b][h] = _mm512_add_epi32(S[b][h], _mm512_mullo_epi32(s[h], sc0[h]));
          continue;
        }
        __m512i s0[2], s1[2];
        for (int h = 0; h < G; ++h) s0[h] = s1[h] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          const __m512i x = r8x2_four(ab + 4 * c);
          for (int h = 0; h < G; ++h) s0[h] = _mm512_dpbusd_epi32(s0[h], w[h][c], x);
        }
        for (int c = 4; c < 8; ++c) {
          const __m512i x = r8x2_four(ab + 4 * c);
          for (int h = 0; h < G; ++h) s1[h] = _mm512_dpbusd_epi32(s1[h], w[h][c], x);
        }
        const __m512i sums = r8x2_four((const int8_t*)bs);
        for (int h = 0; h < G; ++h) {
          if (halves) {
            S[b][h] = _mm512_add_epi32(S[b][h], _mm512_add_epi32(_mm512_mullo_epi32(s0[h], sc0[h]), _mm512_mullo_epi32(s1[h], sc1[h])));
          } else {
            S[b][h] = _mm512_add_epi32(S[b][h], _mm512_mullo_epi32(_mm512_add_epi32(s0[h], s1[h]), sc0[h]));
          }
          M[b][h] = _mm512_add_epi32(M[b][h], _mm512_madd_epi16(mn[h], sums));
        }
      }
    }
    for (int h = 0; h < G; ++h) {
      const uint8_t *p = pq[2 * h], *q = pq[2 * h + 1];
      const __m512 d = r8x2_halves(p, q);
      const __m512 dmin = r8x2_halves(p + 16, q + 16);
      for (int b = 0; b < T; ++b) {
        const __m512 da = _mm512_set1_ps(a->d256[(int64_t)b * ((ka + 255) / 256) + i]);
        float* o = out + lanes * b + 16 * h;
        __m512 acc = _mm512_loadu_ps(o);
        if (t == GG_Q6_K || t == GG_Q3_K) {
          const __m512i v = _mm512_sub_epi32(S[b][h], _mm512_slli_epi32(M[b][h], t == GG_Q6_K ? 5 : 2));
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(d, da), acc);
        } else {
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[b][h]), _mm512_mul_ps(d, da), acc);
          if (!iq4) acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M[b][h]), _mm512_mul_ps(dmin, da), acc);
        }
        _mm512_storeu_ps(o, acc);
      }
    }
  }
}
// (the wide kernels, for one pair of tiles (p, q) or two (p, p + step, ...))
#define R8X2_WIDE(name, fn, type, G)                                                           \
  static void name(const uint8_t* p, const uint8_t* q, int k, const tw_qact* a, int T, int ka, \
                   float* o) {                                                                 \
    const int64_t step = q - p;                                                                \
    const uint8_t* tl[4] = {p, q, q + step, q + 2 * step};                                     \
    fn(type, tl, G, k, a, T, ka, o);                                                           \
  }
R8X2_WIDE(r8x2_wide_q4_0, r8x2_legacy_wide, GG_Q4_0, 1)
R8X2_WIDE(r8x2_wide_q4_1, r8x2_legacy_wide, GG_Q4_1, 1)
R8X2_WIDE(r8x2_wide_q5_0, r8x2_legacy_wide, GG_Q5_0, 1)
R8X2_WIDE(r8x2_wide_q5_1, r8x2_legacy_wide, GG_Q5_1, 1)
R8X2_WIDE(r8x2_wide_q8_0, r8x2_legacy_wide, GG_Q8_0, 1)
R8X2_WIDE(r8x4_wide_q4_0, r8x2_legacy_wide, GG_Q4_0, 2)
R8X2_WIDE(r8x4_wide_q4_1, r8x2_legacy_wide, GG_Q4_1, 2)
R8X2_WIDE(r8x4_wide_q5_0, r8x2_legacy_wide, GG_Q5_0, 2)
R8X2_WIDE(r8x4_wide_q5_1, r8x2_legacy_wide, GG_Q5_1, 2)
R8X2_WIDE(r8x2_wide_q4k, r8x2_kquant_wide, GG_Q4_K, 1)
R8X2_WIDE(r8x2_wide_q5k, r8x2_kquant_wide, GG_Q5_K, 1)
R8X2_WIDE(r8x2_wide_q6k, r8x2_kquant_wide, GG_Q6_K, 1)
R8X2_WIDE(r8x4_wide_q4k, r8x2_kquant_wide, GG_Q4_K, 2)
R8X2_WIDE(r8x4_wide_q5k, r8x2_kquant_wide, GG_Q5_K, 2)
R8X2_WIDE(r8x4_wide_q6k, r8x2_kquant_wide, GG_Q6_K, 2)
R8X2_WIDE(r8x2_wide_iq4nl, r8x2_legacy_wide, GG_IQ4_NL, 1)
R8X2_WIDE(r8x4_wide_iq4nl, r8x2_legacy_wide, GG_IQ4_NL, 2)
R8X2_WIDE(r8x2_wide_mxfp4, r8x2_legacy_wide, GG_MXFP4, 1)
R8X2_WIDE(r8x4_wide_mxfp4, r8x2_legacy_wide, GG_MXFP4, 2)
R8X2_WIDE(r8x2_wide_q2k, r8x2_kquant_wide, GG_Q2_K, 1)
R8X2_WIDE(r8x4_wide_q2k, r8x2_kquant_wide, GG_Q2_K, 2)
R8X2_WIDE(r8x2_wide_q3k, r8x2_kquant_wide, GG_Q3_K, 1)
R8X2_WIDE(r8x4_wide_q3k, r8x2_kquant_wide, GG_Q3_K, 2)
R8X2_WIDE(r8x2_wide_iq4xs, r8x2_kquant_wide, GG_IQ4_XS, 1)
R8X2_WIDE(r8x4_wide_iq4xs, r8x2_kquant_wide, GG_IQ4_XS, 2)

#endif
#else
#define R8_TOKENS 4
#endif

typedef void (*tw_r8_dot)(const uint8_t* tile, int k, const tw_qact* a, int T, int ka, float* out);

static tw_r8_dot r8_vector(int t) {
#if defined(TW_BLOCKS_256)
  if (tw_blocks_portable) return NULL;
  switch (t) {
    case GG_Q4_0: return r8_q4_0;
    case GG_Q4_1: return r8_q4_1;
    case GG_Q5_0: return r8_q5_0;
    case GG_Q5_1: return r8_q5_1;
    case GG_Q8_0: return r8_q8_0;
    case GG_Q4_K: return r8_q4k;
    case GG_Q5_K: return r8_q5k;
    case GG_Q6_K: return r8_q6k;
    case GG_IQ4_NL: return r8_iq4nl;
    case GG_MXFP4: return r8_mxfp4;
    case GG_Q2_K: return r8_q2k;
    case GG_Q3_K: return r8_q3k;
    case GG_IQ4_XS: return r8_iq4xs;
  }
#endif
  (void)t;
  return NULL;
}

typedef void (*tw_r8x2_dot)(const uint8_t* ta, const uint8_t* tb, int k, const tw_qact* a, int T,
                            int ka, float* out);

// Tokens from which a product takes tiles two or four at once: below it, a tile at a time
// streams the weights faster (timed on Zen 5 against 1536-wide rows: at 4 tokens a Q4_K or
// Q6_K product took half the time a tile at a time, at 8 still less; Q4_0 gains from 8).
static inline int r8_pairs_from(int t) { return is_super(t) ? 16 : 8; }

// Two tiles for up to R8_WIDE tokens at once, where they are built (else NULL).
static tw_r8x2_dot r8x2_wide(int t) {
#if defined(TW_BLOCKS_VECTOR)
  if (tw_blocks_portable) return NULL;
  switch (t) {
    case GG_Q4_0: return r8x2_wide_q4_0;
    case GG_Q4_1: return r8x2_wide_q4_1;
    case GG_Q5_0: return r8x2_wide_q5_0;
    case GG_Q5_1: return r8x2_wide_q5_1;
    case GG_Q8_0: return r8x2_wide_q8_0;
    case GG_Q4_K: return r8x2_wide_q4k;
    case GG_Q5_K: return r8x2_wide_q5k;
    case GG_Q6_K: return r8x2_wide_q6k;
    case GG_IQ4_NL: return r8x2_wide_iq4nl;
    case GG_MXFP4: return r8x2_wide_mxfp4;
    case GG_Q2_K: return r8x2_wide_q2k;
    case GG_Q3_K: return r8x2_wide_q3k;
    case GG_IQ4_XS: return r8x2_wide_iq4xs;
  }
#endif
  (void)t;
  return NULL;
}
#ifndef R8_WIDE
#define R8_WIDE 1
#endif

// Four tiles for up to R8_WIDE tokens at once (all but Q8_0), where they are built.
static tw_r8x2_dot r8x4_wide(int t) {
#if defined(TW_BLOCKS_VECTOR)
  if (tw_blocks_portable) return NULL;
  switch (t) {
    case GG_Q4_0: return r8x4_wide_q4_0;
    case GG_Q4_1: return r8x4_wide_q4_1;
    case GG_Q5_0: return r8x4_wide_q5_0;
    case GG_Q5_1: return r8x4_wide_q5_1;
    case GG_Q4_K: return r8x4_wide_q4k;
    case GG_Q5_K: return r8x4_wide_q5k;
    case GG_Q6_K: return r8x4_wide_q6k;
    case GG_IQ4_NL: return r8x4_wide_iq4nl;
    case GG_MXFP4: return r8x4_wide_mxfp4;
    case GG_Q2_K: return r8x4_wide_q2k;
    case GG_Q3_K: return r8x4_wide_q3k;
    case GG_IQ4_XS: return r8x4_wide_iq4xs;
  }
#endif
  (void)t;
  return NULL;
}

// A tile's (or two tiles') results out[nb][lanes] to y[b * ldy + j0 + r] (+ bias), added
// to what y holds with accumulate; eight lanes at a time where every row is there.
static inline void r8_store(const tw_linear* L, const float* out, int lanes, int nb, int j0,
                            float* y, int64_t ldy, int accumulate) {
  const int rows = L->n - j0 < lanes ? L->n - j0 : lanes;
  for (int b = 0; b < nb; ++b) {
    float* o = y + (int64_t)b * ldy + j0;
    const float* v = out + (int64_t)lanes * b;
    int r = 0;
#if defined(__AVX2__)
    for (; r + 8 <= rows; r += 8) {
      __m256 x = _mm256_loadu_ps(v + r);
      if (L->bias) x = _mm256_add_ps(x, _mm256_loadu_ps(L->bias + j0 + r));
      if (accumulate) x = _mm256_add_ps(_mm256_loadu_ps(o + r), x);
      _mm256_storeu_ps(o + r, x);
    }
#endif
    for (; r < rows; ++r) {
      const float x = v[r] + (L->bias ? L->bias[j0 + r] : 0.f);
      o[r] = accumulate ? o[r] + x : x;
    }
  }
}

// Tiles [t0, t0 + c) (c = 1, 2 or 4) of a repacked weight against tokens [0, B); r8_rows_part
// asks for more than one tile only from r8_pairs_from(t) tokens.
static void r8_group(const tw_linear* L, int t0, int c, const tw_qact* a, float* y, int64_t ldy,
                     int B, int accumulate) {
  const int t = L->dtype - TW_R8, k = L->k;
  const int64_t tb = (int64_t)(k / block_elems(t)) * r8_record(t);
  const uint8_t* w = (const uint8_t*)L->w + t0 * tb;
  const tw_r8x2_dot fn = c == 4 ? r8x4_wide(t) : c == 2 ? r8x2_wide(t) : NULL;
  const tw_r8_dot dot = r8_vector(t);
  const int step = fn ? R8_WIDE : R8_TOKENS, lanes = 8 * c;
  float out[(R8_WIDE > R8_TOKENS ? R8_WIDE : R8_TOKENS) * 32];
  if (c == 4 && !fn) {  // pairs or single tiles, then
    r8_group(L, t0, 2, a, y, ldy, B, accumulate);
    r8_group(L, t0 + 2, 2, a, y, ldy, B, accumulate);
    return;
  }
  if (c == 2 && !fn) {  // single tiles
    r8_group(L, t0, 1, a, y, ldy, B, accumulate);
    r8_group(L, t0 + 1, 1, a, y, ldy, B, accumulate);
    return;
  }
  for (int b0 = 0; b0 < B; b0 += step) {
    const int nb = B - b0 < step ? B - b0 : step;
    const tw_qact sub = qact_row(a, b0, k);
    if (fn) fn(w, w + tb, k, &sub, nb, k, out);
    else if (dot) dot(w, k, &sub, nb, k, out);
    else r8_portable(t, w, k, &sub, nb, k, out);
    r8_store(L, out, lanes, nb, 8 * t0, y + (int64_t)b0 * ldy, ldy, accumulate);
  }
}

// The rows of one repacked weight against quantised activation rows [0, B), as
// block_rows_part: eight rows a tile, for prompts two or four tiles at once in 512-bit
// vectors; the groups of tiles shared among the threads.
static void r8_rows_part(const tw_linear* L, const tw_qact* a, float* y, int64_t ldy, int B,
                         int accumulate, int nowait) {
  const int t = L->dtype - TW_R8, tiles = (L->n + 7) / 8;
  const int per = B >= r8_pairs_from(t) ? (r8x4_wide(t) ? 4 : r8x2_wide(t) ? 2 : 1) : 1;
  const int groups = (tiles + per - 1) / per;
#define R8_ROWS_BODY                                                                  \
  for (int g = 0; g < groups; ++g) {                                                  \
    const int t0 = g * per, left = tiles - t0 < per ? tiles - t0 : per;               \
    if (left == 3) {                                                                  \
      r8_group(L, t0, 2, a, y, ldy, B, accumulate);                                   \
      r8_group(L, t0 + 2, 1, a, y, ldy, B, accumulate);                               \
    } else {                                                                          \
      r8_group(L, t0, left, a, y, ldy, B, accumulate);                                \
    }                                                                                 \
  }
  if (nowait) {
#pragma omp for schedule(static) nowait
    R8_ROWS_BODY
  } else {
#pragma omp for schedule(static)
    R8_ROWS_BODY
  }
#undef R8_ROWS_BODY
}
