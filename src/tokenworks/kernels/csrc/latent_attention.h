// Decode attention of multi-head latent attention (DeepSeek-V2 and -V3, models/mla.py) in
// the absorbed form: each query head, its no-RoPE part already taken through W_UK into
// the latent space, attends to the cached rows themselves. A row holds one token's latent
// and its RoPE key (Dk numbers): the whole row is every head's key, and its first Dv
// numbers (the latent) every head's value. So a tile of rows is read once for both, and
// for all the heads of a task.
// (part of kernels.c, the one translation unit: included there, in order)

enum { LATENT_TILE = 32 };  // rows per tile: 32 x 576 float32 stay in L2 with the scores

// Scores of nh heads (qs [nh, Dk], scaled) against cnt rows -> s [nh, LATENT_TILE]: four
// heads a pass, so each row is loaded once for four dot products rather than one.
static void latent_scores(const float* qs, const float* rows, int nh, int cnt, int Dk,
                          float* s) {
  int g = 0;
  for (; g + 4 <= nh; g += 4) {
    const float *q0 = qs + (int64_t)g * Dk, *q1 = q0 + Dk, *q2 = q1 + Dk, *q3 = q2 + Dk;
    for (int j = 0; j < cnt; ++j) {
      const float* r = rows + j * Dk;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int d = 0; d < Dk; ++d) {
        a0 += q0[d] * r[d];
        a1 += q1[d] * r[d];
        a2 += q2[d] * r[d];
        a3 += q3[d] * r[d];
      }
      s[g * LATENT_TILE + j] = a0;
      s[(g + 1) * LATENT_TILE + j] = a1;
      s[(g + 2) * LATENT_TILE + j] = a2;
      s[(g + 3) * LATENT_TILE + j] = a3;
    }
  }
  for (; g < nh; ++g)
    for (int j = 0; j < cnt; ++j)
      s[g * LATENT_TILE + j] = dot_f32(qs + (int64_t)g * Dk, rows + j * Dk, Dk);
}

// Sequence b's nh query heads q [nh, Dk] (not yet scaled) over its context -> out [nh, Dv],
// with an online softmax: each head keeps its running maximum, its sum of e^(score - max)
// and its unnormalised output, rescaled when the maximum grows.
static void latent_attend(const tw_kv* kv, int b, int nh, int Dk, int Dv, float scale,
                          const float* q, float* out) {
  int64_t n;
  int64_t* slots = window_slots(kv, b, &n);
  const int T = LATENT_TILE;
  float* rows = (float*)malloc(sizeof(float) * (size_t)T * Dk);
  float* s = (float*)malloc(sizeof(float) * (size_t)nh * T);
  float* qs = (float*)malloc(sizeof(float) * (size_t)nh * Dk);
  float* m = (float*)malloc(sizeof(float) * (size_t)nh * 2);
  float* l = m + nh;
  for (int64_t i = 0; i < (int64_t)nh * Dk; ++i) qs[i] = q[i] * scale;
  for (int g = 0; g < nh; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int64_t i = 0; i < (int64_t)nh * Dv; ++i) out[i] = 0.f;
  for (int64_t t0 = 0; t0 < n; t0 += T) {
    const int cnt = n - t0 < T ? (int)(n - t0) : T;
    for (int j = 0; j < cnt; ++j)
      kv_load_row(kv->k_pool, kv->k_scale, kv->kv_dtype, slots[t0 + j], Dk, rows + j * Dk);
    latent_scores(qs, rows, nh, cnt, Dk, s);
    for (int g = 0; g < nh; ++g) {
      float* sg = s + g * T;
      const float decay = online_tile(sg, cnt, m + g, l + g);
      float* o = out + (int64_t)g * Dv;
#pragma omp simd
      for (int d = 0; d < Dv; ++d) o[d] *= decay;
      int j = 0;
      for (; j + 4 <= cnt; j += 4) {  // four rows at once: o is loaded and stored a quarter
        const float p0 = sg[j], p1 = sg[j + 1], p2 = sg[j + 2], p3 = sg[j + 3];
        const float *v0 = rows + j * Dk, *v1 = v0 + Dk, *v2 = v1 + Dk, *v3 = v2 + Dk;
#pragma omp simd
        for (int d = 0; d < Dv; ++d) o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
      }
      for (; j < cnt; ++j) {
        const float p = sg[j], *v = rows + j * Dk;
#pragma omp simd
        for (int d = 0; d < Dv; ++d) o[d] += p * v[d];
      }
    }
  }
  for (int g = 0; g < nh; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int d = 0; d < Dv; ++d) out[(int64_t)g * Dv + d] *= inv;
  }
  free(m);
  free(qs);
  free(s);
  free(rows);
  free(slots);
}

// q [B, H, Dk] float32 -> out [B, H, Dv] float32, one decode query per sequence; kv's
// K pool holds the rows ([slots, 1, Dk]), its V pool is not read. A sequence is one task,
// or split by heads where there are fewer sequences than threads.
void tw_latent_attention(const tw_kv* kv, const float* q, float* out, int B, int H, int Dk,
                         int Dv, float scale, int threads) {
  if (B <= 0) return;
  const int split = B >= threads ? 1 : H < threads ? H : threads;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int i = 0; i < B * split; ++i) {
    const int b = i / split, part = i % split;
    const int h0 = part * H / split, h1 = (part + 1) * H / split;
    latent_attend(kv, b, h1 - h0, Dk, Dv, scale, q + ((int64_t)b * H + h0) * Dk,
                  out + ((int64_t)b * H + h0) * Dv);
  }
}
