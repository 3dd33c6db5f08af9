// Causal attention of prompt chunks.
// (part of kernels.c, the one translation unit: included there, in order)

// -------------------------------------------------------------- prompt chunks ---
// Causal attention for the prompt chunks of a batch (head_dim 64, bfloat16 K/V), instead
// of one torch attention call per sequence and layer. Per sequence and KV head, its keys
// and values are gathered once from the pool into pair layouts (K^T: 16 keys x 32 dims per
// tile; V: 32 keys x 16 dims); then for each block of 16 query rows of one query head:
// scores S = Q K^T (float32), a softmax per row in float32 over the keys the row may see,
// its weights rounded to bfloat16 (as torch's flash attention does for bfloat16), and
// O = P V, divided by the row's sum. Keys are grouped from position 0, so a row's result
// does not depend on how its prompt was cut into chunks or on the rest of the batch.
//
// The products run on AMX tiles where they are built and granted, else as AVX-512 BF16
// dot products on the same layouts: a pair of a query row (one 32-bit broadcast) against
// a row of the K^T layout gives 16 keys' partial scores, and a pair of weights against a
// row of the V layout 16 dims' partial sums, with no horizontal sums. The two orders of
// summation differ; both keep float32 sums of bfloat16 products.
#if defined(__AVX512BF16__)
typedef struct {
  uint16_t* kt;  // [keys/16][2][16][16][2]: kt[j/16][c][i][j%16][e] = K[j][32c + 2i + e]
  uint16_t* vt;  // [keys/32][4][16][16][2]: vt[j/32][t][i][n][e] = V[32(j/32) + 2i + e][16t + n]
  float* s;      // [16][keys] scores of a block of rows
  uint16_t* p;   // [16][keys] their softmax weights, bfloat16, not yet normalised
} tw_prefill_buf;

// The first n of 16 lanes (none for n <= 0, all for n >= 16).
static inline __mmask16 first_lanes(int64_t n) {
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
}

// S [16][nk] (row stride nk) = qb [16][64] x K^T over keys [0, nk), 4 rows at a time.
static void scores_vec(const uint16_t (*qb)[64], const uint16_t* ktall, int64_t nk, float* s) {
  for (int64_t kg = 0; kg < nk; kg += 16) {
    const uint16_t* kt = ktall + (kg / 16) * 1024;
    for (int r0 = 0; r0 < 16; r0 += 4) {
      __m512 acc[4];
      for (int u = 0; u < 4; ++u) acc[u] = _mm512_setzero_ps();
      for (int c = 0; c < 2; ++c)
        for (int i = 0; i < 16; ++i) {
          const __m512bh k = (__m512bh)_mm512_load_si512(kt + c * 512 + i * 32);
          for (int u = 0; u < 4; ++u)
            acc[u] = _mm512_dpbf16_ps(acc[u], pair_of(&qb[r0 + u][32 * c + 2 * i]), k);
        }
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(s + (r0 + u) * nk + kg, acc[u]);
    }
  }
}

// o [16][64] = p [16][nk] (bfloat16, row stride nk) x V over keys [0, nk), 4 rows at a time.
static void values_vec(const uint16_t* p, const uint16_t* vtall, int64_t nk, float (*o)[64]) {
  for (int r0 = 0; r0 < 16; r0 += 4) {
    __m512 acc[4][4];
    for (int u = 0; u < 4; ++u)
      for (int t = 0; t < 4; ++t) acc[u][t] = _mm512_setzero_ps();
    for (int64_t ks = 0; ks < nk; ks += 32) {
      const uint16_t* vt = vtall + (ks / 32) * 2048;
      for (int i = 0; i < 16; ++i) {
        __m512bh v[4];
        for (int t = 0; t < 4; ++t) v[t] = (__m512bh)_mm512_load_si512(vt + t * 512 + i * 32);
        for (int u = 0; u < 4; ++u) {
          const __m512bh w = pair_of(p + (r0 + u) * nk + ks + 2 * i);
          for (int t = 0; t < 4; ++t) acc[u][t] = _mm512_dpbf16_ps(acc[u][t], w, v[t]);
        }
      }
    }
    for (int u = 0; u < 4; ++u)
      for (int t = 0; t < 4; ++t) _mm512_storeu_ps(&o[r0 + u][16 * t], acc[u][t]);
  }
}

// amx: the tiles are configured (tiles_16x64) and do the products.
static void prefill_head(const void* k_pool, const void* v_pool, int kv_heads, int h,
                         const int64_t* slots, int64_t L, int64_t n, const uint16_t* q,
                         int64_t q_stride, int G, float scale, uint16_t* out,
                         int64_t out_stride, tw_prefill_buf* buf, int amx) {
  static const uint16_t none[64];  // the keys and values past L, up to a multiple of 32
  const int64_t ctx = L - n, lp = (L + 31) / 32 * 32;
  for (int64_t j = 0; j < lp; ++j) {
    const uint16_t* k = j < L ? (const uint16_t*)k_pool + (slots[j] * kv_heads + h) * 64 : none;
    const uint16_t* v = j < L ? (const uint16_t*)v_pool + (slots[j] * kv_heads + h) * 64 : none;
    uint16_t* kt = buf->kt + (j / 16) * 1024 + (j % 16) * 2;
    for (int c = 0; c < 2; ++c)
      for (int i = 0; i < 16; ++i) {
        kt[c * 512 + i * 32] = k[32 * c + 2 * i];
        kt[c * 512 + i * 32 + 1] = k[32 * c + 2 * i + 1];
      }
    uint16_t* vt = buf->vt + (j / 32) * 2048 + ((j % 32) / 2) * 32 + (j % 2);
    for (int d = 0; d < 64; ++d) vt[(d / 16) * 512 + (d % 16) * 2] = v[d];
  }
  uint16_t qb[16][64] __attribute__((aligned(64)));
  float o[16][64] __attribute__((aligned(64)));
  for (int g = 0; g < G; ++g)
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int rows = n - i0 < 16 ? (int)(n - i0) : 16;
      for (int r = 0; r < 16; ++r) {
        if (r < rows)
          memcpy(qb[r], q + (i0 + r) * q_stride + g * 64, 128);
        else
          memset(qb[r], 0, 128);
      }
      const int64_t seen = ctx + i0 + rows;      // keys the block's last row sees
      const int64_t nk = (seen + 31) / 32 * 32;  // keys the products cover (zeros past L)
      if (!amx) scores_vec((const uint16_t(*)[64])qb, buf->kt, nk, buf->s);
#if defined(TW_AMX_BUILT)
      for (int64_t kc = 0; amx && kc < nk; kc += 64) {  // S, 4 tiles of 16 keys at a time
        const int nt = nk - kc < 64 ? (int)((nk - kc) / 16) : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < 2; ++c) {
          _tile_loadd(4, &qb[0][32 * c], 128);
          const uint16_t* kt = buf->kt + (kc / 16) * 1024 + c * 512;
          _tile_loadd(5, kt, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (nt > 1) {
            _tile_loadd(6, kt + 1024, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (nt > 2) {
            _tile_loadd(5, kt + 2048, 64);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (nt > 3) {
            _tile_loadd(6, kt + 3072, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        const int64_t ld = nk * 4;  // bytes between rows of s
        float* s = buf->s + kc;
        _tile_stored(0, s, ld);
        if (nt > 1) _tile_stored(1, s + 16, ld);
        if (nt > 2) _tile_stored(2, s + 32, ld);
        if (nt > 3) _tile_stored(3, s + 48, ld);
      }
#endif
      float inv[16];
      for (int r = 0; r < 16; ++r) {
        uint16_t* pr = buf->p + r * nk;
        if (r >= rows) {
          memset(pr, 0, (size_t)nk * 2);
          continue;
        }
        const float* sr = buf->s + r * nk;
        const int64_t lim = ctx + i0 + r + 1;  // this row sees keys [0, lim)
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t k = 0; k < lim; k += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + k), _mm512_set1_ps(scale));
          m = _mm512_mask_max_ps(m, first_lanes(lim - k), m, x);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < nk; k += 16) {
          const __mmask16 ok = first_lanes(lim - k);
          const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(sr + k), _mm512_set1_ps(scale), mx);
          const __m512 e = _mm512_maskz_mov_ps(ok, exp16(_mm512_maskz_mov_ps(ok, x)));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256((__m256i*)(pr + k), (__m256i)_mm512_cvtneps_pbh(e));
        }
        inv[r] = 1.f / _mm512_reduce_add_ps(sum);
      }
      if (!amx) values_vec(buf->p, buf->vt, nk, o);
#if defined(TW_AMX_BUILT)
      if (amx) {  // O = P V on tiles
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < nk; ks += 32) {
          _tile_loadd(4, buf->p + ks, nk * 2);
          const uint16_t* vt = buf->vt + (ks / 32) * 2048;
          _tile_loadd(5, vt, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, vt + 512, 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, vt + 1024, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, vt + 1536, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, &o[0][0], 256);
        _tile_stored(1, &o[0][16], 256);
        _tile_stored(2, &o[0][32], 256);
        _tile_stored(3, &o[0][48], 256);
      }
#endif
      for (int r = 0; r < rows; ++r) {
        uint16_t* dst = out + (i0 + r) * out_stride + g * 64;
        for (int c = 0; c < 4; ++c)
          _mm256_storeu_si256((__m256i*)(dst + 16 * c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                  _mm512_loadu_ps(&o[r][16 * c]), _mm512_set1_ps(inv[r]))));
      }
    }
}
#endif

// S sequences of a flat batch, each with n[s] > 0 new rows: q rows [T, q_stride] bfloat16
// (query head j at j * 64, RoPE applied), the sequence's rows from q_start[s]; its keys
// and values (its context, then the new rows' own, already in the pools) at pool slots
// slots[slot_start[s] .. + keys[s]]. out rows [T, out_stride] bfloat16 get the attention
// of every query head. amx: the products on AMX tiles (the caller has the permission).
// Returns -1 (nothing written) where the library has neither AMX nor AVX-512 BF16, or amx
// is asked of a library built without it.
int tw_prefill_attention(const void* k_pool, const void* v_pool, int H, int kv_heads,
                         const uint16_t* q, int64_t q_stride, const int64_t* q_start,
                         const int64_t* n, const int64_t* slots, const int64_t* slot_start,
                         const int64_t* keys, int S, float scale, uint16_t* out,
                         int64_t out_stride, int amx, int threads) {
#if !defined(TW_AMX_BUILT)
  if (amx) return -1;
#endif
#if defined(__AVX512BF16__)
  if (S <= 0) return 0;
  const int G = H / kv_heads;
  int64_t longest = 0;
  for (int s = 0; s < S; ++s) longest = keys[s] > longest ? keys[s] : longest;
  const int64_t lp = (longest + 63) / 64 * 64;
#pragma omp parallel num_threads(threads)
  {
#if defined(TW_AMX_BUILT)
    if (amx) tiles_16x64();
#endif
    tw_prefill_buf buf;
    buf.kt = (uint16_t*)aligned_alloc(64, (size_t)lp * 64 * 2);
    buf.vt = (uint16_t*)aligned_alloc(64, (size_t)lp * 64 * 2);
    buf.s = (float*)aligned_alloc(64, (size_t)lp * 16 * 4);
    buf.p = (uint16_t*)aligned_alloc(64, (size_t)lp * 16 * 2);
#pragma omp for schedule(dynamic)
    for (int task = 0; task < S * kv_heads; ++task) {
      const int s = task / kv_heads, h = task % kv_heads;
      prefill_head(k_pool, v_pool, kv_heads, h, slots + slot_start[s], keys[s], n[s],
                   q + q_start[s] * q_stride + (int64_t)h * G * 64, q_stride, G, scale,
                   out + q_start[s] * out_stride + (int64_t)h * G * 64, out_stride, &buf, amx);
    }
    free(buf.kt);
    free(buf.vt);
    free(buf.s);
    free(buf.p);
#if defined(TW_AMX_BUILT)
    if (amx) _tile_release();
#endif
  }
  return 0;
#else
  (void)k_pool, (void)v_pool, (void)H, (void)kv_heads, (void)q, (void)q_stride, (void)q_start;
  (void)n, (void)slots, (void)slot_start, (void)keys, (void)S, (void)scale, (void)out;
  (void)out_stride, (void)amx, (void)threads;
  return -1;
#endif
}

