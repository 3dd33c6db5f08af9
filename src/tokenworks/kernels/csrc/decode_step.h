// A whole Llama-family decode step in one call.
// (part of kernels.c, the one translation unit: included there, in order)

// ---------------------------------------------------------------- the decode step ---

typedef struct {
  int hidden, n_heads, n_kv_heads, head_dim, intermediate, vocab;
  float eps, attn_scale;
} tw_dims;

typedef struct {
  const float* input_norm;  // [hidden] float32; NULL: none (OLMo 2 norms no sublayer's input)
  const float* post_norm;
  tw_linear qkv, o, gate_up, down;
  void* k_pool;  // this layer's pool, [slots, kv_heads, head_dim]
  void* v_pool;
  const float* q_norm;  // [head_dim] or NULL: RMSNorm over each head of Q and of K before
  const float* k_norm;  // RoPE (Qwen3, Gemma 3)
  const float* attn_out_norm;  // [hidden] or NULL: Gemma's norms of each sublayer's output,
  const float* mlp_out_norm;   // before it joins the residual
  const float* cos;  // this layer's RoPE table (NULL: the model's; Gemma 3's windowed
  const float* sin;  // layers have their own base)
  int group;  // its KV group: the block tables of kvs[group], the slots at slots[group * B]
  float* k_scale;  // the pools' row scales, for a one-byte KV format (kv_rows.h); else NULL
  float* v_scale;
  int no_rope;        // 1: Q and K are not rotated (SmolLM3's NoPE layers)
  int qk_norm_whole;  // 1: q_norm and k_norm span all heads at once (OLMo 2), not each head
  const float* sinks;  // [n_heads] or NULL: gpt-oss's sink logits (tw_kv.sinks)
} tw_layer;

typedef struct {
  const void* embed;  // [vocab, hidden]
  int embed_dtype;
  const float* final_norm;
  tw_linear head;
  const float* cos;  // [positions, head_dim] float32, each half repeated
  const float* sin;
  float embed_scale;  // 0: none; else the embedding rows are multiplied by it (Gemma)
  int act;            // the MLP's: 0 SwiGLU, 1 GeGLU (gelu with the tanh approximation)
} tw_model;

// Scratch memory for B rows, float32 unless said (the caller allocates it once per size).
typedef struct {
  float* h;       // [B, hidden]
  uint16_t* hb;   // [B, max(hidden, intermediate, q_size)] bfloat16 copies of inputs
  float* qkv;     // [B, q_size + 2 * kv_size]
  float* attn;    // [B, q_size]
  float* gu;      // [B, 2 * intermediate]
  float* act;     // [B, intermediate]
  void* qbuf;     // tw_qact_bytes(B, max(hidden, intermediate, q_size)): activations
                  // quantised for block weights
} tw_scratch;

static void rope_row(float* v, const float* cos, const float* sin, int D) {
  const int half = D / 2;
  for (int i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One token's row r [q + 2kv] (float32): RoPE on its q and k heads at `position` (none
// where cos is NULL), then its K and V into the pools at `slot` (scales: see kv_store_row).
static void rope_and_store(const tw_dims* d, float* r, int64_t position, int64_t slot,
                           const float* cos, const float* sin, void* k_pool, void* v_pool,
                           float* k_scale, float* v_scale, int kv_dtype) {
  const int H = d->n_heads, KVH = d->n_kv_heads, D = d->head_dim;
  const int q_size = H * D, kv_size = KVH * D;
  if (cos) {
    const float *c = cos + position * D, *sn = sin + position * D;
    for (int hh = 0; hh < H + KVH; ++hh) rope_row(r + hh * D, c, sn, D);
  }
  for (int hh = 0; hh < KVH; ++hh) {
    kv_store_row(k_pool, k_scale, kv_dtype, slot * KVH + hh, D, r + q_size + hh * D);
    kv_store_row(v_pool, v_scale, kv_dtype, slot * KVH + hh, D, r + q_size + kv_size + hh * D);
  }
}

void tw_argmax_rows(const void* x, int dtype, int B, int n, int64_t* out, int threads);

// out = gelu_tanh(g) * u over n values (GeGLU). 0.5 x (1 + tanh(y)) is x / (1 + e^(-2y)):
// silu's form, so the vector path is silu_mul16 at 2y with x in place of g.
static void gelu_mul(const float* g, const float* u, float* out, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 y2 = _mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608028654f),
                                    _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), y2), _mm512_set1_ps(88.f)));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(x, r), _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float x = g[i];
    out[i] = 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))) * u[i];
  }
}

// x += rmsnorm(y) * w over n values (y is overwritten)
static void add_norm(float* x, float* y, const float* w, float eps, int n) {
  rms_norm(y, w, eps, y, n);
  for (int i = 0; i < n; ++i) x[i] += y[i];
}

// RMSNorm over each head of a token's q and k (in place, float32 [H + KVH, D]); whole:
// over all of q at once, then all of k
static void head_norms(float* r, int H, int KVH, int D, const float* qw, const float* kw,
                       float eps, int whole) {
  if (whole) {
    rms_norm(r, qw, eps, r, H * D);
    rms_norm(r + H * D, kw, eps, r + H * D, KVH * D);
    return;
  }
  for (int h = 0; h < H; ++h) rms_norm(r + h * D, qw, eps, r + h * D, D);
  for (int h = 0; h < KVH; ++h) rms_norm(r + (H + h) * D, kw, eps, r + (H + h) * D, D);
}

// Each row of x [B, n] through RMSNorm into h, then into what the next product, L, reads:
// for block weights its 8-bit activations, quantised in the same pass (one barrier where
// a norm and a quantisation took two); for the others hb, h rounded to bfloat16.
static void norm_rows(const float* x, const float* w, float eps, int B, int n,
                      const tw_linear* L, float* h, uint16_t* hb, void* qbuf) {
  const int blocks = has_blocks(L);
  const tw_qact a = blocks ? qact_carve(qbuf, B, n) : (tw_qact){0};
  const int need = blocks ? formats_needed(L) : 0;
#pragma omp for schedule(static)
  for (int b = 0; b < B; ++b) {
    rms_norm(x + (int64_t)b * n, w, eps, h + (int64_t)b * n, n);
    if (blocks) quantize_row(h + (int64_t)b * n, b, n, &a, need);
    else round_row(h + (int64_t)b * n, hb + (int64_t)b * n, n);
  }
}

// y [B, L->n] (+)= L's product of the activations norm_rows (or glu_rows) made from x.
static void product_rows(const tw_linear* L, const float* x, const uint16_t* xb, float* y, int B,
                         int accumulate, tw_run* runs, void* qbuf) {
  if (!has_blocks(L)) {
    linear_rows(L, x, xb, y, B, accumulate, runs, qbuf);
    return;
  }
  const tw_qact a = qact_carve(qbuf, B, L->k);
  block_rows_quantised(L, &a, y, B, accumulate);
}

// act = silu(gate) * up (GeGLU's gelu_tanh where gelu) of each row of gu [B, 2I], then
// into what the down product L reads, as norm_rows does: a row at a time when L holds
// blocks (the GLU and the quantisation in one pass), else 128 values at a time, rounded.
static void glu_rows(const float* gu, int B, int I, int gelu, const tw_linear* L, float* act,
                     uint16_t* actb, void* qbuf) {
  if (has_blocks(L)) {
    const tw_qact a = qact_carve(qbuf, B, I);
    const int need = formats_needed(L);
#pragma omp for schedule(static)
    for (int b = 0; b < B; ++b) {
      const float* g = gu + (int64_t)b * 2 * I;
      if (gelu) gelu_mul(g, g + I, act + (int64_t)b * I, I);
      else silu_mul(g, g + I, act + (int64_t)b * I, I);
      quantize_row(act + (int64_t)b * I, b, I, &a, need);
    }
    return;
  }
  const int chunks = (I + 127) / 128;
#pragma omp for schedule(static)
  for (int c = 0; c < B * chunks; ++c) {
    const int b = c / chunks, j = (c % chunks) * 128, len = I - j < 128 ? I - j : 128;
    const float* g = gu + (int64_t)b * 2 * I + j;
    float* o = act + (int64_t)b * I + j;
    if (gelu) gelu_mul(g, g + I, o, len);
    else silu_mul(g, g + I, o, len);
    round_row(o, actb + (int64_t)b * I + j, len);
  }
}

// B token rows, each read through its own block table: ids [B], positions [B], slots
// [G, B] (where each new K/V goes in each of the G KV groups) -> logits [R, vocab] of the
// R = n_head rows head_rows (ascending; n_head < 0: every row, R = B). kvs [G] give each row's
// block table and context length (itself included) and each group's window (the pools
// are taken per layer from `layers`, each of which names its group). A decode step has
// one row a sequence; a prompt chunk or a verify step has one row a token, each seeing
// the keys up to its own, so a row is computed the same way whatever else is in the call.
// argmax (NULL: none): each head row's greedy choice [R], as torch.argmax of its logits;
// with an AMX head no logits are written (logits may then be NULL), else they are, then
// read back.
void tw_llama_decode(const tw_dims* d, const tw_model* m, const tw_layer* layers, int n_layers,
                     const tw_kv* kvs, const int64_t* ids, const int64_t* positions,
                     const int64_t* slots, int B, float* x, const tw_scratch* s,
                     const int64_t* head_rows, int n_head, float* logits, int64_t* argmax,
                     int threads) {
  if (B <= 0) return;
  const int R = n_head < 0 ? B : n_head;  // the rows the head runs for
  const int H = d->n_heads, KVH = d->n_kv_heads, D = d->head_dim, hid = d->hidden;
  const int I = d->intermediate;
  const int q_size = H * D, kv_size = KVH * D, nqkv = q_size + 2 * kv_size;
  for (int b = 0; b < B; ++b) {
    if (is_blocks(m->embed_dtype))
      block_row_to_f32(m->embed_dtype - TW_BLOCKS,
                       (const uint8_t*)m->embed + ids[b] * block_row_bytes(m->embed_dtype - TW_BLOCKS, hid),
                       hid, x + b * hid);
    else
      row_to_f32(m->embed, m->embed_dtype, ids[b], hid, x + b * hid);
    if (m->embed_scale != 0.f)
      for (int i = 0; i < hid; ++i) x[b * hid + i] *= m->embed_scale;
  }
  int amx = m->head.dtype == TW_PACKED;  // any packed weights: shared runs, tiles where they run
  for (int li = 0; li < n_layers; ++li) {
    const tw_layer* L = &layers[li];
    amx |= L->qkv.dtype == TW_PACKED || L->o.dtype == TW_PACKED || L->gate_up.dtype == TW_PACKED ||
           L->gate_up.dtype == TW_PACKED_GLU || L->down.dtype == TW_PACKED;
  }
  (void)amx;
  // argmax with a packed head: every thread's choices over its own panels, [threads][B]
  tw_best* bests = NULL;
  tw_run* runs = NULL;  // the packed products' shared runs of panels (packed_shared)
#if defined(TW_PACKED_BUILT)
  if (amx) runs = new_runs(threads);
  if (argmax && m->head.dtype == TW_PACKED) {
    bests = (tw_best*)malloc(sizeof(tw_best) * (size_t)threads * (R > 0 ? R : 1));
    for (int i = 0; i < threads * R; ++i) bests[i] = (tw_best){-INFINITY, 0, INT64_MAX};
  }
#endif
#pragma omp parallel num_threads(threads)
  {
#if defined(TW_AMX_BUILT)
    if (amx && tw_tiles) tiles_16x64();
#endif
    for (int li = 0; li < n_layers; ++li) {
      const tw_layer* L = &layers[li];
      tw_kv kv = kvs[L->group];
      kv.k_pool = L->k_pool;
      kv.v_pool = L->v_pool;
      kv.k_scale = L->k_scale;
      kv.v_scale = L->v_scale;
      kv.sinks = L->sinks;
      const int64_t* lslots = slots + (int64_t)L->group * B;
      const float *lcos = L->cos ? L->cos : m->cos, *lsin = L->sin ? L->sin : m->sin;
      if (L->no_rope) lcos = lsin = NULL;
      norm_rows(x, L->input_norm, d->eps, B, hid, &L->qkv, s->h, s->hb, s->qbuf);
      product_rows(&L->qkv, s->h, s->hb, s->qkv, B, 0, runs, s->qbuf);
      // RoPE on q and k, then this token's K and V into the pool.
#pragma omp for schedule(static)
      for (int b = 0; b < B; ++b) {
        if (L->q_norm)
          head_norms(s->qkv + (int64_t)b * nqkv, H, KVH, D, L->q_norm, L->k_norm, d->eps,
                     L->qk_norm_whole);
        rope_and_store(d, s->qkv + (int64_t)b * nqkv, positions[b], lslots[b], lcos, lsin,
                       L->k_pool, L->v_pool, L->k_scale, L->v_scale, kv.kv_dtype);
      }
      attention_tasks(&kv, s->qkv, nqkv, s->attn, q_size, B, H, KVH, D, d->attn_scale, threads);
      if (!has_blocks(&L->o)) {  // (block weights quantise the float32 rows themselves)
#pragma omp for schedule(static)
        for (int b = 0; b < B; ++b) round_row(s->attn + b * q_size, s->hb + b * q_size, q_size);
      }
      if (L->attn_out_norm) {  // x += rmsnorm(o_proj(attn)): the product into h first
        linear_rows(&L->o, s->attn, s->hb, s->h, B, 0, runs, s->qbuf);
#pragma omp for schedule(static)
        for (int b = 0; b < B; ++b) add_norm(x + b * hid, s->h + b * hid, L->attn_out_norm, d->eps, hid);
      } else {
        linear_rows(&L->o, s->attn, s->hb, x, B, 1, runs, s->qbuf);  // x += o_proj(attn)
      }
      // (the gate_up product reads the norm's rows through qbuf or hb, never h after it)
      norm_rows(x, L->post_norm, d->eps, B, hid, &L->gate_up, s->h, s->hb, s->qbuf);
      // SwiGLU's output in bfloat16, the down product's input. (gate_up is TW_PACKED_GLU only
      // where every product is packed, so down reads act_b, never the float32 act.)
      uint16_t* act_b = s->hb;
#if defined(TW_PACKED_BUILT)
      if (L->gate_up.dtype == TW_PACKED_GLU) {  // SwiGLU in the product (TW_GLU), into the
        act_b = (uint16_t*)s->act;           // float32 rows' room: hb is its input
        packed_rows(&L->gate_up, s->hb, act_b, TW_GLU, B, 0, runs);
      } else
#endif
      {
        product_rows(&L->gate_up, s->h, s->hb, s->gu, B, 0, runs, s->qbuf);
        glu_rows(s->gu, B, I, m->act, &L->down, s->act, s->hb, s->qbuf);
      }
      if (L->mlp_out_norm) {  // x += rmsnorm(down(act))
        product_rows(&L->down, s->act, act_b, s->h, B, 0, runs, s->qbuf);
#pragma omp for schedule(static)
        for (int b = 0; b < B; ++b) add_norm(x + b * hid, s->h + b * hid, L->mlp_out_norm, d->eps, hid);
      } else {
        product_rows(&L->down, s->act, act_b, x, B, 1, runs, s->qbuf);  // x += down(act)
      }
    }
#pragma omp for schedule(static)
    for (int r = 0; r < R; ++r) {  // the head rows, first to last, into rows 0 .. R - 1
      const int64_t b = n_head < 0 ? r : head_rows[r];
      rms_norm_row(x + b * hid, m->final_norm, d->eps, s->h + r * hid, s->hb + r * hid, hid);
    }
#if defined(TW_PACKED_BUILT)
    if (bests) {
      int me, nt;
      team(&me, &nt);
      if (R > 0)
        packed_shared(s->hb, R, m->head.k, (const uint16_t*)m->head.w, m->head.n, m->head.bias,
                      bests + (int64_t)me * R, TW_ARGMAX, 0, runs);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int b = 0; b < R; ++b) {
        tw_best r = bests[b];
        for (int t = 1; t < nt; ++t) best_merge(&r, bests + (int64_t)t * R + b);
        argmax[b] = r.index;
      }
    } else
#endif
      if (R > 0) linear_rows(&m->head, s->h, s->hb, logits, R, 0, runs, s->qbuf);
#if defined(TW_AMX_BUILT)
    if (amx && tw_tiles) _tile_release();
#endif
  }
  const int from_logits = argmax && !bests;  // no AMX head: the choices from the logits
  free(bests);
  free(runs);
  if (from_logits && R > 0) tw_argmax_rows(logits, TW_F32, R, d->vocab, argmax, threads);
}


// The products of a batch-1 decode step alone, in the step's order (L: n products; x, xb:
// a zero row of the widest input, float32 and bfloat16; y: room for the widest output;
// qbuf: tw_qact_bytes(1, widest input)): what reading the step's weights costs without
// the work between the products (bench/ceilings.py's products_share).
void tw_products_pass(const tw_linear* const* L, int n, const float* x, const uint16_t* xb,
                      float* y, void* qbuf, int threads) {
#pragma omp parallel num_threads(threads)
  for (int i = 0; i < n; ++i) linear_rows(L[i], x, xb, y, 1, 0, NULL, qbuf);
}
