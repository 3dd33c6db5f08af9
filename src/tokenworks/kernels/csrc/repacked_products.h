// Block weights repacked eight rows at a time, once at load (tw_r8_pack), for Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K.
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
//   Q4_0 .. Q5_1: d[r] (float16), Q4_1/Q5_1: m[r] (float16), Q5: qh[r] (u32, bit 8i + c:
//     the fifth bit of element 4c + i), then chunks c = 0-3 [r][4 bytes]: low nibbles
//     elements 4c + i, high nibbles 16 + 4c + i. Q8_0: d[r], then chunks c = 0-7 (int8).
//   Q4_K, Q5_K: d[r], dmin[r] (float16), sc[j][r], mn[j][r] (6-bit, a byte each), Q5_K:
//     qh chunks c = 0-7 [r][4] (bit j: run j's fifth bit), then for each pair of runs
//     (2p, 2p + 1) chunks c = 0-7 [r][4]: run 2p in the low nibbles, 2p + 1 in the high.
//   Q6_K: d[r] (float16), sc[j][r][2] (int8, the scales of run j's two halves), low
//     planes as Q4_K's values, then for each quad of runs chunks [r][4]: bits 2i-2i+1 the
//     high two bits of run 4h + i. A weight is d * sc * (q - 32).

static inline int r8_packs(int t) {
  return t == GG_Q4_0 || t == GG_Q4_1 || t == GG_Q5_0 || t == GG_Q5_1 || t == GG_Q8_0 ||
         t == GG_Q4_K || t == GG_Q5_K || t == GG_Q6_K;
}

// bytes of one block's record for eight rows
static inline int r8_record(int t) {
  switch (t) {
    case GG_Q4_K: return 32 + 128 + 1024;
    case GG_Q5_K: return 32 + 128 + 256 + 1024;
    case GG_Q6_K: return 16 + 128 + 1024 + 512;
    default: return 8 * block_bytes(t);
  }
}
static inline int r8_has_min(int t) { return t == GG_Q4_1 || t == GG_Q5_1; }
static inline int r8_fifth(int t) { return t == GG_Q5_0 || t == GG_Q5_1; }
static inline int r8_values(int t) { return 16 + 16 * r8_has_min(t) + 32 * r8_fifth(t); }

int tw_r8_packs(int t) { return r8_packs(t); }

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
      const int lead = t == GG_Q4_0 || t == GG_Q8_0 ? 2 : t == GG_Q4_1 ? 4 : t == GG_Q5_0 ? 6 : 8;
      memcpy(rec + 2 * r, b, 2);
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
  if (r8_fifth(t)) q |= ((load_u32(p + 16 + 16 * r8_has_min(t) + 4 * r) >> (8 * i + c)) & 1) << 4;
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
          if (t != GG_Q8_0) acc = fmaf(r8_has_min(t) ? half_to_f32(p + 16 + 2 * r) : d * zp, x.s32[g], acc);
        }
      } else {
        for (int i = 0; i < k / 256; ++i) {
          const uint8_t* p = tile + (int64_t)i * rec;
          const int8_t* ab = x.q256 + i * 256;
          const int16_t* bs = x.bs + i * 16;
          int s = 0, m = 0;
          for (int j = 0; j < 8; ++j) {
            int h[2] = {0, 0};
            for (int l = 0; l < 32; ++l) {
              const int at = ((l / 4) * 8 + r) * 4 + l % 4;
              int q;
              if (t == GG_Q6_K) {
                q = ((p[144 + (j / 2) * 256 + at] >> (4 * (j % 2))) & 0xF) |
                    (((p[1168 + (j / 4) * 256 + at] >> (2 * (j % 4))) & 3) << 4);
              } else {
                q = (p[160 + 256 * (t == GG_Q5_K) + (j / 2) * 256 + at] >> (4 * (j % 2))) & 0xF;
                if (t == GG_Q5_K) q |= ((p[160 + at] >> j) & 1) << 4;
              }
              h[l / 16] += q * ab[32 * j + l];
            }
            if (t == GG_Q6_K) {
              const int8_t* sc = (const int8_t*)p + 16 + (j * 8 + r) * 2;
              s += h[0] * sc[0] + h[1] * sc[1];
              m += sc[0] * bs[2 * j] + sc[1] * bs[2 * j + 1];
            } else {
              s += (h[0] + h[1]) * p[32 + 8 * j + r];
              m += p[96 + 8 * j + r] * (bs[2 * j] + bs[2 * j + 1]);
            }
          }
          const float da = x.d256[i];
          if (t == GG_Q6_K) {
            acc = fmaf((float)(s - 32 * m), half_to_f32(p + 2 * r) * da, acc);
          } else {
            acc = fmaf((float)s, half_to_f32(p + 2 * r) * da, acc);
            acc = fmaf(-(float)m, half_to_f32(p + 16 + 2 * r) * da, acc);
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

// bit `bit` of each byte moved to bit 4, the rest cleared
INLINE __m256i r8_fifth_bit(__m256i v, const int bit) {
  const __m256i at = bit <= 4 ? _mm256_sll_epi32(v, _mm_cvtsi32_si128(4 - bit))
                              : _mm256_srl_epi32(v, _mm_cvtsi32_si128(bit - 4));
  return _mm256_and_si256(at, _mm256_set1_epi8(0x10));
}

INLINE void r8_legacy(const int t, const uint8_t* tile, int k, const tw_qact* a, const int T,
                      int ka, float* out) {
  const int rec = r8_record(t), hm = r8_has_min(t), five = r8_fifth(t), vo = r8_values(t);
  const float zp = t == GG_Q4_0 ? -8.f : t == GG_Q5_0 ? -16.f : 0.f;
  const __m256i low4 = _mm256_set1_epi8(0xF);
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
    }
    for (int b = 0; b < T; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      __m256i s = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i x = r8_four(ab + 4 * c);
        s = R8_DP(s, w[c], t == GG_Q8_0 ? _mm256_sign_epi8(x, sgn[c]) : x);
      }
      const int64_t at = (int64_t)b * (ka / 32) + g;
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(a->d32[at])), acc[b]);
      if (t != GG_Q8_0) acc[b] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->s32[at]), acc[b]);
    }
  }
  for (int b = 0; b < T; ++b) _mm256_storeu_ps(out + 8 * b, acc[b]);
}

// Q4_K, Q5_K (six-bit scale and minimum a run) and Q6_K (a signed scale a half-run)
INLINE void r8_kquant(const int t, const uint8_t* tile, int k, const tw_qact* a, const int T,
                      int ka, float* out) {
  const int rec = r8_record(t), nsb = k / 256, six = t == GG_Q6_K, five = t == GG_Q5_K;
  const int vo = six ? 144 : 160 + 256 * five;
  const __m256i low4 = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
  __m256 acc[R8_TOKENS];
  for (int b = 0; b < T; ++b) acc[b] = _mm256_setzero_ps();
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* p = tile + (int64_t)i * rec;
    for (int o = 0; o < rec; o += 64) __builtin_prefetch(p + PREFETCH_BYTES + o, 0, 3);
    __m256i S[R8_TOKENS], M[R8_TOKENS];
    for (int b = 0; b < T; ++b) S[b] = M[b] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i w[8];
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
      __m256i sc0, sc1, mn;  // int32 lanes: the scales (Q6_K: of each half), the minimums
      if (six) {  // int16 pairs (scale of half 0, of half 1) in each lane
        mn = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 + 16 * j)));
        sc0 = _mm256_srai_epi32(_mm256_slli_epi32(mn, 16), 16);
        sc1 = _mm256_srai_epi32(mn, 16);
      } else {  // the minimum twice (it multiplies both sums of 16)
        sc0 = sc1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 32 + 8 * j)));
        const __m256i m1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 96 + 8 * j)));
        mn = _mm256_or_si256(m1, _mm256_slli_epi32(m1, 16));
      }
      for (int b = 0; b < T; ++b) {
        const int8_t* ab = a->q256 + (int64_t)b * ka + 256 * i + 32 * j;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) s0 = R8_DP(s0, w[c], r8_four(ab + 4 * c));
        for (int c = 4; c < 8; ++c) s1 = R8_DP(s1, w[c], r8_four(ab + 4 * c));
        if (six) {
          S[b] = _mm256_add_epi32(S[b], _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1)));
        } else {
          S[b] = _mm256_add_epi32(S[b], _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), sc0));
        }
        const int16_t* bs = a->bs + (int64_t)b * (ka / 16) + 16 * i + 2 * j;
        M[b] = _mm256_add_epi32(M[b], _mm256_madd_epi16(mn, r8_four((const int8_t*)bs)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    const __m256 dmin = six ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
    for (int b = 0; b < T; ++b) {
      const __m256 da = _mm256_set1_ps(a->d256[(int64_t)b * ((ka + 255) / 256) + i]);
      if (six) {
        const __m256i q = _mm256_sub_epi32(S[b], _mm256_slli_epi32(M[b], 5));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(d, da), acc[b]);
      } else {
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[b]), _mm256_mul_ps(d, da), acc[b]);
        acc[b] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(M[b]), _mm256_mul_ps(dmin, da), acc[b]);
      }
    }
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
INLINE __m512i r8x2_fifth_bit(__m512i v, const int bit) {
  const __m512i at = bit <= 4 ? _mm512_sll_epi32(v, _mm_cvtsi32_si128(4 - bit))
                              : _mm512_srl_epi32(v, _mm_cvtsi32_si128(bit - 4));
  return _mm512_and_si512(at, _mm512_set1_epi8(0x10));
}

// A 32-element type's tiles, one pair or two (G; Q8_0: one), for up to R8_WIDE tokens
// (prompts): each group unpacked once for all of them, their sums kept in out between
// groups; each lane's sums and float steps are those of r8_legacy.
INLINE void r8x2_legacy_wide(const int t, const uint8_t* const* tl, const int G, int k,
                             const tw_qact* a, int T, int ka, float* out) {
  const int rec = r8_record(t), hm = r8_has_min(t), five = r8_fifth(t), vo = r8_values(t);
  const int lanes = 16 * G;
  const float zp = t == GG_Q4_0 ? -8.f : t == GG_Q5_0 ? -16.f : 0.f;
  const __m512i low4 = _mm512_set1_epi8(0xF);
  for (int b = 0; b < T; ++b)
    for (int h = 0; h < G; ++h) _mm512_storeu_ps(out + lanes * b + 16 * h, _mm512_setzero_ps());
  for (int g = 0; g < k / 32; ++g) {
    __m512 d[2], m[2];
    __m512i w[2][8];
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
      }
    }
    for (int b = 0; b < T; ++b) {
      const int8_t* ab = a->q32 + (int64_t)b * ka + g * 32;
      __m512i s[2];
      for (int h = 0; h < G; ++h) s[h] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
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
        if (t != GG_Q8_0) acc = _mm512_fmadd_ps(m[h], _mm512_set1_ps(a->s32[at]), acc);
        _mm512_storeu_ps(o, acc);
      }
    }
  }
}

// A K type's tiles, two pairs (G = 2) or one, for up to R8_WIDE tokens (prompts): each run
// of 32 is unpacked once for all of them, their integer sums kept in memory (L1) between
// runs rather than in registers; each lane's sums and float steps are those of
// r8_kquant. Two pairs halve the activation loads a product takes.
#define R8_WIDE 64
INLINE void r8x2_kquant_wide(const int t, const uint8_t* const* tl, const int G, int k,
                             const tw_qact* a, int T, int ka, float* out) {
  const int rec = r8_record(t), nsb = k / 256, six = t == GG_Q6_K, five = t == GG_Q5_K;
  const int vo = six ? 144 : 160 + 256 * five, lanes = 16 * G;
  const __m512i low4 = _mm512_set1_epi8(0xF), three = _mm512_set1_epi8(3);
  __m512i S[R8_WIDE][2], M[R8_WIDE][2];
  for (int b = 0; b < T; ++b)
    for (int h = 0; h < G; ++h) _mm512_storeu_ps(out + lanes * b + 16 * h, _mm512_setzero_ps());
  for (int i = 0; i < nsb; ++i) {
    const uint8_t* pq[4];
    for (int h = 0; h < 2 * G; ++h) pq[h] = tl[h] + (int64_t)i * rec;
    for (int b = 0; b < T; ++b)
      for (int h = 0; h < G; ++h) S[b][h] = M[b][h] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i w[2][8], sc0[2], sc1[2], mn[2];
      for (int h = 0; h < G; ++h) {
        const uint8_t *p = pq[2 * h], *q = pq[2 * h + 1];
        for (int c = 0; c < 8; ++c) {
          const int at = vo + (j / 2) * 256 + 32 * c;
          const __m512i v = r8x2_load(p + at, q + at);
          w[h][c] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, low4);
          if (six) {
            const int hat = 1168 + (j / 4) * 256 + 32 * c;
            const __m512i hv = r8x2_load(p + hat, q + hat);
            const __m512i h2 = _mm512_and_si512(_mm512_srl_epi16(hv, _mm_cvtsi32_si128(2 * (j % 4))), three);
            w[h][c] = _mm512_or_si512(w[h][c], _mm512_slli_epi16(h2, 4));
          } else if (five) {
            w[h][c] = _mm512_or_si512(w[h][c], r8x2_fifth_bit(r8x2_load(p + 160 + 32 * c, q + 160 + 32 * c), j));
          }
        }
        if (six) {
          mn[h] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128((const __m128i*)(q + 16 + 16 * j)),
                                                        _mm_loadu_si128((const __m128i*)(p + 16 + 16 * j))));
          sc0[h] = _mm512_srai_epi32(_mm512_slli_epi32(mn[h], 16), 16);
          sc1[h] = _mm512_srai_epi32(mn[h], 16);
        } else {
          sc0[h] = sc1[h] = r8x2_bytes8(p + 32 + 8 * j, q + 32 + 8 * j);
          const __m512i m1 = r8x2_bytes8(p + 96 + 8 * j, q + 96 + 8 * j);
          mn[h] = _mm512_or_si512(m1, _mm512_slli_epi32(m1, 16));
        }
      }
      const int8_t* ab = a->q256 + 256 * i + 32 * j;
      const int16_t* bs = a->bs + 16 * i + 2 * j;
      for (int b = 0; b < T; ++b, ab += ka, bs += ka / 16) {
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
          if (six) {
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
      const __m512 dmin = six ? d : r8x2_halves(p + 16, q + 16);
      for (int b = 0; b < T; ++b) {
        const __m512 da = _mm512_set1_ps(a->d256[(int64_t)b * ((ka + 255) / 256) + i]);
        float* o = out + lanes * b + 16 * h;
        __m512 acc = _mm512_loadu_ps(o);
        if (six) {
          const __m512i v = _mm512_sub_epi32(S[b][h], _mm512_slli_epi32(M[b][h], 5));
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(d, da), acc);
        } else {
          acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[b][h]), _mm512_mul_ps(d, da), acc);
          acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M[b][h]), _mm512_mul_ps(dmin, da), acc);
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
  }
#endif
  (void)t;
  return NULL;
}

typedef void (*tw_r8x2_dot)(const uint8_t* ta, const uint8_t* tb, int k, const tw_qact* a, int T,
                            int ka, float* out);

#define R8_PAIRS_FROM 4  // tokens from which prompts take tiles two or four at once

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

// Tiles [t0, t0 + c) (c = 1, 2 or 4) of a repacked weight against tokens [0, B).
static void r8_group(const tw_linear* L, int t0, int c, const tw_qact* a, float* y, int64_t ldy,
                     int B, int accumulate) {
  const int t = L->dtype - TW_R8, k = L->k;
  const int64_t tb = (int64_t)(k / block_elems(t)) * r8_record(t);
  const uint8_t* w = (const uint8_t*)L->w + t0 * tb;
  const int batch = B >= R8_PAIRS_FROM;  // (a decode step streams faster a tile at a time)
  const tw_r8x2_dot fn = c == 4 ? r8x4_wide(t) : c == 2 && batch ? r8x2_wide(t) : NULL;
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
  const int per = B >= R8_PAIRS_FROM ? (r8x4_wide(t) ? 4 : r8x2_wide(t) ? 2 : 1) : 1;
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
