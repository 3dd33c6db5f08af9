// Dot products of a weight row with an activation row (float32, bfloat16, int8, Q4), and a linear layer's rows.
// (part of kernels.c, the one translation unit: included there, in order)

// ---------------------------------------------------------------- dot products ------
// x is float32; xb is the same vector rounded to bfloat16 (used by the BF16 path only).

static inline float dot_f32(const float* w, const float* x, int k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < k; ++i) s += w[i] * x[i];
  return s;
}

static inline float dot_bf16(const uint16_t* w, const float* x, const uint16_t* xb, int k) {
#if defined(__AVX512BF16__)
  if (k % 32 == 0) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= k; i += 64) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xb + i),
                            (__m512bh)_mm512_loadu_si512(w + i));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xb + i + 32),
                            (__m512bh)_mm512_loadu_si512(w + i + 32));
    }
    if (i < k)
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xb + i),
                            (__m512bh)_mm512_loadu_si512(w + i));
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
#endif
  (void)xb;
  float s = 0.f;
  for (int i = 0; i < k; ++i) s += bf16_to_f32(w[i]) * x[i];
  return s;
}

static inline float dot_i8(const int8_t* w, const float* x, int k) {
#if defined(__AVX512F__)
  if (k % 32 == 0) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 32) {
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + i))));
      __m512 w1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + i + 16))));
      a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (k % 16 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 16) {
      const __m128i q = _mm_loadu_si128((const __m128i*)(w + i));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), a1);
    }
    return hsum8(_mm256_add_ps(a0, a1));
  }
#endif
  float s = 0.f;
  for (int i = 0; i < k; ++i) s += (float)w[i] * x[i];
  return s;
}

// A Q4 row times x: sum over blocks of d * (q . x) + m * (sum of x over the block); xsum
// holds those sums, computed once per input row.
static inline float dot_q4(const uint8_t* row, const float* x, const float* xsum, int k) {
  const int blocks = k / Q4_BLOCK;
  float mins = 0.f;
  for (int g = 0; g < blocks; ++g) mins += bf16_to_f32(((const uint16_t*)(row + g * Q4_BYTES))[1]) * xsum[g];
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int g = 0; g < blocks; ++g) {
    const uint8_t* blk = row + g * Q4_BYTES;
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 4)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
    __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(x + g * Q4_BLOCK));
    t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + g * Q4_BLOCK + 16), t);
    acc = _mm512_fmadd_ps(t, _mm512_set1_ps(bf16_to_f32(*(const uint16_t*)blk)), acc);
  }
  return _mm512_reduce_add_ps(acc) + mins;
#else
  float s = 0.f;
  for (int g = 0; g < blocks; ++g) {
    const uint8_t* blk = row + g * Q4_BYTES;
    float t = 0.f;
    for (int j = 0; j < 16; ++j)
      t += (blk[4 + j] & 0xF) * x[g * Q4_BLOCK + j] + (blk[4 + j] >> 4) * x[g * Q4_BLOCK + 16 + j];
    s += bf16_to_f32(*(const uint16_t*)blk) * t;
  }
  return s + mins;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// Bfloat16 weights times float32 rows on AVX2, in tiles of NR rows x NC columns. Every
// output element is summed the same way whatever the tile: one 8-lane FMA chain over k in
// order, then hsum8, then the k % 8 tail in order; so an element's bits never depend on
// how many rows came with it or where the tiles fell (batch invariance), and the tiles
// only decide how often a weight or an input vector is loaded.
static inline __attribute__((always_inline)) void bf16_tile(
    const uint16_t* w, int k, const float* x, int64_t ldx, int NR, int NC, float* out) {
  __m256 acc[4][4];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  const int k8 = k & ~7;
  for (int i = 0; i < k8; i += 8) {
    __m256 wv[4];
    for (int c = 0; c < NC; ++c)
      wv[c] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + (int64_t)c * k + i))), 16));
    for (int r = 0; r < NR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) {
      float s = hsum8(acc[r][c]);
      for (int i = k8; i < k; ++i) s += bf16_to_f32(w[(int64_t)c * k + i]) * x[r * ldx + i];
      out[r * 4 + c] = s;
    }
}

#define BF16_ROW_BLOCK 32  // rows of x a pass over the weights takes (they stay in L2)
#define BF16_COL_TASK 16   // columns a thread takes at a time

// y[b, j] (+)= W[j] . x[b] (+ bias) for bfloat16 W on AVX2: rows in blocks of
// BF16_ROW_BLOCK, each block's columns shared among the threads; inside a task, 4 rows x 2
// columns a tile (fewer rows: 1 or 2 rows x 4 columns, 3 x 2).
static void bf16_rows(const tw_linear* L, const float* x, float* y, int B, int accumulate) {
  const int n = L->n, k = L->k;
  const uint16_t* W = (const uint16_t*)L->w;
  const int tasks = (n + BF16_COL_TASK - 1) / BF16_COL_TASK;
  for (int b0 = 0; b0 < B; b0 += BF16_ROW_BLOCK) {
    const int b1 = B - b0 < BF16_ROW_BLOCK ? B : b0 + BF16_ROW_BLOCK;
#pragma omp for schedule(static) nowait
    for (int t = 0; t < tasks; ++t) {
      const int j0 = t * BF16_COL_TASK, j1 = j0 + BF16_COL_TASK < n ? j0 + BF16_COL_TASK : n;
      if (b0 == 0 && t + 1 < tasks) {  // the next task's weights, once
        const char* ahead = (const char*)(W + (int64_t)j1 * k);
        const int64_t bytes = (int64_t)BF16_COL_TASK * k * 2;
        for (int64_t o = 0; o < bytes && o < PREFETCH_BYTES * 4; o += 64)
          __builtin_prefetch(ahead + o, 0, 3);
      }
      for (int b = b0; b < b1;) {
        const int left = b1 - b, nr = left >= 4 ? 4 : left;
        const int nc = nr == 4 || nr == 3 ? 2 : 4;
        for (int j = j0; j < j1; j += nc) {
          const int cols = j1 - j < nc ? j1 - j : nc;
          float out[16];
          const uint16_t* wj = W + (int64_t)j * k;
          const float* xb = x + (int64_t)b * k;
          if (nr == 4 && cols == 2) bf16_tile(wj, k, xb, k, 4, 2, out);
          else if (nr == 3 && cols == 2) bf16_tile(wj, k, xb, k, 3, 2, out);
          else if (nr == 2 && cols == 4) bf16_tile(wj, k, xb, k, 2, 4, out);
          else if (nr == 1 && cols == 4) bf16_tile(wj, k, xb, k, 1, 4, out);
          else
            for (int r = 0; r < nr; ++r)
              for (int c = 0; c < cols; ++c)
                bf16_tile(wj + (int64_t)c * k, k, xb + (int64_t)r * k, k, 1, 1, out + r * 4 + c);
          for (int r = 0; r < nr; ++r)
            for (int c = 0; c < cols; ++c) {
              float s = out[r * 4 + c];
              if (L->bias) s += L->bias[j + c];
              float* o = y + (int64_t)(b + r) * n + j + c;
              *o = accumulate ? *o + s : s;
            }
        }
        b += nr;
      }
    }
  }
#pragma omp barrier
}
#define TW_BF16_ROWS 1
#endif

// The packed products' shared runs of panels (see packed_shared); declared for every build,
// as the decode step passes them on whether or not the packed products are compiled in.
typedef struct tw_run tw_run;

// A row's greedy choice so far, as torch.argmax makes it: the first index of the largest
// value, or of the first NaN where there is one. index starts past every column.
typedef struct {
  float value;
  int nan;
  int64_t index;
} tw_best;

#if defined(TW_PACKED_BUILT)
static void packed_rows(const tw_linear* L, const uint16_t* xb, void* y, int y_dtype, int B,
                     int accumulate, tw_run* runs);
#endif

// y[b, j] (+)= W[j] . x[b] for b < B: the output rows are shared among the threads (call
// inside a parallel region). With accumulate the result is added to y (a residual).
// TW_PACKED weights go to packed_rows (runs: see packed_shared), block weights to
// block_rows (qbuf: room for the quantised activations, shared by the threads).

static void linear_rows(const tw_linear* L, const float* x, const uint16_t* xb, float* y, int B,
                        int accumulate, tw_run* runs, void* qbuf) {
  if (has_blocks(L)) {
    block_rows(L, x, qbuf, y, B, accumulate);
    return;
  }
#if defined(TW_PACKED_BUILT)
  if (L->dtype == TW_PACKED) {
    packed_rows(L, xb, y, TW_F32, B, accumulate, runs);
    return;
  }
#endif
  (void)runs;
#if defined(TW_BF16_ROWS)
  if (L->dtype == TW_BF16) {
    bf16_rows(L, x, y, B, accumulate);
    return;
  }
#endif
  const int n = L->n, k = L->k;
  const int64_t row_bytes = L->dtype == TW_Q4 ? (int64_t)k / Q4_BLOCK * Q4_BYTES
                            : (int64_t)k * (L->dtype == TW_F32 ? 4 : L->dtype == TW_BF16 ? 2 : 1);
  float* xsum = NULL;  // Q4: each input row's sums over blocks (every thread its own)
  if (L->dtype == TW_Q4) {
    xsum = (float*)malloc(sizeof(float) * (size_t)B * (k / Q4_BLOCK));
    for (int b = 0; b < B; ++b)
      for (int g = 0; g < k / Q4_BLOCK; ++g) {
        float t = 0.f;
        for (int j = 0; j < Q4_BLOCK; ++j) t += x[(int64_t)b * k + g * Q4_BLOCK + j];
        xsum[b * (k / Q4_BLOCK) + g] = t;
      }
  }
  const int ahead_rows = (int)((PREFETCH_BYTES + row_bytes - 1) / row_bytes);
#pragma omp for schedule(static)
  for (int j = 0; j < n; ++j) {
    if (j + ahead_rows < n) {  // the hardware prefetcher alone leaves bandwidth unused
      const char* ahead = (const char*)L->w + ((int64_t)j + ahead_rows) * row_bytes;
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(ahead + o, 0, 3);
    }
    for (int b = 0; b < B; ++b) {
      const float* xr = x + (int64_t)b * k;
      float s;
      if (L->dtype == TW_BF16)
        s = dot_bf16((const uint16_t*)L->w + (int64_t)j * k, xr, xb + (int64_t)b * k, k);
      else if (L->dtype == TW_I8)
        s = dot_i8((const int8_t*)L->w + (int64_t)j * k, xr, k);
      else if (L->dtype == TW_Q4)
        s = dot_q4((const uint8_t*)L->w + j * row_bytes, xr, xsum + b * (k / Q4_BLOCK), k);
      else
        s = dot_f32((const float*)L->w + (int64_t)j * k, xr, k);
      if (L->scale) s *= L->scale[j];
      if (L->bias) s += L->bias[j];
      float* out = y + (int64_t)b * n + j;
      *out = accumulate ? *out + s : s;
    }
  }
  free(xsum);
}

static inline void round_row(const float* x, uint16_t* xb, int n) {
  row_from_f32(xb, TW_BF16, 0, n, x);
}

// sum of x[i]^2 (16 partial sums where the CPU has AVX-512: a strict left-to-right float
// sum cannot be vectorised by the compiler, and is 16x slower)
static inline float sum_squares(const float* x, int n) {
  float ss = 0.f;
  int i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

// out = x / sqrt(mean(x^2) + eps) * w over n values (float32)
// w NULL: no norm, x copied (OLMo 2 norms no sublayer's input)
static void rms_norm(const float* x, const float* w, float eps, float* out, int n) {
  if (!w) {
    for (int i = 0; i < n; ++i) out[i] = x[i];
    return;
  }
  const float r = 1.f / sqrtf(sum_squares(x, n) / n + eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// rms_norm, plus the result rounded to bfloat16 for the BF16 products
static void rms_norm_row(const float* x, const float* w, float eps, float* out, uint16_t* outb,
                         int n) {
  rms_norm(x, w, eps, out, n);
  round_row(out, outb, n);
}

