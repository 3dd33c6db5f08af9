// LoRA adapters' deltas (engine/lora_layers.py): each row of a product's output adds
// B (A x) of its own adapter, part by part (Q, K and V of a fused product each have their
// own). A row reads only its adapter's A and B, the segmented form of punica's products:
// rank x (in + part width) multiply-adds a row and part, however many adapters the batch
// mixes. x [B, in] and y [B, out] are rows of float32 or bfloat16 (dtype); slots [B] each
// row's adapter slot (-1: the base model). For part p of n_parts, columns lo[p] .. hi[p]
// of y; for slot s of n_slots, at i = p * n_slots + s: a[i] [rank[i], in] and bt[i]
// [rank[i], hi[p] - lo[p]] (B transposed, its scale applied), of w_dtype (float32 or
// bfloat16: with many adapters in a batch their bytes are what a step waits on); rank 0:
// none. Sums are float32, and each row of y is rounded once.

#if defined(__AVX512F__)
static inline __m512 lora_load16(const void* w, int w_dtype, int64_t at) {
  if (w_dtype == TW_F32) return _mm512_loadu_ps((const float*)w + at);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)w + at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

static inline float lora_at(const void* w, int w_dtype, int64_t at) {
  return w_dtype == TW_F32 ? ((const float*)w)[at] : bf16_to_f32(((const uint16_t*)w)[at]);
}

// w[off .. off + n) . x
static inline float lora_dot(const void* w, int w_dtype, int64_t off, const float* x, int n) {
  float acc = 0.f;
  int i = 0;
#if defined(__AVX512F__)
  __m512 v = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) v = _mm512_fmadd_ps(lora_load16(w, w_dtype, off + i), _mm512_loadu_ps(x + i), v);
  acc = _mm512_reduce_add_ps(v);
#endif
  for (; i < n; ++i) acc += lora_at(w, w_dtype, off + i) * x[i];
  return acc;
}

// y[0 .. n) += w[off .. off + n) * u
static inline void lora_axpy(const void* w, int w_dtype, int64_t off, float u, float* y, int n) {
  int i = 0;
#if defined(__AVX512F__)
  const __m512 uv = _mm512_set1_ps(u);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(lora_load16(w, w_dtype, off + i), uv, _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += lora_at(w, w_dtype, off + i) * u;
}

void tw_lora_add(const void* x, void* y, int dtype, int B, int in, int out,
                 const int32_t* slots, int n_parts, const int64_t* lo, const int64_t* hi,
                 int n_slots, const void* const* a, const void* const* bt,
                 const int32_t* rank, int w_dtype, int threads) {
  const size_t elsize = dtype == TW_F32 ? sizeof(float) : sizeof(uint16_t);
#pragma omp parallel num_threads(threads)
  {
    float* xr = (float*)malloc(sizeof(float) * (size_t)in);
    float* yr = (float*)malloc(sizeof(float) * (size_t)out);
    float* u = NULL;
    int u_size = 0;
#pragma omp for schedule(dynamic, 1)
    for (int b = 0; b < B; ++b) {
      const int s = slots[b];
      if (s < 0 || s >= n_slots) continue;
      row_to_f32(x, dtype, b, in, xr);
      for (int p = 0; p < n_parts; ++p) {
        const int64_t i = (int64_t)p * n_slots + s;
        const int r = rank[i];
        if (r <= 0) continue;
        if (r > u_size) {
          free(u);
          u = (float*)malloc(sizeof(float) * (size_t)r);
          u_size = r;
        }
        for (int k = 0; k < r; ++k) u[k] = lora_dot(a[i], w_dtype, (int64_t)k * in, xr, in);
        const int width = (int)(hi[p] - lo[p]);
        char* part = (char*)y + ((int64_t)b * out + lo[p]) * elsize;
        row_to_f32(part, dtype, 0, width, yr);
        for (int k = 0; k < r; ++k) lora_axpy(bt[i], w_dtype, (int64_t)k * width, u[k], yr, width);
        row_from_f32(part, dtype, 0, width, yr);
      }
    }
    free(xr);
    free(yr);
    free(u);
  }
}
