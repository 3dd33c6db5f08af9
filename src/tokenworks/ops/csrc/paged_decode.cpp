// Paged decode attention on the CPU: one new query token per sequence attends to its
// context by reading keys and values straight out of the block pool through the
// sequence's block table (no gathered copy). Parallel over (sequence, KV head); the query
// heads that share a KV head (GQA) are handled together so each key is read once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// One row of D values to float32. bfloat16 is the top half of a float32, so a shift does
// it, and the loop vectorises (a per-element c10::BFloat16 conversion does not).
template <typename T>
static inline void to_float(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}
template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t D) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(raw[d]) << 16;
}

static inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

template <typename T>
static void decode_impl(const T* q, const T* k, const T* v, const int64_t* tables,
                        const int64_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                        int64_t D, int64_t max_blocks, int64_t bs, float scale,
                        int64_t window) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, h = i % KVH;
      const int64_t L = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - first;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(b * H + h * G + g) * D + d]) * scale;
      scores.assign(G * n, 0.f);
      for (int64_t l = first; l < L; ++l) {
        const int64_t slot = table[l / bs] * bs + l % bs;
        to_float(k + (slot * KVH + h) * D, row.data(), D);
        for (int64_t g = 0; g < G; ++g)
          scores[g * n + (l - first)] = dot(qf.data() + g * D, row.data(), D);
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the context, in float32
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - mx);
          sum += sg[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = first; l < L; ++l) {
        const int64_t slot = table[l / bs] * bs + l % bs;
        to_float(v + (slot * KVH + h) * D, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + (l - first)];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  });
}

// q [B, H, D]; k_pool, v_pool [S, KVH, D]; block_tables [B, max_blocks] int64;
// context_lens [B] int64 (keys each query attends to, itself included) -> [B, H, D]
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3, "q [B,H,D] and pools [S,KVH,D] expected");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type(), "q and the pool must share a dtype");
  q = q.contiguous();
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1);
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == D, "head shapes do not match");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(),
                          v_pool.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                          lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D,
                          tables.size(1), block_size, static_cast<float>(scale), window);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading K/V through block tables");
}
