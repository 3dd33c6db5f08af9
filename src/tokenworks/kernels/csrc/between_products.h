// What lies between torch's matrix products: residual + RMSNorm, SwiGLU, RoPE + cache writes.
// (part of kernels.c, the one translation unit: included there, in order)

// ------------------------------------------- the pieces around torch's matrix products ---
// Big decode batches are compute-bound in their matrix products, which stay with torch
// (oneDNN); what lies between them, about twenty small torch ops a layer, runs as three
// calls: tw_residual_norm, tw_rope_attend and tw_swiglu. Inputs and outputs are rows of
// float32 or bfloat16 (the products' dtype); the residual stream x stays float32.
// tw_residual_norm, tw_swiglu and tw_rope_store hand rows to the threads 16 at a time as
// they ask: on shared machines one core is often far slower than the other, and fixed
// halves would leave the fast one waiting.

// x [B, n] += delta (if any); h = rmsnorm(x) * w, written in h_dtype.
void tw_residual_norm(float* x, const void* delta, int delta_dtype, const float* w, float eps,
                      void* h, int h_dtype, int B, int n, int threads) {
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
  for (int b = 0; b < B; ++b) {
    float* xr = x + (int64_t)b * n;
#if defined(__AVX512F__)
    if (n % 16 == 0 && w) {  // one pass for the residual and the sum of squares, one for the norm
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
                     (void*)kv->v_pool, (float*)kv->k_scale, (float*)kv->v_scale, kv->kv_dtype);
    }
    attention_tasks(kv, qf, nqkv, of, q_size, B, H, KVH, D, d->attn_scale, threads);
#pragma omp for schedule(static)
    for (int b = 0; b < B; ++b) row_from_f32(out, dtype, b, q_size, of + (int64_t)b * q_size);
  }
  free(of);
  free(qf);
}

// Any flat batch (prefill chunks too): RoPE on q and k of each row of qkv [T, q + 2kv]
// (in place, in `dtype`), and each row's K and V into its pool slot (k_scale, v_scale:
// the row scales of a one-byte kv_dtype, else NULL). Attention then runs over the pool
// (kernels/attention.py).
void tw_rope_store(const tw_dims* d, void* k_pool, void* v_pool, float* k_scale,
                   float* v_scale, int kv_dtype, void* qkv, int dtype, const int64_t* positions,
                   const int64_t* slots, const float* cos, const float* sin, int T,
                   int threads) {
  const int H = d->n_heads, KVH = d->n_kv_heads, D = d->head_dim;
  const int q_size = H * D, kv_size = KVH * D, nqkv = q_size + 2 * kv_size;
#pragma omp parallel num_threads(threads)
  {
    float* r = (float*)malloc(sizeof(float) * (size_t)nqkv);  // one row, per thread
#pragma omp for schedule(dynamic, 16)
    for (int t = 0; t < T; ++t) {
      row_to_f32(qkv, dtype, t, nqkv, r);
      rope_and_store(d, r, positions[t], slots[t], cos, sin, k_pool, v_pool, k_scale, v_scale,
                     kv_dtype);
      char* row = (char*)qkv + (int64_t)t * nqkv * (dtype == TW_F32 ? 4 : 2);
      row_from_f32(row, dtype, 0, q_size + kv_size, r);  // q and k, rotated
    }
    free(r);
  }
}

