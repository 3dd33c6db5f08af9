// Each row's greedy choice.
// (part of kernels.c, the one translation unit: included there, in order)

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
