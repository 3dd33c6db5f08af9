// Includes, dtype codes and conversions between float32 and bfloat16 rows.
// (part of kernels.c, the one translation unit: included there, in order)

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
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TW_AMX_BUILT 1  // AMX tile products (see tw_packed_linear)
#endif
#if defined(__AVX512BF16__)
#define TW_PACKED_BUILT 1  // packed products (tw_packed_linear): on tiles or vector dot products
#endif

enum { TW_F32 = 0, TW_BF16 = 1, TW_I8 = 2, TW_Q4 = 3, TW_PACKED = 4, TW_PACKED_GLU = 5 };
// TW_PACKED: see tw_pack_weight; TW_PACKED_GLU: a gate_up weight packed for TW_GLU (see panel_out)

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

#if defined(__AVX2__)
// The sum of eight floats.
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Eight floats to bfloat16, rounded to nearest even as f32_to_bf16 (NaNs stay NaNs).
static inline __m128i bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

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
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i*)(r + i), bf16x8(_mm256_loadu_ps(in + i)));
#endif
  for (; i < n; ++i) r[i] = f32_to_bf16(in[i]);
}


// One linear layer's weights: w [n, k] of `dtype`; scale [n] (int8 only) and bias [n] may
// be NULL. A TW_PARTS product is n_parts products over the same input, each writing its
// own range of output columns, in order (a fused QKV whose Q, K and V differ in type).
typedef struct tw_linear {
  const void* w;
  const float* scale;
  const float* bias;
  int dtype;
  int n, k;
  const struct tw_linear* parts;
  int n_parts;
} tw_linear;
// Weight rows are requested about this many bytes ahead of the one being multiplied: a
// decode step streams every weight once, and a core alone keeps too few reads in flight.
#define PREFETCH_BYTES 4096

