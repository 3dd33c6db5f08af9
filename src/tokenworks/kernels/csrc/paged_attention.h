// Decode attention read through each sequence's block table.
// (part of kernels.c, the one translation unit: included there, in order)

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
  float softcap;  // > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2); 0: none
  int tile;       // keys per tile of the online softmax (attend_online)
  int tile_from;  // contexts of at least this many keys take it; 0: none do; < 0: the
                 // build's default (online_from)
  int64_t* traffic;  // NULL, or [read, written]: attend_online adds the bytes it moves
  const float* k_scale;  // [slots, kv_heads] for a one-byte kv_dtype (kv_rows.h), else NULL
  const float* v_scale;
  const float* sinks;  // [query heads] or NULL: gpt-oss's sink logits, one more term in each
                       // softmax's denominator (with no value)
} tw_kv;

// query head (kv head h, g of its G)'s sink logit, or -inf where there are none
static inline float sink_of(const tw_kv* kv, int h, int G, int g) {
  return kv->sinks ? kv->sinks[h * G + g] : -INFINITY;
}

static inline void count_bytes(const tw_kv* kv, int64_t read, int64_t written) {
  if (!kv->traffic) return;
  __atomic_fetch_add(kv->traffic, read, __ATOMIC_RELAXED);
  __atomic_fetch_add(kv->traffic + 1, written, __ATOMIC_RELAXED);
}

// Where the online softmax replaces whole score rows by default: everywhere on a build
// without AVX-512 (measured faster at every context, docs/kernels.md); never with it, where
// the vector whole-row passes measured faster (the alternatives in docs/kernels.md).
static inline int online_from(const tw_kv* kv) {
  if (kv->tile <= 0) return 0;
  if (kv->tile_from >= 0) return kv->tile_from;
#if defined(__AVX512F__)
  return 0;
#else
  return 1;
#endif
}

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

// softmax over n scores in place (float32), with a sink logit in the denominator (-inf:
// none)
static void softmax(float* s, int64_t n, float sink) {
  float mx = sink, sum = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(sink);
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
  if (sink > -INFINITY) sum += expf(sink - mx);
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
// A sequence's K and V for one layer are about 150 KB at 200 keys, so L2 holds them (L1
// does not). Results are bit-identical either way: prefetches are hints.
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

// One tile of an online softmax, for one query head: its cnt scores sg become
// e^(score - max), the running maximum *m and sum *l take the tile in, and the factor the
// output so far is to be multiplied by comes back (0 on the first tile, where *m = -inf).
static inline float online_tile(float* sg, int cnt, float* m, float* l) {
  float mx = *m;
  for (int j = 0; j < cnt; ++j) mx = sg[j] > mx ? sg[j] : mx;
  const float decay = expf(*m - mx);
  float sum = 0.f;
  for (int j = 0; j < cnt; ++j) {
    sg[j] = expf(sg[j] - mx);
    sum += sg[j];
  }
  *l = *l * decay + sum;
  *m = mx;
  return decay;
}

// One KV head's G query heads (qs [G, D], scaled) over n keys with an online softmax,
// T = kv->tile keys at a time: each tile's K rows give its scores, then its V rows are
// added in at once, while each head keeps its running maximum m, its sum l of
// e^(score - m) and its unnormalised output, rescaled by e^(m_old - m_new) when the
// maximum grows. No score row of the whole context is held, and K and V are read in one
// pass, a tile of each close together. out [G, D].
static void attend_online(const tw_kv* kv, const int64_t* slots, int64_t n, int kv_heads, int h,
                          int G, int D, const float* qs, float* out) {
  const int T = kv->tile;
  float* s = (float*)malloc(sizeof(float) * (size_t)G * T);
  float* rows = (float*)malloc(sizeof(float) * (size_t)T * D);
  float* m = (float*)malloc(sizeof(float) * (size_t)G * 2);
  float* l = m + G;
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) out[g * D + d] = 0.f;
  }
  const int64_t esz = kv_elem_bytes(kv->kv_dtype), row_scale = kv_scaled(kv->kv_dtype) ? 4 : 0;
  count_bytes(kv, (int64_t)G * D * 4 + 2 * n * (D * esz + row_scale), (int64_t)G * D * 4);
  for (int64_t t0 = 0; t0 < n; t0 += T) {
    const int cnt = n - t0 < T ? (int)(n - t0) : T;
    for (int j = 0; j < cnt; ++j)
      kv_load_row(kv->k_pool, kv->k_scale, kv->kv_dtype, slots[t0 + j] * kv_heads + h, D,
                  rows + j * D);
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < cnt; ++j) {
        float x = dot_f32(qs + g * D, rows + j * D, D);
        s[g * T + j] = kv->softcap > 0.f ? kv->softcap * tanhf(x / kv->softcap) : x;
      }
    for (int j = 0; j < cnt; ++j)
      kv_load_row(kv->v_pool, kv->v_scale, kv->kv_dtype, slots[t0 + j] * kv_heads + h, D,
                  rows + j * D);
    for (int g = 0; g < G; ++g) {
      float* sg = s + g * T;
      const float decay = online_tile(sg, cnt, m + g, l + g);
      float* o = out + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] *= decay;
      for (int j = 0; j < cnt; ++j) {
        const float p = sg[j], *v = rows + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) o[d] += p * v[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float sink = sink_of(kv, h, G, g);  // one more term in the denominator
    const float inv = 1.f / (l[g] + (sink > -INFINITY ? expf(sink - m[g]) : 0.f));
    for (int d = 0; d < D; ++d) out[g * D + d] *= inv;
  }
  free(m);
  free(rows);
  free(s);
}

// Sequence b's query heads of KV heads [h0, h1): q [(h1 - h0) * G, D] (float32, not yet
// scaled) -> out, same shape. For each KV head: scores over the whole context, softmax,
// then the weighted sum of values. Each key and value row is read once for all the query
// heads that share it (GQA). next_b >= 0: the sequence to ask for while this one computes
// (tw_ahead).
static void attend(const tw_kv* kv, int b, int h0, int h1, int kv_heads, int G, int D,
                   float scale, const float* q, float* out, int next_b) {
  int64_t n;
  const int64_t esz = kv_elem_bytes(kv->kv_dtype);
  int64_t* slots = window_slots(kv, b, &n);
  const int from = online_from(kv);
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
    if (from > 0 && n >= from) {
      attend_online(kv, slots, n, kv_heads, h, G, D, qs, oh);
      continue;
    }
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
        kv_load_row(kv->k_pool, kv->k_scale, kv->kv_dtype, slots[l] * kv_heads + h, D, row);
        for (int g = 0; g < G; ++g) scores[g * n + l] = dot_f32(qs + g * D, row, D);
      }
    if (kv->softcap > 0.f)
      for (int64_t i = 0; i < (int64_t)G * n; ++i)
        scores[i] = kv->softcap * tanhf(scores[i] / kv->softcap);
    for (int g = 0; g < G; ++g) softmax(scores + g * n, n, sink_of(kv, h, G, g));
#if defined(__AVX512F__)
    if (D == 64 && G <= 4 && !kv_scaled(kv->kv_dtype)) {  // (load16: float32 or bfloat16)
      const void* vp = kv->v_pool;
      const int dt = kv->kv_dtype;
      const char* nk = h + 1 < h1 ? (const char*)kv->k_pool + (int64_t)(h + 1) * D * esz : NULL;
      if (G == 1) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 1, oh, nk, ap);
      if (G == 2) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 2, oh, nk, ap);
      if (G == 3) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 3, oh, nk, ap);
      if (G == 4) weighted_values64(vp, dt, slots, n, kv_heads, h, scores, 4, oh, nk, ap);
      continue;
    }
    if (D % 16 == 0 && !kv_scaled(kv->kv_dtype)) {  // one query head at a time, its sums
                                                     // in registers
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
      kv_load_row(kv->v_pool, kv->v_scale, kv->kv_dtype, slots[l] * kv_heads + h, D, row);
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

