// CPU kernels in plain C, built with the system compiler on first use and loaded with
// ctypes (kernels/build.py). This file is the one translation unit; each stage lives in
// its own header below, included in this order (later stages use earlier helpers).
//
// Decode reads every weight once per step while doing little arithmetic with it, so its
// cost on a CPU is bytes moved plus, in eager torch, a fixed cost for each of the ~600
// small ops a step launches. `tw_llama_decode` runs a whole Llama-family decode step (the
// embedding, every layer, the final norm and the LM head) in one call and one OpenMP
// parallel region: no per-op dispatch, no intermediate tensors. The residual stream and
// all activations stay in float32; weights are float32, bfloat16, int8 (one scale per
// output row), Q4 blocks or packed bfloat16; K and V live in the paged pool of
// engine/kv_cache.py (float32, bfloat16, or int8 or float8 e4m3 with a scale per row:
// kv_rows.h), read through each sequence's block table.
//
// Weights may also be a GGUF file's own quantised blocks, multiplied as stored with
// activations quantised to 8 bits (block_products.h: `tw_block_linear`, and the same
// products inside the decode step); `tw_stream_read` measures the memory they stream from,
// `tw_product_peak` the most multiply-adds a second the vector units give them.
//
// `tw_paged_attention` is decode attention alone, `tw_latent_attention` that of latent
// attention (DeepSeek's MLA); `tw_packed_linear` multiplies by packed bfloat16 weights (AMX
// tiles or AVX-512 BF16 dot products); `tw_residual_norm`, `tw_swiglu`, `tw_rope_attend`
// and `tw_rope_store` are what lies between torch's products for bigger batches;
// `tw_prefill_attention` attends prompt chunks; `tw_lora_add` adds LoRA adapters' deltas,
// each row its own adapter's.
//
// Vector paths use AVX-512 (BF16 dot products where the CPU has them); every loop has a
// plain C fallback, so the file builds for any CPU the compiler targets.

#include "common.h"
#include "kv_rows.h"
#include "block_products.h"
#include "repacked_products.h"
#include "dot_products.h"
#include "paged_attention.h"
#include "latent_attention.h"
#include "packed_products.h"
#include "decode_step.h"
#include "between_products.h"
#include "prefill_attention.h"
#include "argmax.h"
#include "lora_deltas.h"
#include "stream_read.h"
#include "product_peak.h"
