// The paged KV pool's rows in each format it keeps: float32 or bfloat16 as they are, or
// one byte an element (int8, or float8 e4m3) with a float32 scale per row (one token, one
// KV head), quantised as engine/kv_quant.py quantises them.
// (part of kernels.c, the one translation unit: included there, in order)

enum { TW_E4M3 = 7 };  // (TW_I8 is the other one-byte format)

static inline int kv_scaled(int dtype) { return dtype == TW_I8 || dtype == TW_E4M3; }

static inline int64_t kv_elem_bytes(int dtype) {
  return dtype == TW_F32 ? 4 : dtype == TW_BF16 ? 2 : 1;
}

// Each e4m3 byte's value: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m * 2^-9); 0x7F and 0xFF are NaN (no infinities: the largest is 448).
static float tw_e4m3[256];

__attribute__((constructor)) static void e4m3_table(void) {
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 15, m = c & 7;
    float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + (float)m / 8.f, e - 7);
    if ((c & 127) == 127) v = NAN;
    tw_e4m3[c] = c & 128 ? -v : v;
  }
}

// The nearest e4m3 byte to x (|x| <= 448), ties to the even mantissa, as torch rounds:
// the positive codes 0..126 ascend with their values, so a binary search finds the two
// that bracket |x|. (Their differences from |x| are exact, so ties are seen as ties.)
static inline uint8_t f32_to_e4m3(float x) {
  if (x != x) return 0x7F;
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const float a = fabsf(x);
  if (a >= tw_e4m3[126]) return sign | 126;
  int lo = 0, hi = 126;  // tw_e4m3[lo] <= a < tw_e4m3[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tw_e4m3[mid] <= a) lo = mid;
    else hi = mid;
  }
  const float below = a - tw_e4m3[lo], above = tw_e4m3[hi] - a;
  const int c = below < above ? lo : above < below ? hi : (lo & 1 ? hi : lo);
  return (uint8_t)(sign | c);
}

// Row `row` of a pool (D values) as float32: one-byte formats times their row's scale.
static inline void kv_load_row(const void* pool, const float* scale, int dtype, int64_t row,
                               int D, float* out) {
  if (!kv_scaled(dtype)) {
    row_to_f32(pool, dtype, row, D, out);
    return;
  }
  const float s = scale[row];
  int i = 0;
  if (dtype == TW_I8) {
    const int8_t* r = (const int8_t*)pool + row * D;
#if defined(__AVX512F__)
    for (; i + 16 <= D; i += 16) {
      const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(r + i)));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(s)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= D; i += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(r + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(s)));
    }
#endif
    for (; i < D; ++i) out[i] = (float)r[i] * s;
    return;
  }
  const uint8_t* r = (const uint8_t*)pool + row * D;
  for (; i < D; ++i) out[i] = tw_e4m3[r[i]] * s;
}

// D float32 values into row `row` of a pool: in a one-byte format, scaled by the row's
// largest magnitude over the format's largest value (127, or 448 for e4m3), that scale
// kept in scale[row].
static inline void kv_store_row(void* pool, float* scale, int dtype, int64_t row, int D,
                                const float* in) {
  if (!kv_scaled(dtype)) {
    row_from_f32(pool, dtype, row, D, in);
    return;
  }
  float amax = 0.f;
  for (int i = 0; i < D; ++i) amax = fmaxf(amax, fabsf(in[i]));
  const float s = fmaxf(amax, 1e-30f) / (dtype == TW_I8 ? 127.f : 448.f);
  scale[row] = s;
  if (dtype == TW_I8) {
    int8_t* r = (int8_t*)pool + row * D;
    for (int i = 0; i < D; ++i) {
      const float q = rintf(in[i] / s);  // to nearest, ties to even (torch's round)
      r[i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
    }
    return;
  }
  uint8_t* r = (uint8_t*)pool + row * D;
  for (int i = 0; i < D; ++i) r[i] = f32_to_e4m3(in[i] / s);
}
