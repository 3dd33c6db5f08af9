"""A Llama-family model read into the C kernels' structs (kernels/abi.py): which models the
C forward pass takes (`declines` says why not, in words), the C view of each product, and
ModelStructs, the pointers of every layer and of the model that kernels/forward.py runs."""

from __future__ import annotations

import torch
from torch import nn

from tokenworks.kernels import abi as ck
from tokenworks.kernels.block_linear import BlockEmbedding, BlockLinear
from tokenworks.kernels.products import pack_weight, packed_bias
from tokenworks.ops.linear import DenseForLargeBatches, Int4Linear, Int8Linear, MatvecLinear
from tokenworks.ops.rope import cos_sin_table

MODULES = ("qkv", "o_proj", "gate_up", "down")  # a layer's products, as modules


def f32(t: torch.Tensor | None, keep: list) -> int | None:
    if t is None:
        return None
    t = t.detach().float().contiguous()
    keep.append(t)
    return ck.ptr(t)


def linear_view(
    layer: nn.Module, keep: list, packs: dict | None = None, glu: bool = False
) -> ck.Linear | None:
    """The C view of a dense or int8 layer, or None for one the kernels cannot take.

    packs: where the packed products run (AMX tiles or AVX-512 BF16), a dict to hold the
    packed copies of bfloat16 weights (products.pack_weight, keyed by the weight's address):
    those layers are multiplied on them, in the whole step and in run_batched alike.
    glu: the layer is gate_up, packed for products that end in SwiGLU (ck.PACKED_GLU)."""
    if packs is not None and isinstance(layer, (nn.Linear, MatvecLinear)):
        packed = pack_weight(layer.weight, glu)
        if packed is not None:
            packs[layer.weight.data_ptr()] = packed
            keep.append(packed)
            n, k = layer.out_features, layer.in_features
            bias = packed_bias(layer.bias, glu)
            if bias is not None:
                keep.append(bias)
            code = ck.PACKED_GLU if glu else ck.PACKED
            return ck.Linear(ck.ptr(packed), None, ck.ptr(bias), code, n, k)
    if isinstance(layer, BlockLinear):  # the GGUF file's blocks, as stored
        return layer.c_view()
    if isinstance(layer, DenseForLargeBatches):
        layer = layer.quantized
    n, k = layer.out_features, layer.in_features
    if isinstance(layer, Int4Linear):
        if layer.q4_blocks is None:
            return None
        w, scale, code = layer.q4_blocks, None, ck.Q4
    elif isinstance(layer, Int8Linear):
        w, scale, code = layer.qweight, layer.scale, ck.I8
    elif isinstance(layer, (nn.Linear, MatvecLinear)) and layer.weight.dtype in ck.DTYPE_CODES:
        w, scale, code = layer.weight, None, ck.DTYPE_CODES[layer.weight.dtype]
    else:
        return None
    if not w.is_contiguous():
        return None
    keep.append(w)
    return ck.Linear(ck.ptr(w), f32(scale, keep), f32(layer.bias, keep), code, n, k)


def products_of(layer: nn.Module) -> tuple[str | None, ...]:
    """A layer's four products (MODULES), None for each the C pass leaves to a module: an
    MoE layer's experts (models/moe.py), a latent-attention layer's qkv and o (models/mla.py)."""
    attn = (None, None) if layer.mla is not None else MODULES[:2]
    mlp = (None, None) if layer.moe is not None else MODULES[2:]
    return (*attn, *mlp)


def dense_of(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a layer torch can multiply densely, or None."""
    if isinstance(layer, DenseForLargeBatches):
        return layer.dense_weight, layer.quantized.bias
    if isinstance(layer, (nn.Linear, MatvecLinear)):
        return layer.weight, layer.bias
    return None


def rope_table(model: nn.Module, name: str, rope_spec, spec) -> torch.Tensor:
    """A model's RoPE table as C reads it (float32, contiguous): the model's own where it
    is one already (models/llama.rope_tables), else made afresh."""
    t = getattr(model, name)
    if t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu":
        return t
    cos, sin = cos_sin_table(rope_spec, spec.max_position)
    return cos if name.startswith("cos") else sin


def batched(layer: nn.Module):
    """How run_batched multiplies by a layer: (weight, bias) for dense ones, the layer
    itself for a BlockLinear; None where it cannot."""
    return layer if isinstance(layer, BlockLinear) else dense_of(layer)


# families the C forward pass runs (the MoE ones through run_batched, experts in torch)
ARCHS = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "olmo2", "mixtral",
         "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")  # fmt: skip


def group_windows(spec, layout) -> list[int | None] | None:
    """Each KV group's attention window (None: none), or None where a group's layers differ
    (windows that only mask, in a model whose layers have different ones)."""
    windows = []
    for g in layout.groups:
        found = {spec.window(i) for i in g.layers}
        if len(found) != 1:
            return None
        windows.append(found.pop())
    return windows


def v_pools_of(pool) -> list:
    """Each layer's V pool (None for latent attention, which caches one row in K alone)."""
    return pool.v or [None] * len(pool.k)


def declines(model: nn.Module, pool) -> str:
    """Why the C forward pass cannot run model over pool, in words ("" where it can)."""
    spec = getattr(model, "spec", None)
    if spec is None or spec.arch not in ARCHS:
        name = spec.arch if spec is not None else type(model).__name__
        return f"it has no code for the {name} family (it runs {', '.join(ARCHS)})"
    if spec.mlp_act not in ck.ACTS:
        return f"it has no code for the {spec.mlp_act} activation"
    if spec.residual_scale is not None:
        return "it has no code for a residual multiplier (Granite's)"
    if spec.query_temperature is not None:
        return "it has no code for the queries' temperature (Ministral 3's, Llama 4's)"
    if group_windows(spec, pool.layout) is None:
        return "the layers of a KV group attend over different windows"
    if model.norm.device.type != "cpu":
        return f"it runs on the CPU, not {model.norm.device.type}"
    if ck.DTYPE_CODES.get(pool.k[0].dtype) not in ck.KV_CODES:
        return f"it reads the KV cache in float32, bfloat16, int8 or fp8, not {pool.k[0].dtype}"
    wide = spec.head_dim > 256 or spec.n_heads // spec.n_kv_heads * spec.head_dim > 2048
    if wide and not spec.mla:  # (latent attention's buffers are its own)
        return "its per-group buffers take head_dim up to 256, 2048 values a KV group"
    embed = model.embed
    floats = (torch.float32, torch.bfloat16)
    if not isinstance(embed, BlockEmbedding) and embed.weight.dtype not in floats:
        return f"it reads embeddings in float32 or bfloat16, not {embed.weight.dtype}"
    return ""


class ModelStructs:
    """A built model read once into what the C structs point at: its embedding, RoPE tables,
    float32 copies of the small vectors, each layer's K/V pool; `view` then lays them out
    as the C structs, on the model's own weights or on packed copies. `keep` holds every
    tensor a pointer was taken from, for as long as the structs are used."""

    def __init__(self, model: nn.Module, pool):
        spec = model.spec
        self.model, self.pool, self.spec = model, pool, spec
        if isinstance(model.embed, BlockEmbedding):  # blocks: C dequantises the rows it reads
            embed, embed_code = model.embed.blocks, ck.BLOCKS + model.embed.table.ggml_type
        else:
            embed = model.embed.weight
            embed_code = ck.DTYPE_CODES[embed.dtype]
        keep: list = []
        cos, sin = (rope_table(model, n, spec, spec) for n in ("cos", "sin"))
        keep += [embed, cos, sin, pool]
        local = spec.local_rope  # Gemma 3's windowed layers: their own RoPE base
        lcos = rope_table(model, "cos_local", local, spec) if local else None
        lsin = rope_table(model, "sin_local", local, spec) if local else None
        keep += [lcos, lsin]
        silu = spec.mlp_act == "silu"  # gate_up may end in SwiGLU in the packed product
        norms = [
            (f32(x.input_norm, keep), f32(x.post_norm, keep)) if spec.pre_norms else (None, None)
            for x in model.layers
        ]  # (None: OLMo 2 norms no sublayer's input)
        final_norm = f32(model.norm, keep)
        v_pools = v_pools_of(pool)
        self.embed, self.embed_code, self.keep = embed, embed_code, keep
        self.cos, self.sin, self.local, self.lcos, self.lsin = cos, sin, local, lcos, lsin
        self.silu, self.norms, self.final_norm, self.v_pools = silu, norms, final_norm, v_pools

    def view(self, packs: dict | None):
        """The C structs of every layer and of the model (packs: packed where it can), or
        None where a product has no C view."""
        model, pool, spec, keep = self.model, self.pool, self.spec, self.keep
        local, lcos, lsin = self.local, self.lcos, self.lsin
        norms, v_pools = self.norms, self.v_pools
        layout, silu, cos, sin = pool.layout, self.silu, self.cos, self.sin
        embed, embed_code, final_norm = self.embed, self.embed_code, self.final_norm
        layers = (ck.Layer * spec.n_layers)()
        for i, layer in enumerate(model.layers):
            parts = [
                ck.Linear()  # a module's own (products_of): run_batched calls the module
                if n is None
                else linear_view(getattr(layer, n), keep, packs, silu and n == "gate_up")
                for n in products_of(layer)
            ]
            if any(p is None for p in parts):
                return None
            local_rope = local is not None and layer.rope_table
            (k, k_scale), (v, v_scale) = ck.pool_ptrs(pool.k[i]), ck.pool_ptrs(v_pools[i])
            layers[i] = ck.Layer(
                *norms[i], *parts, k, v,
                q_norm=f32(getattr(layer, "q_norm", None), keep),
                k_norm=f32(getattr(layer, "k_norm", None), keep),
                attn_out_norm=f32(getattr(layer, "attn_output_norm", None), keep),
                mlp_out_norm=f32(getattr(layer, "mlp_output_norm", None), keep),
                cos=ck.ptr(lcos) if local_rope else None,
                sin=ck.ptr(lsin) if local_rope else None,
                group=layout.group_of(i),
                k_scale=k_scale,
                v_scale=v_scale,
                no_rope=int(layer.rope_table is None),
                qk_norm_whole=int(spec.qk_norm_whole),
                sinks=f32(getattr(layer, "sinks", None), keep),
            )  # fmt: skip
        head = linear_view(model.lm_head, keep, packs)
        if head is None:
            return None
        # the embedding's scale (Gemma's sqrt(hidden)), rounded to the model's dtype
        scale = 0.0 if spec.embed_scale is None else float(
            torch.tensor(spec.embed_scale, dtype=model.norm.dtype))
        return layers, ck.Model(
            ck.ptr(embed), embed_code, final_norm, head, ck.ptr(cos), ck.ptr(sin),
            scale, ck.ACTS[spec.mlp_act],
        )  # fmt: skip
