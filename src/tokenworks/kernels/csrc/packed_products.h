// Matrix products on packed bfloat16 weights: AMX tiles, or AVX-512 BF16 dot products.
// (part of kernels.c, the one translation unit: included there, in order)

#if defined(TW_PACKED_BUILT)
// This thread's number and the size of its team (0 and 1 outside a parallel region).
static void team(int* me, int* nt) {
  *me = 0;
  *nt = 1;
#ifdef _OPENMP
  *me = omp_get_thread_num();
  *nt = omp_get_num_threads();
#endif
}

// Thread me's share of a product's panels, of a team of nt.
static void thread_panels(int panels, int me, int nt, int* p0, int* p1) {
  *p0 = (int)((int64_t)panels * me / nt);
  *p1 = (int)((int64_t)panels * (me + 1) / nt);
}
#endif

// ------------------------------------------------------------- packed matrix products ---
// Decode batches of tens of rows multiply every weight once per step: the product streams
// the weights from memory and does 2 * rows flops per weight read. The weights are packed
// once so that each thread reads one contiguous run of memory, asked for ahead into the
// caches next to the core (64 KB ahead on tiles, the next panel in vec_panels). On CPUs with AMX, tile products (TDPBF16PS: [16 x 32] x
// [32 x 16] bfloat16 pairs into [16 x 16] float32) do the arithmetic with room to spare;
// elsewhere (AVX-512 BF16 without AMX, such as AMD's Zen 4) AVX-512 BF16 dot products read
// the same layout (vec_panels).
//
// Packed layout (tw_pack_weight): per panel of 32 output columns (n0 = 32p), per step of 32
// inputs (k0 = 32s), two tiles for columns n0..n0+15 and n0+16..n0+31, each in the pair
// ("VNNI") layout the tile product reads: tile[i][c][e] = w[n0 + c][k0 + 2i + e].
// A panel is K * 64 contiguous bytes; N and K must be multiples of 32.

// 1 once Linux has granted this process the AMX tile state (tw_amx_init): the packed
// products then run on tiles, else (0) as vector dot products.
static int tw_tiles = 0;

#if defined(TW_AMX_BUILT)
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tw_tilecfg;

static void tiles_16x64(void) {  // all 8 tiles 16 rows of 64 bytes
  tw_tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes only: without this barrier
  // the other stores to cfg may be moved past it (ldtilecfg then faults on garbage).
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

#endif

#if defined(TW_PACKED_BUILT)
// a and b, folded as torch.argmax would choose between them (whatever their order).
static inline void best_merge(tw_best* a, const tw_best* b) {
  if (a->nan || b->nan) {
    if (b->nan && (!a->nan || b->index < a->index)) *a = *b;
    return;
  }
  if (b->value > a->value || (b->value == a->value && b->index < a->index)) *a = *b;
}

// amx_panels' y_dtype for "no output, only each row's tw_best": a decode step whose rows
// all sample greedily needs no logits, which for 64 rows are 12.6 MB written and read
// back by tw_argmax_rows.
#define TW_ARGMAX 100

// amx_panels' y_dtype for a gate_up product that ends in SwiGLU: the weight [2I, K] (gate
// rows, then up rows) was packed with its rows reordered so that each panel holds gate
// columns 16p..16p+15, then up columns 16p..16p+15 (products.pack_weight(glu=True)); y is
// bfloat16 [M, I], columns 16p..16p+15 of each row silu(gate) * up, from the float32 sums
// and rounded once. The [M, 2I] gate and up sums are never written (that would be a
// write, a read back and a pass over them, each layer).
#define TW_GLU 101

// Folds columns col0..col0+31 of a row (v, float32) into its choice b, in any order of
// panels (a thread may take panels from another's run: see packed_shared).
static inline void best_of_32(tw_best* b, const float* v, int64_t col0) {
  const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
  const __mmask16 nlo = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q);
  const __mmask16 nhi = _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
  tw_best here = {0.f, 0, 0};
  if (nlo | nhi) {
    here.nan = 1;
    here.index = col0 + (nlo ? __builtin_ctz(nlo) : 16 + __builtin_ctz(nhi));
  } else {
    here.value = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
    if (b->nan || here.value < b->value) return;  // the common case: nothing to do
    const __m512 mm = _mm512_set1_ps(here.value);
    const __mmask16 elo = _mm512_cmp_ps_mask(lo, mm, _CMP_EQ_OQ);
    const __mmask16 ehi = _mm512_cmp_ps_mask(hi, mm, _CMP_EQ_OQ);
    here.index = col0 + (elo ? __builtin_ctz(elo) : 16 + __builtin_ctz(ehi));
  }
  best_merge(b, &here);
}

// Rows mb.. (rows of them) of panel p's product, c [rows][32] float32, into y: + bias,
// y (float32) += it with accumulate, or stored in y_dtype; y_dtype TW_ARGMAX: y is
// tw_best [M], this thread's choices over the panels it multiplied, and no product is
// written; TW_GLU: y is SwiGLU's output (see there).
static void panel_out(float (*c)[32], int rows, int mb, int p, int N, const float* bias, void* y,
                      int y_dtype, int accumulate) {
  if (y_dtype == TW_GLU) {
    for (int r = 0; r < rows; ++r) {
      __m512 g = _mm512_loadu_ps(c[r]), u = _mm512_loadu_ps(c[r] + 16);
      if (bias) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(bias + 32 * p));
        u = _mm512_add_ps(u, _mm512_loadu_ps(bias + 32 * p + 16));
      }
      store16(y, TW_BF16, (int64_t)(mb + r) * (N / 2) + 16 * p, silu_mul16(g, u));
    }
    return;
  }
  if (y_dtype == TW_ARGMAX) {
    for (int r = 0; r < rows; ++r) {
      if (bias)
        for (int j = 0; j < 32; ++j) c[r][j] += bias[32 * p + j];
      best_of_32((tw_best*)y + mb + r, c[r], 32 * p);
    }
    return;
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t o = (int64_t)(mb + r) * N + 32 * p + 16 * h;
      __m512 v = _mm512_loadu_ps(c[r] + 16 * h);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 32 * p + 16 * h));
      if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps((const float*)y + o));
      store16(y, y_dtype, o, v);
    }
}

// Panels this many at a time: each group's panels (up to 2 * K * 64 bytes, in L2 once
// read) are multiplied by every 32 rows before the next group, so the rows' tiles are
// read from near caches for as many weights as possible.
#define GROUP_PANELS 2

#endif

#if defined(TW_AMX_BUILT)
// x [M, K] bfloat16 in tile order: tile (t, s) holds rows 16t..16t+15 by inputs
// 32s..32s+31 as 1 KB of memory, rows past M zero, M rounded up to 32. A tile load then
// reads 16 adjacent lines instead of 16 rows K * 2 bytes apart, which pays for the copy.
// Every thread packs its own copy (tens to hundreds of KB, from cache) and frees it after.
static uint16_t* pack_tiles(const uint16_t* x, int M, int K) {
  const int steps = K / 32, tiles = (M + 31) / 32 * 2;
  uint16_t* a = (uint16_t*)aligned_alloc(64, (size_t)tiles * 16 * K * sizeof(uint16_t));
  for (int t = 0; t < tiles; ++t)
    for (int s = 0; s < steps; ++s)
      for (int r = 0; r < 16; ++r) {
        uint16_t* dst = a + ((int64_t)t * steps + s) * 512 + r * 32;
        const int row = 16 * t + r;
        if (row < M)
          memcpy(dst, x + (int64_t)row * K + 32 * s, 64);
        else
          memset(dst, 0, 64);
      }
  return a;
}

// Panels [p0, p1) of y [M, N] (+)= x [M, K] @ w.T (+ bias), x bfloat16 in pack_tiles'
// order (xt). 32 rows at a time, 4 accumulator tiles: rows 0-15 and 16-31 by columns 0-15
// and 16-31. accumulate: y (float32) += the product. y_dtype TW_ARGMAX: y is tw_best [M],
// this thread's choices over the panels it multiplied, and no product is written.
static void amx_panels(const uint16_t* xt, int M, int K, const uint16_t* wp, int N, int p0,
                       int p1, const float* bias, void* y, int y_dtype, int accumulate) {
  const int steps = K / 32;
  const int64_t panel_elems = (int64_t)K * 32;
  float c[32][32];
  for (int g0 = p0; g0 < p1; g0 += GROUP_PANELS) {
    const int g1 = g0 + GROUP_PANELS < p1 ? g0 + GROUP_PANELS : p1;
    for (int mb = 0; mb < M; mb += 32) {
      const uint16_t* xa0 = xt + (int64_t)(mb / 16) * steps * 512;  // rows mb..mb+15
      const uint16_t* xa1 = xa0 + (int64_t)steps * 512;              // rows mb+16..mb+31
      for (int p = g0; p < g1; ++p) {
        const uint16_t* panel = wp + p * panel_elems;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int s = 0; s < steps; ++s) {
          if (mb == 0)  // 64 KB ahead in this thread's stream of panels, into L2
            prefetch_l2(panel + (int64_t)(s + 32) * 1024, 2048);
          _tile_loadd(4, xa0 + (int64_t)s * 512, 64);
          _tile_loadd(5, xa1 + (int64_t)s * 512, 64);
          _tile_loadd(6, panel + s * 1024, 64);
          _tile_loadd(7, panel + s * 1024 + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, &c[0][0], 128);
        _tile_stored(1, &c[0][16], 128);
        _tile_stored(2, &c[16][0], 128);
        _tile_stored(3, &c[16][16], 128);
        panel_out(c, M - mb < 32 ? M - mb : 32, mb, p, N, bias, y, y_dtype, accumulate);
      }
    }
  }
}

#endif

#if defined(TW_PACKED_BUILT)
// Rows of sums vec_panels keeps in registers: VEC_ROWS rows by a panel's 32 columns.
#define VEC_ROWS 8

// One packed step (32 inputs) of a panel for `rows` rows of x (xs: their first input of
// the step, rows K apart) into acc [rows][2] (columns 0-15, 16-31).
static inline __attribute__((always_inline)) void vec_step(const uint16_t* tile,
                                                           const uint16_t* xs, int K, int rows,
                                                           __m512 (*acc)[2]) {
  for (int i = 0; i < 16; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(tile + i * 32);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(tile + 512 + i * 32);
    for (int r = 0; r < rows; ++r) {
      const __m512bh xv = pair_of(xs + (int64_t)r * K + 2 * i);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  }
}

// amx_panels without tiles: the same panels, x plain [M, K] bfloat16. A row of a packed
// tile holds 16 columns' pair of weights (k, k + 1), so one 32-bit broadcast of x's pair
// against it adds to 16 columns' sums: per pair of inputs, 2 weight rows, VEC_ROWS
// broadcasts and 2 * VEC_ROWS dot products. A panel at a time, its rows VEC_ROWS at a
// time: the panel (K * 64 bytes) comes from L2 for each block of rows after the first.
//
// The weights come from memory (a model's are bigger than L3), and the next panel is
// asked for into L1 while this one computes, a slice with each step of each block of rows,
// so that it has all arrived when its turn comes and the requests never bunch up (one
// burst ahead of the first block of rows leaves the core waiting on memory later).
static void vec_panels(const uint16_t* x, int M, int K, const uint16_t* wp, int N, int p0, int p1,
                       const float* bias, void* y, int y_dtype, int accumulate) {
  if (M <= 0 || K <= 0) return;  // no rows: nothing to sum (and no steps to share prefetch)
  const int steps = K / 32;
  const int64_t panel_bytes = (int64_t)K * 64;
  const int64_t calls = (int64_t)((M + VEC_ROWS - 1) / VEC_ROWS) * steps;  // a panel's steps
  const int64_t per = ((panel_bytes + calls - 1) / calls + 63) / 64 * 64;  // bytes asked a step
  const char* end = (const char*)(wp + (int64_t)N * K);
  float c[VEC_ROWS][32];
  for (int p = p0; p < p1; ++p) {
    const uint16_t* panel = wp + (int64_t)p * K * 32;
    const char* ask = (const char*)panel + panel_bytes;  // the next panel's next line
    const char* stop = ask + panel_bytes < end ? ask + panel_bytes : end;
    for (int mb = 0; mb < M; mb += VEC_ROWS) {
      const int rows = M - mb < VEC_ROWS ? M - mb : VEC_ROWS;
      __m512 acc[VEC_ROWS][2];
      for (int r = 0; r < VEC_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int s = 0; s < steps; ++s) {
        for (const char* e = ask + per < stop ? ask + per : stop; ask < e; ask += 64)
          __builtin_prefetch(ask, 0, 3);
        const uint16_t* tile = panel + s * 1024;
        const uint16_t* xs = x + (int64_t)mb * K + 32 * s;
        if (rows == VEC_ROWS)  // the common case: a constant count, unrolled
          vec_step(tile, xs, K, VEC_ROWS, acc);
        else
          vec_step(tile, xs, K, rows, acc);
      }
      for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(c[r], acc[r][0]);
        _mm512_storeu_ps(c[r] + 16, acc[r][1]);
      }
      panel_out(c, rows, mb, p, N, bias, y, y_dtype, accumulate);
    }
  }
}

// Sharing a product's panels among the threads of a parallel region. Each thread owns a
// contiguous run of panels (thread_panels), streamed from the front so that its weights
// come as one prefetched run; one that is done takes panels from the back of the others'
// runs. On these shared machines one core can run at half the speed of the other for
// seconds, and with fixed halves the fast thread would wait at the barrier. A run is one word, next << 32 | end, changed by compare-and-swap
// only, so owner and thief never take the same panels. runs: one per thread, each on its
// own cache line, made by new_runs (all empty); every thread sets its own before taking
// from it, and a thief that looks before the owner has finds it empty (a product ends with
// every run empty, and the next starts after a barrier).
struct tw_run {
  _Atomic uint64_t word;
  char pad[56];
};

static tw_run* new_runs(int threads) {
  tw_run* runs = (tw_run*)aligned_alloc(64, sizeof(tw_run) * (size_t)threads);
  for (int t = 0; t < threads; ++t) atomic_init(&runs[t].word, 0);
  return runs;
}

// Takes up to `want` panels from run r, from the front (owner) or the back: [*a, *b).
static int take_panels(tw_run* r, int front, int want, int* a, int* b) {
  uint64_t w = atomic_load(&r->word);
  for (;;) {
    const int next = (int)(w >> 32), end = (int)(w & 0xFFFFFFFFu);
    if (next >= end) return 0;
    const int n = end - next < want ? end - next : want;
    const uint64_t to = front ? (uint64_t)(next + n) << 32 | (uint32_t)end
                              : (uint64_t)next << 32 | (uint32_t)(end - n);
    if (atomic_compare_exchange_weak(&r->word, &w, to)) {
      *a = front ? next : end - n;
      *b = front ? next + n : end;
      return 1;
    }
  }
}

// The product over all N / 32 panels, shared as above (on tiles where tw_tiles, which the
// caller has then configured, else vec_panels); call from every thread of the parallel
// region (which then needs a barrier before reading y).
static void packed_shared(const uint16_t* x, int M, int K, const uint16_t* wp, int N,
                       const float* bias, void* y, int y_dtype, int accumulate, tw_run* runs) {
  int me, nt, p0, p1, a, b;
  team(&me, &nt);
  thread_panels(N / 32, me, nt, &p0, &p1);
  atomic_store(&runs[me].word, (uint64_t)p0 << 32 | (uint32_t)p1);
  const uint16_t* xp = x;  // x as the panels read it: in tile order for tiles
#if defined(TW_AMX_BUILT)
  uint16_t* xt = tw_tiles ? pack_tiles(x, M, K) : NULL;
  if (xt) xp = xt;
#endif
  for (int v = 0; v < nt; ++v) {  // its own run from the front, then the others' backs
    tw_run* r = &runs[(me + v) % nt];
    while (take_panels(r, v == 0, GROUP_PANELS, &a, &b)) {
#if defined(TW_AMX_BUILT)
      if (tw_tiles) {
        amx_panels(xp, M, K, wp, N, a, b, bias, y, y_dtype, accumulate);
        continue;
      }
#endif
      vec_panels(xp, M, K, wp, N, a, b, bias, y, y_dtype, accumulate);
    }
  }
#if defined(TW_AMX_BUILT)
  free(xt);
#endif
}
#endif

static int tw_tiles_granted = 0;

// 1 where the AMX tiles can run: compiled in, and Linux grants this process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as oneDNN asks too).
int tw_amx_init(void) {
#if defined(TW_AMX_BUILT) && defined(SYS_arch_prctl)
  if (!tw_tiles_granted) tw_tiles_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
  tw_tiles = tw_tiles_granted;
  return tw_tiles;
}

// The packed products on tiles (on: where tw_amx_init granted them) or as vector dot
// products (0); returns which. For tests and measurements of the vector path on AMX CPUs.
int tw_use_tiles(int on) {
  tw_tiles = on && tw_tiles_granted;
  return tw_tiles;
}

// How the packed products run here: 2 on AMX tiles, 1 as AVX-512 BF16 dot products, 0 not
// at all (the library was built for a CPU without AVX-512 BF16). Call after tw_amx_init.
int tw_packed_kind(void) {
#if defined(TW_PACKED_BUILT)
  return tw_tiles ? 2 : 1;
#else
  return 0;
#endif
}

// w [N, K] bfloat16 -> out [N * K] in the packed layout above.
void tw_pack_weight(const uint16_t* w, int N, int K, uint16_t* out, int threads) {
  const int steps = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int p = 0; p < N / 32; ++p)
    for (int s = 0; s < steps; ++s)
      for (int t = 0; t < 2; ++t) {
        uint16_t* tile = out + (((int64_t)p * steps + s) * 2 + t) * 512;
        for (int i = 0; i < 16; ++i)
          for (int c = 0; c < 16; ++c)
            for (int e = 0; e < 2; ++e)
              tile[(i * 16 + c) * 2 + e] = w[(int64_t)(32 * p + 16 * t + c) * K + 32 * s + 2 * i + e];
      }
}

// y [M, N] = x [M, K] @ w.T (+ bias [N] float32), x bfloat16 [M, K], w packed by
// tw_pack_weight; y in y_dtype (float32, or bfloat16 rounded to nearest even). Threads take
// contiguous runs of panels. Returns 0, or -1 where the library has no packed products.
int tw_packed_linear(const uint16_t* x, int M, int K, const uint16_t* wp, int N, const float* bias,
                  void* y, int y_dtype, int threads) {
#if defined(TW_PACKED_BUILT)
  if (M <= 0 || N <= 0) return 0;  // an empty product (a prompt chunk that samples nothing)
  tw_run* runs = new_runs(threads);
#pragma omp parallel num_threads(threads)
  {
#if defined(TW_AMX_BUILT)
    if (tw_tiles) tiles_16x64();
#endif
    packed_shared(x, M, K, wp, N, bias, y, y_dtype, 0, runs);
#if defined(TW_AMX_BUILT)
    if (tw_tiles) _tile_release();
#endif
  }
  free(runs);
  return 0;
#else
  (void)x, (void)M, (void)K, (void)wp, (void)N, (void)bias, (void)y, (void)y_dtype, (void)threads;
  return -1;
#endif
}

#if defined(TW_PACKED_BUILT)
// linear_rows for packed weights, inside the decode step's parallel region: xb holds the
// input rows in bfloat16 (stride k); y in y_dtype (TW_F32, or TW_GLU for TW_PACKED_GLU).
static void packed_rows(const tw_linear* L, const uint16_t* xb, void* y, int y_dtype, int B,
                     int accumulate, tw_run* runs) {
  packed_shared(xb, B, L->k, (const uint16_t*)L->w, L->n, L->bias, y, y_dtype, accumulate, runs);
#pragma omp barrier
}
#endif

