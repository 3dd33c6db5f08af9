"""The two ceilings a CPU run is measured against, and a run's share of each.

Decode at batch 1 reads every weight once a token: its ceiling is the memory's read
bandwidth (`kernels.blocks.read_bandwidth`, measured again beside each run), and its share
is bytes a token x tok/s / bandwidth. A prompt multiplies each weight by every token: its
ceiling is the vector units' multiply-add rate for the kind of product the weights take
(`kernels.blocks.product_peaks`: int8 for a GGUF file's blocks, with 8-bit activations;
bfloat16 for bfloat16 weights), and its share is weights multiplied a token x tok/s /
that rate. Both are measured with the run's threads, in the run's process.

Beside the decode share, the step's products alone (every weight read once, nothing
between): how much of a step below the ceiling is the products' and how much the rest's.
"""

from __future__ import annotations

import torch


def machine_ceilings() -> dict:
    """This machine's read bandwidth (bytes/s) and product peaks (multiply-adds/s), with
    torch's thread count; {} without the C kernels."""
    from tokenworks.kernels.blocks import product_peaks, read_bandwidth

    bandwidth = read_bandwidth()
    if bandwidth is None:
        return {}
    return {"read_bandwidth_bytes_s": bandwidth, "product_peak_macs_s": product_peaks()}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held: every parameter and buffer once (RoPE tables
    and the like excluded: they are not weights)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.split(".")[-1] in ("cos", "sin", "cos_local", "sin_local", "probe"):
            continue
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every weight once, except an embedding
    table that is not also the LM head, of which it reads one row."""
    from tokenworks.kernels.block_linear import BlockEmbedding

    total = weight_bytes(model)
    emb = model.embed
    table = emb.blocks if isinstance(emb, BlockEmbedding) else emb.weight
    head = model.lm_head
    shared = {t.data_ptr() for t in list(head.parameters()) + list(head.buffers())}
    if table.data_ptr() not in shared:
        total -= table.numel() * table.element_size() * (1 - 1 / table.shape[0])
    return int(total)


def shares(engine, decode_tok_s: float | None, prefill_tok_s: float | None, ceilings: dict) -> dict:
    """bandwidth_share (decode) and peak_share (prefill, with the peak's kind) of a run of
    engine's model, where the ceilings and the speeds are there."""
    out: dict = {}
    if not ceilings:
        return out
    if decode_tok_s:
        from tokenworks.kernels.blocks import read_bandwidth

        # measured again beside the run: on a shared machine it moves by half within minutes
        bandwidth = read_bandwidth() or ceilings["read_bandwidth_bytes_s"]
        out["read_bandwidth_bytes_s"] = bandwidth
        out["decode_bytes"] = decode_bytes(engine.model)
        out["bandwidth_share"] = decode_tok_s * out["decode_bytes"] / bandwidth
        out |= products_alone(engine, decode_tok_s, out["decode_bytes"], bandwidth)
    quant, dtype = engine.quantization or "none", engine.config.resolved_dtype
    kind = {("gguf", dtype): "int8", ("none", "bfloat16"): "bfloat16"}.get((quant, dtype))
    if prefill_tok_s and kind:
        shape = engine.spec.shape  # the layers' products; the LM head runs once a prompt
        out["macs_per_token"] = shape.matmul_params() - shape.vocab * shape.hidden
        out["peak_kind"] = kind
        out["peak_share"] = (
            prefill_tok_s * out["macs_per_token"] / ceilings["product_peak_macs_s"][kind]
        )
    return out


def products_alone(engine, decode_tok_s: float, nbytes: int, bandwidth: float) -> dict:
    """The decode step's products alone (kernels/products_pass.py) beside the whole step:
    their seconds a token, their share of the read bandwidth, and the step's seconds
    outside them; {} where the C kernels do not run the model."""
    from tokenworks.kernels.products_pass import products_pass_seconds

    kernels = engine.c_kernels
    seconds = products_pass_seconds(kernels.forward_pass) if kernels is not None else None
    if not seconds:
        return {}
    return {
        "products_s": seconds,
        "products_bandwidth_share": nbytes / seconds / bandwidth,
        "outside_products_s": 1 / decode_tok_s - seconds,
    }
