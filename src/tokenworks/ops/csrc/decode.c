// CPU decode kernels in plain C (built with the system compiler on first use, loaded with
// ctypes; see ops/ckernels.py).
//
// Decode reads every weight once per step while doing little arithmetic with it, so its
// cost on a CPU is bytes moved plus, in eager torch, a fixed cost for each of the ~600
// small ops a step launches. `tw_llama_decode` runs a whole Llama-family decode step (the
// embedding, every layer, the final norm and the LM head) in one call and one OpenMP
// parallel region: no per-op dispatch, no intermediate tensors. The residual stream and
// all activations stay in float32; weights are float32, bfloat16 or int8 (one scale per
// output row); K and V live in the paged pool of engine/kv_cache.py (float32 or bfloat16),
// read through each sequence's block table.
//
// `tw_paged_attention` is the attention part alone, for the torch path's batched decode.
// `tw_amx_linear` multiplies bigger decode batches by bfloat16 weights on AMX tiles.
// `tw_prefill_attention` attends the prompt chunks of a batch, on AMX tiles where they run.
//
// Vector paths use AVX-512 (BF16 dot products where the CPU has them); every loop has a
// plain C fallback, so the file builds for any CPU the compiler targets.
#define _GNU_SOURCE  // syscall(), for the AMX permission
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TW_AMX_BUILT 1  // AMX tile products (see tw_amx_linear)
#endif
#if defined(__AVX512BF16__)
#define TW_PACKED_BUILT 1  // packed products (tw_amx_linear): on tiles or vector dot products
#endif

enum { TW_F32 = 0, TW_BF16 = 1, TW_I8 = 2, TW_Q4 = 3, TW_AMX = 4, TW_AMX_GLU = 5 };
// TW_AMX: see tw_amx_pack; TW_AMX_GLU: a gate_up weight packed for TW_GLU (see panel_out)

// TW_Q4 weights: each row is K/32 blocks of 20 bytes, the layout of GGUF's Q4_1 with
// bfloat16 in place of float16: scale d and minimum m, then 16 bytes whose low nibbles are
// the block's elements 0-15 and high nibbles elements 16-31; a weight is q * d + m.
#define Q4_BLOCK 32
#define Q4_BYTES 20

static inline float bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } v = {(uint32_t)h << 16};
  return v.f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  union { float f; uint32_t u; } v = {f};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  // NaN
  v.u += 0x7fffu + ((v.u >> 16) & 1u);
  return (uint16_t)(v.u >> 16);
}

// One row of n values, any supported dtype, to float32.
static inline void row_to_f32(const void* base, int dtype, int64_t row, int n, float* out) {
  if (dtype == TW_F32) {
    memcpy(out, (const float*)base + row * n, sizeof(float) * n);
    return;
  }
  const uint16_t* r = (const uint16_t*)base + row * n;
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)(r + i));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) out[i] = bf16_to_f32(r[i]);
}

static inline void row_from_f32(void* base, int dtype, int64_t row, int n, const float* in) {
  if (dtype == TW_F32) {
    memcpy((float*)base + row * n, in, sizeof(float) * n);
    return;
  }
  uint16_t* r = (uint16_t*)base + row * n;
  int i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)  // round to nearest even, as f32_to_bf16
    _mm256_storeu_si256((__m256i*)(r + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
#endif
  for (; i < n; ++i) r[i] = f32_to_bf16(in[i]);
}

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

// One linear layer's weights: w [n, k] of `dtype`; scale [n] (int8 only) and bias [n] may
// be NULL.
typedef struct {
  const void* w;
  const float* scale;
  const float* bias;
  int dtype;
  int n, k;
} tw_linear;

// Weight rows are requested about this many bytes ahead of the one being multiplied: a
// decode step streams every weight once, and a core alone keeps too few reads in flight.
#define PREFETCH_BYTES 4096

// The packed products' shared runs of panels (see amx_shared); declared for every build,
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
static void amx_rows(const tw_linear* L, const uint16_t* xb, void* y, int y_dtype, int B,
                     int accumulate, tw_run* runs);
#endif

// y[b, j] (+)= W[j] . x[b] for b < B: the output rows are shared among the threads (call
// inside a parallel region). With accumulate the result is added to y (a residual).
// TW_AMX weights go to amx_rows (runs: see amx_shared).

static void linear_rows(const tw_linear* L, const float* x, const uint16_t* xb, float* y, int B,
                        int accumulate, tw_run* runs) {
#if defined(TW_PACKED_BUILT)
  if (L->dtype == TW_AMX) {
    amx_rows(L, xb, y, TW_F32, B, accumulate, runs);
    return;
  }
#endif
  (void)runs;
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
static void rms_norm(const float* x, const float* w, float eps, float* out, int n) {
  const float r = 1.f / sqrtf(sum_squares(x, n) / n + eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// rms_norm, plus the result rounded to bfloat16 for the BF16 products
static void rms_norm_row(const float* x, const float* w, float eps, float* out, uint16_t* outb,
                         int n) {
  rms_norm(x, w, eps, out, n);
  round_row(out, outb, n);
}

// ---------------------------------------------------------------- paged attention ---

typedef struct {
  const void* k_pool;  // [slots, kv_heads, head_dim]
  const void* v_pool;
  int kv_dtype;
  const int64_t* block_tables;  // [B, max_blocks]
  int max_blocks;
  const int64_t* context_lens;  // [B]: keys each query attends to, its own included
  int block_size;
  int window;  // 0: none; else attend to the last `window` keys only
} tw_kv;

#if defined(__AVX512F__)
// e^x for 16 lanes: 2^(x log2 e) split into an integer power (applied by scalef) and a
// fraction whose 2^f comes from a degree-6 polynomial (relative error about 2e-7).
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 load16(const void* base, int dtype, int64_t offset) {
  if (dtype == TW_F32) return _mm512_loadu_ps((const float*)base + offset);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + offset));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// softmax over n scores in place (float32)
static void softmax(float* s, int64_t n) {
  float mx = -INFINITY, sum = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  mx = _mm512_reduce_max_ps(m);
#endif
  for (; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  j = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(mx)));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) {
    s[j] = expf(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) s[j] *= inv;
}

#if defined(__AVX512F__)
// silu(g) * u for 16 lanes, silu(g) = g / (1 + e^-g): the reciprocal from rcp14 and one
// Newton step (relative error about 1e-7, a quarter of the cost of a division). e^-g is
// capped at e^88 so that 1 + e^-g stays finite and g * (1 / that) goes to 0, not NaN.
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.f)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, r), u);
}

// 16 float32 lanes stored as float32 or bfloat16 (rounded to nearest even)
static inline void store16(void* base, int dtype, int64_t offset, __m512 v) {
  if (dtype == TW_F32) {
    _mm512_storeu_ps((float*)base + offset, v);
    return;
  }
#if defined(__AVX512BF16__)
  _mm256_storeu_si256((__m256i*)((uint16_t*)base + offset), (__m256i)_mm512_cvtneps_pbh(v));
#else
  float tmp[16];
  _mm512_storeu_ps(tmp, v);
  for (int i = 0; i < 16; ++i) ((uint16_t*)base)[offset + i] = f32_to_bf16(tmp[i]);
#endif
}
#endif

// out = silu(g) * u over n values.
static void silu_mul(const float* g, const float* u, float* out, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

// The pool slot of each context position first..L-1: the block table walked once, with
// no division per key.
static int64_t* context_slots(const tw_kv* kv, int b, int64_t first, int64_t L) {
  const int64_t* table = kv->block_tables + (int64_t)b * kv->max_blocks;
  const int bs = kv->block_size;
  int64_t* slots = (int64_t*)malloc(sizeof(int64_t) * (size_t)(L - first + 1));
  int64_t block = first / bs, off = first % bs;
  for (int64_t l = first; l < L; ++l) {
    slots[l - first] = table[block] * bs + off;
    if (++off == bs) {
      off = 0;
      ++block;
    }
  }
  return slots;
}

// Keys are requested this many positions ahead: blocks lie anywhere in the pool, so the
// hardware prefetcher loses the stream at every block boundary. The first rows of each pass
// (a head's keys, then its values) are asked for near the end of the pass before it, so
// that no pass starts by waiting on memory.
#define PREFETCH_KEYS 16

static inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)p + o, 0, 3);
}

static inline void prefetch_l2(const void* p, int64_t bytes) {  // (prefetcht2)
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)p + o, 0, 1);
}

// The next sequence's K and V, asked for into L2 a slice at a time while this one
// computes. Asked for only PREFETCH_KEYS keys ahead, the reads of a sequence's scattered
// blocks left a core waiting on memory about as long as it computed (the two did not
// overlap); spread over the whole of the sequence before, they arrive in the background.
// A sequence's K and V for one layer are about 150 KB at 200 keys, so L2 holds them. In
// a standalone copy of a 64-row decode step's attention (30 layers, 192 keys, blocks
// scattered, 2 threads, AMD EPYC), interleaved A/B: 14.8 against 23.6 ms and 21.2
// against 30.8 (the machine's speed drifted between the two runs); the same with
// prefetcht0 into L1: 23.1 against 25.0. Results are bit-identical (prefetches are hints).
typedef struct {
  const char* k;          // the pools
  const char* v;
  const int64_t* slots;   // the next sequence's slots
  int64_t n, at, per;     // how many; the next to ask for; how many a call
  int64_t row_bytes;      // one slot's K (or V) for every KV head
} tw_ahead;

static inline void ahead_step(tw_ahead* a) {
  if (!a) return;
  for (int64_t e = a->at + a->per; a->at < e && a->at < a->n; ++a->at) {
    prefetch_l2(a->k + a->slots[a->at] * a->row_bytes, a->row_bytes);
    prefetch_l2(a->v + a->slots[a->at] * a->row_bytes, a->row_bytes);
  }
}

#if defined(__AVX512BF16__)
// Two adjacent bfloat16 values as one 32-bit lane repeated 16 times (a dot product pair).
static inline __m512bh pair_of(const uint16_t* x) {
  int32_t w;
  memcpy(&w, x, 4);
  return (__m512bh)_mm512_set1_epi32(w);
}

// v[j] holds 16 partial sums of key j's score; returns the 16 scores (lane j = key j).
// A transpose-and-add tree: 45 instructions for 16 keys, against about 8 a key for
// separate horizontal sums.
static inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes of w[i]: [k2i, k2i+1, k2i, k2i+1]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // lanes of x[i]: [k4i .. k4i+3]
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes 0-1: keys 8i..8i+3, lanes 2-3: 8i+4..8i+7
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of one KV head's G query heads over n keys, 16 keys at a time: BF16 dot products
// (the query rounded to bfloat16, as the torch path holds it) and one sum16 per 16 keys.
// qb [G, D] bfloat16, already scaled; rows of key j at kp + (slots[j] * kv_heads + h) * D,
// and of its value at vp (bfloat16 too) + the same.
static void scores_bf16(const uint16_t* kp, const uint16_t* vp, const int64_t* slots,
                        int64_t n, int kv_heads, int h, int G, int D, const uint16_t* qb,
                        float* scores, tw_ahead* ahead) {
  for (int64_t l = 0; l < n; l += 16) {
    const int cnt = n - l < 16 ? (int)(n - l) : 16;
    ahead_step(ahead);
    if (l + 16 >= n)  // the last keys: the value pass's first rows
      for (int64_t j = 0; j < PREFETCH_KEYS && j < n; ++j)
        prefetch_span(vp + (slots[j] * kv_heads + h) * D, D * 2);
    const uint16_t* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = kp + (slots[l + (j < cnt ? j : 0)] * kv_heads + h) * D;
    for (int64_t j = l + PREFETCH_KEYS; j < l + 2 * PREFETCH_KEYS && j < n; ++j)
      prefetch_span(kp + (slots[j] * kv_heads + h) * D, D * 2);
    if (D == 64 && G <= 4) {  // each key row loaded once for its G query heads
      __m512 v[4][16];
      __m512bh qv[4][2];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * c);
      for (int j = 0; j < 16; ++j) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(rows[j]);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(rows[j] + 32);
        for (int g = 0; g < G; ++g)
          v[g][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0),
                                     qv[g][1], k1);
      }
      for (int g = 0; g < G; ++g) {
        float sc[16];
        _mm512_storeu_ps(sc, sum16(v[g]));
        memcpy(scores + g * n + l, sc, sizeof(float) * cnt);
      }
      continue;
    }
    for (int g = 0; g < G; ++g) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 32)
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qb + g * D + c),
                               (__m512bh)_mm512_loadu_si512(rows[j] + c));
        v[j] = a;
      }
      float sc[16];
      _mm512_storeu_ps(sc, sum16(v));
      memcpy(scores + g * n + l, sc, sizeof(float) * cnt);
    }
  }
}
#endif

#if defined(__AVX512F__)
// The weighted sum of values for head_dim 64 and G query heads at once (G a constant at
// each call site, so the G x 4 sums stay in registers): each value row is read once.
// next_k: the next head's keys (k_pool + its offset in a slot), whose first rows are asked
// for during the last values; NULL for none.
static inline __attribute__((always_inline)) void weighted_values64(
    const void* v_pool, int kv_dtype, const int64_t* slots, int64_t n, int kv_heads, int h,
    const float* scores, int G, float* out, const char* next_k, tw_ahead* ahead) {
  __m512 acc[4][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  const int64_t esz = kv_dtype == TW_F32 ? 4 : 2;
  for (int64_t l = 0; l < n; ++l) {
    const int64_t r = (slots[l] * kv_heads + h) * 64;
    if (l % 16 == 0) ahead_step(ahead);
    if (l + PREFETCH_KEYS < n)
      prefetch_span((const char*)v_pool + (slots[l + PREFETCH_KEYS] * kv_heads + h) * 64 * esz,
                    64 * esz);
    else if (next_k && l + PREFETCH_KEYS - n < n)
      prefetch_span(next_k + slots[l + PREFETCH_KEYS - n] * kv_heads * 64 * esz, 64 * esz);
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = load16(v_pool, kv_dtype, r + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * n + l]);
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * 64 + 16 * c, acc[g][c]);
}
#endif

// The pool slots of the keys sequence b attends to (its window's, where it has one): n.
static int64_t* window_slots(const tw_kv* kv, int b, int64_t* n) {
  const int64_t L = kv->context_lens[b];
  const int64_t first = kv->window > 0 && L > kv->window ? L - kv->window : 0;
  *n = L - first;
  return context_slots(kv, b, first, L);
}

// Sequence b's query heads of KV heads [h0, h1): q [(h1 - h0) * G, D] (float32, not yet
// scaled) -> out, same shape. For each KV head: scores over the whole context, softmax,
// then the weighted sum of values. Each key and value row is read once for all the query
// heads that share it (GQA). next_b >= 0: the sequence to ask for while this one computes
// (tw_ahead).
static void attend(const tw_kv* kv, int b, int h0, int h1, int kv_heads, int G, int D,
                   float scale, const float* q, float* out, int next_b) {
  int64_t n;
  const int64_t esz = kv->kv_dtype == TW_F32 ? 4 : 2;
  int64_t* slots = window_slots(kv, b, &n);
  tw_ahead ahead, *ap = NULL;
#if defined(__AVX512BF16__)
  // the next sequence's K and V, spread over this one's passes: only where both passes
  // are the vector ones that ask for them (bfloat16, head_dim 64, up to 4 query heads)
  if (next_b >= 0 && kv->kv_dtype == TW_BF16 && D == 64 && G <= 4) {
    ahead.k = (const char*)kv->k_pool;
    ahead.v = (const char*)kv->v_pool;
    ahead.slots = window_slots(kv, next_b, &ahead.n);
    ahead.at = 0;
    const int64_t calls = 2 * (int64_t)(h1 - h0) * ((n + 15) / 16);  // ahead_steps to come
    ahead.per = calls > 0 ? ahead.n / calls + 1 : ahead.n;
    ahead.row_bytes = (int64_t)kv_heads * D * esz;
    ap = &ahead;
  }
#else
  (void)next_b;
#endif
  for (int64_t j = 0; j < PREFETCH_KEYS && j < n; ++j)  // the first head's first keys
    prefetch_span((const char*)kv->k_pool + (slots[j] * kv_heads + h0) * D * esz, D * esz);
  float* scores = (float*)malloc(sizeof(float) * (size_t)(G * n));
  float* qs = (float*)malloc(sizeof(float) * (size_t)(G * D));
  uint16_t* qb = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(G * D));
  float row[256];
  for (int h = h0; h < h1; ++h) {
    const float* qh = q + (int64_t)(h - h0) * G * D;
    float* oh = out + (int64_t)(h - h0) * G * D;
    for (int i = 0; i < G * D; ++i) qs[i] = qh[i] * scale;
    int done = 0;
#if defined(__AVX512BF16__)
    if (kv->kv_dtype == TW_BF16 && D % 32 == 0) {
      for (int i = 0; i < G * D; ++i) qb[i] = f32_to_bf16(qs[i]);
      scores_bf16((const uint16_t*)kv->k_pool, (const uint16_t*)kv->v_pool, slots, n,
                  kv_heads, h, G, D, qb, scores, ap);
      done = 1;
    }
#endif
    if (!done)
      for (int64_t l = 0; l < n; ++l) {
        row_to_f32(kv->k_pool, kv->kv_dtype, slots[l] * kv_heads + h, D, row);
        for (int g = 0; g < G; ++g) scores[g * n + l] = dot_f32(qs + g * D, row, D);
      }
    for (int g = 0; g < G; ++g) softmax(scores + g * n, n);
#if defined(__AVX512F__)
    if (D == 64 && G <= 4) {
      const void* vp = kv->v_pool;
      const int dt = kv->kv_dtype;
      const char* nk = h + 1 < h1 ? (const char*)kv->k_pool + (int64_t)(h + 1) * D * esz : NULL;
      if (G == 1) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 1, oh, nk, ap);
      if (G == 2) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 2, oh, nk, ap);
      if (G == 3) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 3, oh, nk, ap);
      if (G == 4) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 4, oh, nk, ap);
      continue;
    }
    if (D % 16 == 0) {  // one query head at a time, its sums in registers
      const int C = D / 16;
      for (int g = 0; g < G; ++g) {
        __m512 acc[16];
        for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
        const float* p = scores + g * n;
        for (int64_t l = 0; l < n; ++l) {
          const int64_t r = (slots[l] * kv_heads + h) * D;
          if (g == 0 && l + PREFETCH_KEYS < n)
            prefetch_span((const char*)kv->v_pool + (slots[l + PREFETCH_KEYS] * kv_heads + h) * D * esz,
                          D * esz);
          const __m512 w = _mm512_set1_ps(p[l]);
          for (int c = 0; c < C; ++c)
            acc[c] = _mm512_fmadd_ps(w, load16(kv->v_pool, kv->kv_dtype, r + 16 * c), acc[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(oh + g * D + 16 * c, acc[c]);
      }
      continue;
    }
#endif
    for (int i = 0; i < G * D; ++i) oh[i] = 0.f;
    for (int64_t l = 0; l < n; ++l) {
      row_to_f32(kv->v_pool, kv->kv_dtype, slots[l] * kv_heads + h, D, row);
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * n + l];
        float* o = oh + g * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) o[d] += p * row[d];
      }
    }
  }
  free(qb);
  free(qs);
  free(scores);
  free(slots);
  if (ap) free((void*)ahead.slots);
}

// The attention work of a step: B sequences, each split by KV heads only when there are
// fewer sequences than threads (else a sequence is one task, its rows read in order, and
// its thread asks for the K and V of sequence b + threads while it computes b: tasks are
// handed out in order, so that is most often the one it takes next).
static void attention_tasks(const tw_kv* kv, const float* q, int64_t q_stride, float* out,
                            int64_t out_stride, int B, int H, int kv_heads, int D, float scale,
                            int threads) {
  const int G = H / kv_heads;
  const int split = B < threads ? kv_heads : 1;
#pragma omp for schedule(dynamic)
  for (int i = 0; i < B * split; ++i) {
    const int b = i / split, part = i % split;
    const int h0 = part * kv_heads / split, h1 = (part + 1) * kv_heads / split;
    attend(kv, b, h0, h1, kv_heads, G, D, scale, q + b * q_stride + (int64_t)h0 * G * D,
           out + b * out_stride + (int64_t)h0 * G * D,
           split == 1 && b + threads < B ? b + threads : -1);
  }
}

// q [B, H, D] float32 -> out [B, H, D] float32, one decode query per sequence.
void tw_paged_attention(const tw_kv* kv, const float* q, float* out, int B, int H, int kv_heads,
                        int D, float scale, int threads) {
  if (B <= 0) return;
#pragma omp parallel num_threads(threads)
  attention_tasks(kv, q, (int64_t)H * D, out, (int64_t)H * D, B, H, kv_heads, D, scale, threads);
}

#if defined(TW_PACKED_BUILT)
// This thread's number and the size of its team (0 and 1 outside a parallel region).
static void team(int* me, int* nt) {
  *me = 0;
  *nt = 1;
#ifdef _OPENMP
  *me = omp_get_thread_num();
  *nt = omp_get_num_threads();
#endif
}

// Thread me's share of a product's panels, of a team of nt.
static void thread_panels(int panels, int me, int nt, int* p0, int* p1) {
  *p0 = (int)((int64_t)panels * me / nt);
  *p1 = (int)((int64_t)panels * (me + 1) / nt);
}
#endif

// ------------------------------------------------------------- packed matrix products ---
// Decode batches of tens of rows multiply every weight once per step: the product streams
// the weights from memory and does 2 * rows flops per weight read. The weights are packed
// once so that each thread reads one contiguous run of memory, asked for ahead into the
// caches next to the core (64 KB ahead on tiles, the next panel in vec_panels). On CPUs with AMX, tile products (TDPBF16PS: [16 x 32] x
// [32 x 16] bfloat16 pairs into [16 x 16] float32) do the arithmetic with room to spare;
// elsewhere (AVX-512 BF16 without AMX, such as AMD's Zen 4) AVX-512 BF16 dot products read
// the same layout (vec_panels).
//
// Packed layout (tw_amx_pack): per panel of 32 output columns (n0 = 32p), per step of 32
// inputs (k0 = 32s), two tiles for columns n0..n0+15 and n0+16..n0+31, each in the pair
// ("VNNI") layout the tile product reads: tile[i][c][e] = w[n0 + c][k0 + 2i + e].
// A panel is K * 64 contiguous bytes; N and K must be multiples of 32.

// 1 once Linux has granted this process the AMX tile state (tw_amx_init): the packed
// products then run on tiles, else (0) as vector dot products.
static int tw_tiles = 0;

#if defined(TW_AMX_BUILT)
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tw_tilecfg;

static void tiles_16x64(void) {  // all 8 tiles 16 rows of 64 bytes
  tw_tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes only: without this barrier
  // the other stores to cfg may be moved past it (ldtilecfg then faults on garbage).
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

#endif

#if defined(TW_PACKED_BUILT)
// a and b, folded as torch.argmax would choose between them (whatever their order).
static inline void best_merge(tw_best* a, const tw_best* b) {
  if (a->nan || b->nan) {
    if (b->nan && (!a->nan || b->index < a->index)) *a = *b;
    return;
  }
  if (b->value > a->value || (b->value == a->value && b->index < a->index)) *a = *b;
}

// amx_panels' y_dtype for "no output, only each row's tw_best": a decode step whose rows
// all sample greedily needs no logits, which for 64 rows are 12.6 MB written and read
// back by tw_argmax_rows.
#define TW_ARGMAX 100

// amx_panels' y_dtype for a gate_up product that ends in SwiGLU: the weight [2I, K] (gate
// rows, then up rows) was packed with its rows reordered so that each panel holds gate
// columns 16p..16p+15, then up columns 16p..16p+15 (ckernels.amx_pack(glu=True)); y is
// bfloat16 [M, I], columns 16p..16p+15 of each row silu(gate) * up, from the float32 sums
// and rounded once. The [M, 2I] gate and up sums are never written: for 64 rows they were
// 786 KB written and read back, and a pass over them, each layer.
#define TW_GLU 101

// Folds columns col0..col0+31 of a row (v, float32) into its choice b, in any order of
// panels (a thread may take panels from another's run: see amx_shared).
static inline void best_of_32(tw_best* b, const float* v, int64_t col0) {
  const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
  const __mmask16 nlo = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q);
  const __mmask16 nhi = _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
  tw_best here = {0.f, 0, 0};
  if (nlo | nhi) {
    here.nan = 1;
    here.index = col0 + (nlo ? __builtin_ctz(nlo) : 16 + __builtin_ctz(nhi));
  } else {
    here.value = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
    if (b->nan || here.value < b->value) return;  // the common case: nothing to do
    const __m512 mm = _mm512_set1_ps(here.value);
    const __mmask16 elo = _mm512_cmp_ps_mask(lo, mm, _CMP_EQ_OQ);
    const __mmask16 ehi = _mm512_cmp_ps_mask(hi, mm, _CMP_EQ_OQ);
    here.index = col0 + (elo ? __builtin_ctz(elo) : 16 + __builtin_ctz(ehi));
  }
  best_merge(b, &here);
}

// Rows mb.. (rows of them) of panel p's product, c [rows][32] float32, into y: + bias,
// y (float32) += it with accumulate, or stored in y_dtype; y_dtype TW_ARGMAX: y is
// tw_best [M], this thread's choices over the panels it multiplied, and no product is
// written; TW_GLU: y is SwiGLU's output (see there).
static void panel_out(float (*c)[32], int rows, int mb, int p, int N, const float* bias, void* y,
                      int y_dtype, int accumulate) {
  if (y_dtype == TW_GLU) {
    for (int r = 0; r < rows; ++r) {
      __m512 g = _mm512_loadu_ps(c[r]), u = _mm512_loadu_ps(c[r] + 16);
      if (bias) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(bias + 32 * p));
        u = _mm512_add_ps(u, _mm512_loadu_ps(bias + 32 * p + 16));
      }
      store16(y, TW_BF16, (int64_t)(mb + r) * (N / 2) + 16 * p, silu_mul16(g, u));
    }
    return;
  }
  if (y_dtype == TW_ARGMAX) {
    for (int r = 0; r < rows; ++r) {
      if (bias)
        for (int j = 0; j < 32; ++j) c[r][j] += bias[32 * p + j];
      best_of_32((tw_best*)y + mb + r, c[r], 32 * p);
    }
    return;
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t o = (int64_t)(mb + r) * N + 32 * p + 16 * h;
      __m512 v = _mm512_loadu_ps(c[r] + 16 * h);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 32 * p + 16 * h));
      if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps((const float*)y + o));
      store16(y, y_dtype, o, v);
    }
}

// Panels this many at a time: each group's panels (up to 2 * K * 64 bytes, in L2 once
// read) are multiplied by every 32 rows before the next group, so the rows' tiles are
// read from near caches for as many weights as possible.
#define GROUP_PANELS 2

#endif

#if defined(TW_AMX_BUILT)
// x [M, K] bfloat16 in tile order: tile (t, s) holds rows 16t..16t+15 by inputs
// 32s..32s+31 as 1 KB of memory, rows past M zero, M rounded up to 32. A tile load then
// reads 16 adjacent lines instead of 16 rows K * 2 bytes apart. In interleaved A/B runs of
// a 64-row decode step (SmolLM2-135M, 2 threads) that took 2.3 to 3.3 ms off products of
// 30 to 35 ms, the copy included, and was level (+-0.5 ms) when they ran in 17. Every
// thread packs its own copy (tens to hundreds of KB, from cache) and frees it after.
static uint16_t* pack_tiles(const uint16_t* x, int M, int K) {
  const int steps = K / 32, tiles = (M + 31) / 32 * 2;
  uint16_t* a = (uint16_t*)aligned_alloc(64, (size_t)tiles * 16 * K * sizeof(uint16_t));
  for (int t = 0; t < tiles; ++t)
    for (int s = 0; s < steps; ++s)
      for (int r = 0; r < 16; ++r) {
        uint16_t* dst = a + ((int64_t)t * steps + s) * 512 + r * 32;
        const int row = 16 * t + r;
        if (row < M)
          memcpy(dst, x + (int64_t)row * K + 32 * s, 64);
        else
          memset(dst, 0, 64);
      }
  return a;
}

// Panels [p0, p1) of y [M, N] (+)= x [M, K] @ w.T (+ bias), x bfloat16 in pack_tiles'
// order (xt). 32 rows at a time, 4 accumulator tiles: rows 0-15 and 16-31 by columns 0-15
// and 16-31. accumulate: y (float32) += the product. y_dtype TW_ARGMAX: y is tw_best [M],
// this thread's choices over the panels it multiplied, and no product is written.
static void amx_panels(const uint16_t* xt, int M, int K, const uint16_t* wp, int N, int p0,
                       int p1, const float* bias, void* y, int y_dtype, int accumulate) {
  const int steps = K / 32;
  const int64_t panel_elems = (int64_t)K * 32;
  float c[32][32];
  for (int g0 = p0; g0 < p1; g0 += GROUP_PANELS) {
    const int g1 = g0 + GROUP_PANELS < p1 ? g0 + GROUP_PANELS : p1;
    for (int mb = 0; mb < M; mb += 32) {
      const uint16_t* xa0 = xt + (int64_t)(mb / 16) * steps * 512;  // rows mb..mb+15
      const uint16_t* xa1 = xa0 + (int64_t)steps * 512;              // rows mb+16..mb+31
      for (int p = g0; p < g1; ++p) {
        const uint16_t* panel = wp + p * panel_elems;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int s = 0; s < steps; ++s) {
          if (mb == 0)  // 64 KB ahead in this thread's stream of panels, into L2
            prefetch_l2(panel + (int64_t)(s + 32) * 1024, 2048);
          _tile_loadd(4, xa0 + (int64_t)s * 512, 64);
          _tile_loadd(5, xa1 + (int64_t)s * 512, 64);
          _tile_loadd(6, panel + s * 1024, 64);
          _tile_loadd(7, panel + s * 1024 + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, &c[0][0], 128);
        _tile_stored(1, &c[0][16], 128);
        _tile_stored(2, &c[16][0], 128);
        _tile_stored(3, &c[16][16], 128);
        panel_out(c, M - mb < 32 ? M - mb : 32, mb, p, N, bias, y, y_dtype, accumulate);
      }
    }
  }
}

#endif

#if defined(TW_PACKED_BUILT)
// Rows of sums vec_panels keeps in registers: VEC_ROWS rows by a panel's 32 columns.
#define VEC_ROWS 8

// One packed step (32 inputs) of a panel for `rows` rows of x (xs: their first input of
// the step, rows K apart) into acc [rows][2] (columns 0-15, 16-31).
static inline __attribute__((always_inline)) void vec_step(const uint16_t* tile,
                                                           const uint16_t* xs, int K, int rows,
                                                           __m512 (*acc)[2]) {
  for (int i = 0; i < 16; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(tile + i * 32);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(tile + 512 + i * 32);
    for (int r = 0; r < rows; ++r) {
      const __m512bh xv = pair_of(xs + (int64_t)r * K + 2 * i);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  }
}

// amx_panels without tiles: the same panels, x plain [M, K] bfloat16. A row of a packed
// tile holds 16 columns' pair of weights (k, k + 1), so one 32-bit broadcast of x's pair
// against it adds to 16 columns' sums: per pair of inputs, 2 weight rows, VEC_ROWS
// broadcasts and 2 * VEC_ROWS dot products. A panel at a time, its rows VEC_ROWS at a
// time: the panel (K * 64 bytes) comes from L2 for each block of rows after the first.
//
// The weights come from memory (a model's are bigger than L3), and the next panel is
// asked for into L1 while this one computes, a slice with each step of each block of rows,
// so that it has all arrived when its turn comes and the requests never bunch up. Asking
// for 64 KB ahead in one burst during the first block of rows only, as before, a 64-row
// product of SmolLM2-135M's widths with the weights in memory ran at 353 to 391 GFLOP/s
// on 2 threads of this AMD EPYC; spread, at 390 to 427 (medians of 9 interleaved runs of
// 30 products; with the weights in cache, 456). (oneDNN's products of the same shapes:
// 293 to 366.)
static void vec_panels(const uint16_t* x, int M, int K, const uint16_t* wp, int N, int p0, int p1,
                       const float* bias, void* y, int y_dtype, int accumulate) {
  if (M <= 0 || K <= 0) return;  // no rows: nothing to sum (and no steps to share prefetch)
  const int steps = K / 32;
  const int64_t panel_bytes = (int64_t)K * 64;
  const int64_t calls = (int64_t)((M + VEC_ROWS - 1) / VEC_ROWS) * steps;  // a panel's steps
  const int64_t per = ((panel_bytes + calls - 1) / calls + 63) / 64 * 64;  // bytes asked a step
  const char* end = (const char*)(wp + (int64_t)N * K);
  float c[VEC_ROWS][32];
  for (int p = p0; p < p1; ++p) {
    const uint16_t* panel = wp + (int64_t)p * K * 32;
    const char* ask = (const char*)panel + panel_bytes;  // the next panel's next line
    const char* stop = ask + panel_bytes < end ? ask + panel_bytes : end;
    for (int mb = 0; mb < M; mb += VEC_ROWS) {
      const int rows = M - mb < VEC_ROWS ? M - mb : VEC_ROWS;
      __m512 acc[VEC_ROWS][2];
      for (int r = 0; r < VEC_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int s = 0; s < steps; ++s) {
        for (const char* e = ask + per < stop ? ask + per : stop; ask < e; ask += 64)
          __builtin_prefetch(ask, 0, 3);
        const uint16_t* tile = panel + s * 1024;
        const uint16_t* xs = x + (int64_t)mb * K + 32 * s;
        if (rows == VEC_ROWS)  // the common case: a constant count, unrolled
          vec_step(tile, xs, K, VEC_ROWS, acc);
        else
          vec_step(tile, xs, K, rows, acc);
      }
      for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(c[r], acc[r][0]);
        _mm512_storeu_ps(c[r] + 16, acc[r][1]);
      }
      panel_out(c, rows, mb, p, N, bias, y, y_dtype, accumulate);
    }
  }
}

// Sharing a product's panels among the threads of a parallel region. Each thread owns a
// contiguous run of panels (thread_panels), streamed from the front so that its weights
// come as one prefetched run; one that is done takes panels from the back of the others'
// runs. On these shared machines one core can run at half the speed of the other for
// seconds; with fixed halves the fast thread waited at the barrier for up to 10 ms of a
// 54 ms decode step. A run is one word, next << 32 | end, changed by compare-and-swap
// only, so owner and thief never take the same panels. runs: one per thread, each on its
// own cache line, made by new_runs (all empty); every thread sets its own before taking
// from it, and a thief that looks before the owner has finds it empty (a product ends with
// every run empty, and the next starts after a barrier).
struct tw_run {
  _Atomic uint64_t word;
  char pad[56];
};

static tw_run* new_runs(int threads) {
  tw_run* runs = (tw_run*)aligned_alloc(64, sizeof(tw_run) * (size_t)threads);
  for (int t = 0; t < threads; ++t) atomic_init(&runs[t].word, 0);
  return runs;
}

// Takes up to `want` panels from run r, from the front (owner) or the back: [*a, *b).
static int take_panels(tw_run* r, int front, int want, int* a, int* b) {
  uint64_t w = atomic_load(&r->word);
  for (;;) {
    const int next = (int)(w >> 32), end = (int)(w & 0xFFFFFFFFu);
    if (next >= end) return 0;
    const int n = end - next < want ? end - next : want;
    const uint64_t to = front ? (uint64_t)(next + n) << 32 | (uint32_t)end
                              : (uint64_t)next << 32 | (uint32_t)(end - n);
    if (atomic_compare_exchange_weak(&r->word, &w, to)) {
      *a = front ? next : end - n;
      *b = front ? next + n : end;
      return 1;
    }
  }
}

// The product over all N / 32 panels, shared as above (on tiles where tw_tiles, which the
// caller has then configured, else vec_panels); call from every thread of the parallel
// region (which then needs a barrier before reading y).
static void amx_shared(const uint16_t* x, int M, int K, const uint16_t* wp, int N,
                       const float* bias, void* y, int y_dtype, int accumulate, tw_run* runs) {
  int me, nt, p0, p1, a, b;
  team(&me, &nt);
  thread_panels(N / 32, me, nt, &p0, &p1);
  atomic_store(&runs[me].word, (uint64_t)p0 << 32 | (uint32_t)p1);
  const uint16_t* xp = x;  // x as the panels read it: in tile order for tiles
#if defined(TW_AMX_BUILT)
  uint16_t* xt = tw_tiles ? pack_tiles(x, M, K) : NULL;
  if (xt) xp = xt;
#endif
  for (int v = 0; v < nt; ++v) {  // its own run from the front, then the others' backs
    tw_run* r = &runs[(me + v) % nt];
    while (take_panels(r, v == 0, GROUP_PANELS, &a, &b)) {
#if defined(TW_AMX_BUILT)
      if (tw_tiles) {
        amx_panels(xp, M, K, wp, N, a, b, bias, y, y_dtype, accumulate);
        continue;
      }
#endif
      vec_panels(xp, M, K, wp, N, a, b, bias, y, y_dtype, accumulate);
    }
  }
#if defined(TW_AMX_BUILT)
  free(xt);
#endif
}
#endif

static int tw_tiles_granted = 0;

// 1 where the AMX tiles can run: compiled in, and Linux grants this process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as oneDNN asks too).
int tw_amx_init(void) {
#if defined(TW_AMX_BUILT) && defined(SYS_arch_prctl)
  if (!tw_tiles_granted) tw_tiles_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
  tw_tiles = tw_tiles_granted;
  return tw_tiles;
}

// The packed products on tiles (on: where tw_amx_init granted them) or as vector dot
// products (0); returns which. For tests and measurements of the vector path on AMX CPUs.
int tw_use_tiles(int on) {
  tw_tiles = on && tw_tiles_granted;
  return tw_tiles;
}

// How the packed products run here: 2 on AMX tiles, 1 as AVX-512 BF16 dot products, 0 not
// at all (the library was built for a CPU without AVX-512 BF16). Call after tw_amx_init.
int tw_packed_kind(void) {
#if defined(TW_PACKED_BUILT)
  return tw_tiles ? 2 : 1;
#else
  return 0;
#endif
}

// w [N, K] bfloat16 -> out [N * K] in the packed layout above.
void tw_amx_pack(const uint16_t* w, int N, int K, uint16_t* out, int threads) {
  const int steps = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int p = 0; p < N / 32; ++p)
    for (int s = 0; s < steps; ++s)
      for (int t = 0; t < 2; ++t) {
        uint16_t* tile = out + (((int64_t)p * steps + s) * 2 + t) * 512;
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < 16; ++c)
            for (int e = 0; e < 2; ++e)
              tile[(i * 16 + c) * 2 + e] = w[(int64_t)(32 * p + 16 * t + c) * K + 32 * s + 2 * i + e];
      }
}

// y [M, N] = x [M, K] @ w.T (+ bias [N] float32), x bfloat16 [M, K], w packed by
// tw_amx_pack; y in y_dtype (float32, or bfloat16 rounded to nearest even). Threads take
// contiguous runs of panels. Returns 0, or -1 where the library has no packed products.
int tw_amx_linear(const uint16_t* x, int M, int K, const uint16_t* wp, int N, const float* bias,
                  void* y, int y_dtype, int threads) {
#if defined(TW_PACKED_BUILT)
  if (M <= 0 || N <= 0) return 0;  // an empty product (a prompt chunk that samples nothing)
  tw_run* runs = new_runs(threads);
#pragma omp parallel num_threads(threads)
  {
#if defined(TW_AMX_BUILT)
    if (tw_tiles) tiles_16x64();
#endif
    amx_shared(x, M, K, wp, N, bias, y, y_dtype, 0, runs);
#if defined(TW_AMX_BUILT)
    if (tw_tiles) _tile_release();
#endif
  }
  free(runs);
  return 0;
#else
  (void)x, (void)M, (void)K, (void)wp, (void)N, (void)bias, (void)y, (void)y_dtype, (void)threads;
  return -1;
#endif
}

#if defined(TW_PACKED_BUILT)
// linear_rows for packed weights, inside the decode step's parallel region: xb holds the
// input rows in bfloat16 (stride k); y in y_dtype (TW_F32, or TW_GLU for TW_AMX_GLU).
static void amx_rows(const tw_linear* L, const uint16_t* xb, void* y, int y_dtype, int B,
                     int accumulate, tw_run* runs) {
  amx_shared(xb, B, L->k, (const uint16_t*)L->w, L->n, L->bias, y, y_dtype, accumulate, runs);
#pragma omp barrier
}
#endif

// ---------------------------------------------------------------- the decode step ---

typedef struct {
  int hidden, n_heads, n_kv_heads, head_dim, intermediate, vocab;
  float eps, attn_scale;
} tw_dims;

typedef struct {
  const float* input_norm;  // [hidden] float32
  const float* post_norm;
  tw_linear qkv, o, gate_up, down;
  void* k_pool;  // this layer's pool, [slots, kv_heads, head_dim]
  void* v_pool;
} tw_layer;

typedef struct {
  const void* embed;  // [vocab, hidden]
  int embed_dtype;
  const float* final_norm;
  tw_linear head;
  const float* cos;  // [positions, head_dim] float32, each half repeated
  const float* sin;
} tw_model;

// Scratch memory for B rows, float32 unless said (the caller allocates it once per size).
typedef struct {
  float* h;       // [B, hidden]
  uint16_t* hb;   // [B, max(hidden, intermediate, q_size)] bfloat16 copies of inputs
  float* qkv;     // [B, q_size + 2 * kv_size]
  float* attn;    // [B, q_size]
  float* gu;      // [B, 2 * intermediate]
  float* act;     // [B, intermediate]
} tw_scratch;

static void rope_row(float* v, const float* cos, const float* sin, int D) {
  const int half = D / 2;
  for (int i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One token's row r [q + 2kv] (float32): RoPE on its q and k heads at `position`, then
// its K and V into the pools at `slot`.
static void rope_and_store(const tw_dims* d, float* r, int64_t position, int64_t slot,
                           const float* cos, const float* sin, void* k_pool, void* v_pool,
                           int kv_dtype) {
  const int H = d->n_heads, KVH = d->n_kv_heads, D = d->head_dim;
  const int q_size = H * D, kv_size = KVH * D;
  const float *c = cos + position * D, *sn = sin + position * D;
  for (int hh = 0; hh < H + KVH; ++hh) rope_row(r + hh * D, c, sn, D);
  for (int hh = 0; hh < KVH; ++hh) {
    row_from_f32(k_pool, kv_dtype, slot * KVH + hh, D, r + q_size + hh * D);
    row_from_f32(v_pool, kv_dtype, slot * KVH + hh, D, r + q_size + kv_size + hh * D);
  }
}

void tw_argmax_rows(const void* x, int dtype, int B, int n, int64_t* out, int threads);

// One decode token for each of B sequences: ids [B], positions [B], slots [B] (where each
// new K/V goes) -> logits [B, vocab]. kv gives the block tables and context lengths (its
// pools are taken per layer from `layers`). argmax (NULL: none): each row's greedy choice
// [B], as torch.argmax of its logits; with an AMX head no logits are written (logits may
// then be NULL), else they are, then read back.
void tw_llama_decode(const tw_dims* d, const tw_model* m, const tw_layer* layers, int n_layers,
                     const tw_kv* kv_in, const int64_t* ids, const int64_t* positions,
                     const int64_t* slots, int B, float* x, const tw_scratch* s, float* logits,
                     int64_t* argmax, int threads) {
  if (B <= 0) return;
  const int H = d->n_heads, KVH = d->n_kv_heads, D = d->head_dim, hid = d->hidden;
  const int I = d->intermediate;
  const int q_size = H * D, kv_size = KVH * D, nqkv = q_size + 2 * kv_size;
  for (int b = 0; b < B; ++b) row_to_f32(m->embed, m->embed_dtype, ids[b], hid, x + b * hid);
  int amx = m->head.dtype == TW_AMX;  // any packed weights: shared runs, tiles where they run
  for (int li = 0; li < n_layers; ++li) {
    const tw_layer* L = &layers[li];
    amx |= L->qkv.dtype == TW_AMX || L->o.dtype == TW_AMX || L->gate_up.dtype == TW_AMX ||
           L->gate_up.dtype == TW_AMX_GLU || L->down.dtype == TW_AMX;
  }
  (void)amx;
  // argmax with an AMX head: every thread's choices over its own panels, [threads][B]
  tw_best* bests = NULL;
  tw_run* runs = NULL;  // the packed products' shared runs of panels (amx_shared)
#if defined(TW_PACKED_BUILT)
  if (amx) runs = new_runs(threads);
  if (argmax && m->head.dtype == TW_AMX) {
    bests = (tw_best*)malloc(sizeof(tw_best) * (size_t)threads * B);
    for (int i = 0; i < threads * B; ++i) bests[i] = (tw_best){-INFINITY, 0, INT64_MAX};
  }
#endif
#pragma omp parallel num_threads(threads)
  {
#if defined(TW_AMX_BUILT)
    if (amx && tw_tiles) tiles_16x64();
#endif
    for (int li = 0; li < n_layers; ++li) {
      const tw_layer* L = &layers[li];
      tw_kv kv = *kv_in;
      kv.k_pool = L->k_pool;
      kv.v_pool = L->v_pool;
#pragma omp for schedule(static)
      for (int b = 0; b < B; ++b)
        rms_norm_row(x + b * hid, L->input_norm, d->eps, s->h + b * hid, s->hb + b * hid, hid);
      linear_rows(&L->qkv, s->h, s->hb, s->qkv, B, 0, runs);
      // RoPE on q and k, then this token's K and V into the pool.
#pragma omp for schedule(static)
      for (int b = 0; b < B; ++b)
        rope_and_store(d, s->qkv + (int64_t)b * nqkv, positions[b], slots[b], m->cos, m->sin,
                       L->k_pool, L->v_pool, kv.kv_dtype);
      attention_tasks(&kv, s->qkv, nqkv, s->attn, q_size, B, H, KVH, D, d->attn_scale, threads);
#pragma omp for schedule(static)
      for (int b = 0; b < B; ++b) round_row(s->attn + b * q_size, s->hb + b * q_size, q_size);
      linear_rows(&L->o, s->attn, s->hb, x, B, 1, runs);  // x += o_proj(attn)
#pragma omp for schedule(static)
      for (int b = 0; b < B; ++b)
        rms_norm_row(x + b * hid, L->post_norm, d->eps, s->h + b * hid, s->hb + b * hid, hid);
      // SwiGLU's output in bfloat16, the down product's input. (gate_up is TW_AMX_GLU only
      // where every product is packed, so down reads act_b, never the float32 act.)
      uint16_t* act_b = s->hb;
#if defined(TW_PACKED_BUILT)
      if (L->gate_up.dtype == TW_AMX_GLU) {  // SwiGLU in the product (TW_GLU), into the
        act_b = (uint16_t*)s->act;           // float32 rows' room: hb is its input
        amx_rows(&L->gate_up, s->hb, act_b, TW_GLU, B, 0, runs);
      } else
#endif
      {
        linear_rows(&L->gate_up, s->h, s->hb, s->gu, B, 0, runs);
        const int chunks = (I + 127) / 128;
#pragma omp for schedule(static)
        for (int c = 0; c < B * chunks; ++c) {  // SwiGLU: silu(gate) * up, 128 at a time
          const int b = c / chunks, j = (c % chunks) * 128, len = I - j < 128 ? I - j : 128;
          const float* g = s->gu + (int64_t)b * 2 * I + j;
          float* a = s->act + (int64_t)b * I + j;
          silu_mul(g, g + I, a, len);
          round_row(a, s->hb + (int64_t)b * I + j, len);
        }
      }
      linear_rows(&L->down, s->act, act_b, x, B, 1, runs);  // x += down(act)
    }
#pragma omp for schedule(static)
    for (int b = 0; b < B; ++b)
      rms_norm_row(x + b * hid, m->final_norm, d->eps, s->h + b * hid, s->hb + b * hid, hid);
#if defined(TW_PACKED_BUILT)
    if (bests) {
      int me, nt;
      team(&me, &nt);
      amx_shared(s->hb, B, m->head.k, (const uint16_t*)m->head.w, m->head.n, m->head.bias,
                 bests + (int64_t)me * B, TW_ARGMAX, 0, runs);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int b = 0; b < B; ++b) {
        tw_best r = bests[b];
        for (int t = 1; t < nt; ++t) best_merge(&r, bests + (int64_t)t * B + b);
        argmax[b] = r.index;
      }
    } else
#endif
      linear_rows(&m->head, s->h, s->hb, logits, B, 0, runs);
#if defined(TW_AMX_BUILT)
    if (amx && tw_tiles) _tile_release();
#endif
  }
  const int from_logits = argmax && !bests;  // no AMX head: the choices from the logits
  free(bests);
  free(runs);
  if (from_logits) tw_argmax_rows(logits, TW_F32, B, d->vocab, argmax, threads);
}

// ------------------------------------------- the pieces around torch's matrix products ---
// Big decode batches are compute-bound in their matrix products, which stay with torch
// (oneDNN); what lies between them, about twenty small torch ops a layer, runs as three
// calls: tw_residual_norm, tw_rope_attend and tw_swiglu. Inputs and outputs are rows of
// float32 or bfloat16 (the products' dtype); the residual stream x stays float32.
// tw_residual_norm, tw_swiglu and tw_rope_store hand rows to the threads 16 at a time as
// they ask (one core here is often far slower than the other): a 2,048-token prefill step
// took 443 ms against 472 with fixed halves, and 683 against 698 in another run (medians
// of interleaved runs).

// x [B, n] += delta (if any); h = rmsnorm(x) * w, written in h_dtype.
void tw_residual_norm(float* x, const void* delta, int delta_dtype, const float* w, float eps,
                      void* h, int h_dtype, int B, int n, int threads) {
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
  for (int b = 0; b < B; ++b) {
    float* xr = x + (int64_t)b * n;
#if defined(__AVX512F__)
    if (n % 16 == 0) {  // one pass for the residual and the sum of squares, one for the norm
      __m512 acc = _mm512_setzero_ps();
      for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_loadu_ps(xr + i);
        if (delta) {
          v = _mm512_add_ps(v, load16(delta, delta_dtype, (int64_t)b * n + i));
          _mm512_storeu_ps(xr + i, v);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / n + eps));
      for (int i = 0; i < n; i += 16)
        store16(h, h_dtype, (int64_t)b * n + i,
                _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), r), _mm512_loadu_ps(w + i)));
      continue;
    }
#endif
    float* tmp = (float*)malloc(sizeof(float) * (size_t)n);
    if (delta) {
      row_to_f32(delta, delta_dtype, b, n, tmp);
      for (int i = 0; i < n; ++i) xr[i] += tmp[i];
    }
    rms_norm(xr, w, eps, tmp, n);
    row_from_f32(h, h_dtype, b, n, tmp);
    free(tmp);
  }
}

// act [B, I] = silu(gate) * up, from gu [B, 2I] (gate then up), both in `dtype`.
void tw_swiglu(const void* gu, void* act, int dtype, int B, int I, int threads) {
#if defined(__AVX512F__)
  if (I % 16 == 0) {  // one pass, 16 at a time, no float32 copies of the rows
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < I; i += 16) {
        const int64_t o = 2 * (int64_t)b * I + i;
        store16(act, dtype, (int64_t)b * I + i,
                silu_mul16(load16(gu, dtype, o), load16(gu, dtype, o + I)));
      }
    return;
  }
#endif
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
  for (int b = 0; b < B; ++b) {
    float* g = (float*)malloc(sizeof(float) * 2 * (size_t)I);
    float* u = g + I;
    row_to_f32(gu, dtype, 2 * (int64_t)b, I, g);
    row_to_f32(gu, dtype, 2 * (int64_t)b + 1, I, u);
    silu_mul(g, u, g, I);
    row_from_f32(act, dtype, b, I, g);
    free(g);
  }
}

// One decode token per sequence: qkv [B, q + 2kv] (in `dtype`) -> RoPE on q and k, this
// token's K and V into the pool (kv's pools, kv->kv_dtype), attention through the block
// tables -> out [B, q] in `dtype`.
void tw_rope_attend(const tw_dims* d, const tw_kv* kv, const void* qkv, void* out, int dtype,
                    const int64_t* positions, const int64_t* slots, const float* cos,
                    const float* sin, int B, int threads) {
  if (B <= 0) return;
  const int H = d->n_heads, KVH = d->n_kv_heads, D = d->head_dim;
  const int q_size = H * D, kv_size = KVH * D, nqkv = q_size + 2 * kv_size;
  float* qf = (float*)malloc(sizeof(float) * (size_t)B * nqkv);
  float* of = (float*)malloc(sizeof(float) * (size_t)B * q_size);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int b = 0; b < B; ++b) {
      float* r = qf + (int64_t)b * nqkv;
      row_to_f32(qkv, dtype, b, nqkv, r);
      rope_and_store(d, r, positions[b], slots[b], cos, sin, (void*)kv->k_pool,
                     (void*)kv->v_pool, kv->kv_dtype);
    }
    attention_tasks(kv, qf, nqkv, of, q_size, B, H, KVH, D, d->attn_scale, threads);
#pragma omp for schedule(static)
    for (int b = 0; b < B; ++b) row_from_f32(out, dtype, b, q_size, of + (int64_t)b * q_size);
  }
  free(of);
  free(qf);
}

// Any flat batch (prefill chunks too): RoPE on q and k of each row of qkv [T, q + 2kv]
// (in place, in `dtype`), and each row's K and V into its pool slot. Attention then runs
// in torch over the pool (ops/attention.py).
void tw_rope_store(const tw_dims* d, void* k_pool, void* v_pool, int kv_dtype, void* qkv,
                   int dtype, const int64_t* positions, const int64_t* slots, const float* cos,
                   const float* sin, int T, int threads) {
  const int H = d->n_heads, KVH = d->n_kv_heads, D = d->head_dim;
  const int q_size = H * D, kv_size = KVH * D, nqkv = q_size + 2 * kv_size;
#pragma omp parallel num_threads(threads)
  {
    float* r = (float*)malloc(sizeof(float) * (size_t)nqkv);  // one row, per thread
#pragma omp for schedule(dynamic, 16)
    for (int t = 0; t < T; ++t) {
      row_to_f32(qkv, dtype, t, nqkv, r);
      rope_and_store(d, r, positions[t], slots[t], cos, sin, k_pool, v_pool, kv_dtype);
      char* row = (char*)qkv + (int64_t)t * nqkv * (dtype == TW_F32 ? 4 : 2);
      row_from_f32(row, dtype, 0, q_size + kv_size, r);  // q and k, rotated
    }
    free(r);
  }
}

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

// ------------------------------------------------------------------- greedy choice ---

static inline float value_at(const void* x, int dtype, int64_t i) {
  return dtype == TW_F32 ? ((const float*)x)[i] : bf16_to_f32(((const uint16_t*)x)[i]);
}

// out[b] = the index of the largest of row b of x [B, n] (float32 or bfloat16), as
// torch.argmax: the first such index where values tie, the first NaN where there is one.
// One pass keeps each lane's largest value and where it first occurred.
void tw_argmax_rows(const void* x, int dtype, int B, int n, int64_t* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int b = 0; b < B; ++b) {
    const int64_t row = (int64_t)b * n;
    int i = 0, nan = 0;
    int64_t best = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
      __m512 mv = load16(x, dtype, row);
      __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i cur = at;
      __mmask16 unord = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q);
      for (i = 16; i + 16 <= n; i += 16) {
        cur = _mm512_add_epi32(cur, _mm512_set1_epi32(16));
        const __m512 v = load16(x, dtype, row + i);
        unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);
        mv = _mm512_mask_mov_ps(mv, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, cur);
      }
      nan = unord != 0;
      if (!nan) {
        const float m = _mm512_reduce_max_ps(mv);
        const __mmask16 eq = _mm512_cmp_ps_mask(mv, _mm512_set1_ps(m), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(eq, at);
        float top = m;
        for (; i < n; ++i) {
          const float v = value_at(x, dtype, row + i);
          if (v != v) {
            nan = 1;
            break;
          }
          if (v > top) {
            top = v;
            best = i;
          }
        }
        if (!nan) {
          out[b] = best;
          continue;
        }
      }
    }
#endif
    (void)nan;
    float top = value_at(x, dtype, row);
    best = 0;
    for (i = 0; i < n; ++i) {
      const float v = value_at(x, dtype, row + i);
      if (v != v) {
        best = i;
        break;
      }
      if (v > top) {
        top = v;
        best = i;
      }
    }
    out[b] = best;
  }
}
