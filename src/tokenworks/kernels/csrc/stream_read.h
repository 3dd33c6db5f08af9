// A streaming read of memory: the ceiling a decode step is measured against.
// (part of kernels.c, the one translation unit: included there, in order)

// Read n bytes (a multiple of 256) with `threads` threads, as a decode step streams its
// weights, and return a sum of them (so the reads cannot be left out): what the machine's
// memory gives a pass over weights, the ceiling decode's speed is measured against.
int64_t tw_stream_read(const void* p, int64_t n, int threads) {
  int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
#if defined(__AVX512F__)
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i += 256) {
      const char* c = (const char*)p + i;
      __builtin_prefetch(c + PREFETCH_BYTES, 0, 3);
      s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(c));
      s1 = _mm512_add_epi64(s1, _mm512_loadu_si512(c + 64));
      s2 = _mm512_add_epi64(s2, _mm512_loadu_si512(c + 128));
      s3 = _mm512_add_epi64(s3, _mm512_loadu_si512(c + 192));
    }
    total += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
#else
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i += 8) {
      int64_t v;
      memcpy(&v, (const char*)p + i, 8);
      total += v;
    }
#endif
  }
  return total;
}
