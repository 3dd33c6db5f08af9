// The product peaks: the most multiply-adds a second this CPU's vector units give, with no
// memory in the way, for the two kinds of products the engine runs.
// (part of kernels.c, the one translation unit: included there, in order)
//
// Kind 0, int8: unsigned x signed bytes into int32 sums (dpbusd where the CPU has VNNI,
// else maddubs and madd), the products of block weights and 8-bit activations.
// Kind 1, bfloat16: pairs into float32 (dpbf16 where the CPU has AVX-512 BF16), else
// float32 fused multiply-adds, what bfloat16 weights are multiplied as on such a CPU.
// Each thread runs PEAK_CHAINS independent chains (enough to hide an instruction's latency)
// for `rounds` rounds; the return is the multiply-adds done, to be divided by the time.

#define PEAK_CHAINS 12
#define PEAK_LOOP(V, init, step, fold)                                               \
  do {                                                                                \
    V s[PEAK_CHAINS];                                                                 \
    for (int c = 0; c < PEAK_CHAINS; ++c) s[c] = init;                                \
    for (int64_t r = 0; r < rounds; ++r)                                              \
      for (int c = 0; c < PEAK_CHAINS; ++c) s[c] = step;                              \
    for (int c = 0; c < PEAK_CHAINS; ++c) sink += fold;                               \
  } while (0)

static int64_t peak_int8(int64_t rounds, int id, volatile int* out) {
  int sink = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i u = _mm512_set1_epi8((char)id), v = _mm512_set1_epi8(3);
  PEAK_LOOP(__m512i, _mm512_set1_epi32(c), _mm512_dpbusd_epi32(s[c], u, v), _mm512_reduce_add_epi32(s[c]));
  *out += sink;
  return rounds * PEAK_CHAINS * 64;
#elif defined(TW_BLOCKS_256)
  const __m256i u = _mm256_set1_epi8((char)id), v = _mm256_set1_epi8(3);
  PEAK_LOOP(__m256i, _mm256_set1_epi32(c), R8_DP(s[c], u, v), _mm256_extract_epi32(s[c], 0));
  *out += sink;
  return rounds * PEAK_CHAINS * 32;
#else
  PEAK_LOOP(uint32_t, (uint32_t)(c + id), s[c] * 3u + (uint32_t)id, (int)s[c]);
  *out += sink;
  return rounds * PEAK_CHAINS;
#endif
}

static int64_t peak_bf16(int64_t rounds, int id, volatile int* out) {
  int sink = 0;
#if defined(__AVX512BF16__)
  const __m512bh u = (__m512bh)_mm512_set1_epi16(0x3F80), v = (__m512bh)_mm512_set1_epi16(0x3000);
  PEAK_LOOP(__m512, _mm512_set1_ps((float)(c + id)), _mm512_dpbf16_ps(s[c], u, v), (int)_mm512_reduce_add_ps(s[c]));
  *out += sink;
  return rounds * PEAK_CHAINS * 32;
#elif defined(__AVX512F__)
  const __m512 u = _mm512_set1_ps(1.f), v = _mm512_set1_ps(1e-9f);
  PEAK_LOOP(__m512, _mm512_set1_ps((float)(c + id)), _mm512_fmadd_ps(s[c], u, v), (int)_mm512_reduce_add_ps(s[c]));
  *out += sink;
  return rounds * PEAK_CHAINS * 16;
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 u = _mm256_set1_ps(1.f), v = _mm256_set1_ps(1e-9f);
  PEAK_LOOP(__m256, _mm256_set1_ps((float)(c + id)), _mm256_fmadd_ps(s[c], u, v), (int)_mm256_cvtss_f32(s[c]));
  *out += sink;
  return rounds * PEAK_CHAINS * 8;
#else
  PEAK_LOOP(float, (float)(c + id), fmaf(s[c], 1.f, 1e-9f), (int)s[c]);
  *out += sink;
  return rounds * PEAK_CHAINS;
#endif
}

int64_t tw_product_peak(int kind, int64_t rounds, int threads) {
  int64_t macs = 0;
  volatile int sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : macs)
  {
    const int id = omp_get_thread_num() + 1;
    macs += kind == 0 ? peak_int8(rounds, id, &sink) : peak_bf16(rounds, id, &sink);
  }
  return macs;
}
