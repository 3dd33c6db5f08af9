"""Tensor parallelism (Megatron's split): one model's layers cut across `size` ranks, each
holding only its shard and computing on it, joined by torch.distributed collectives.

Per layer, attention is split by heads and the MLP by its width:

- column-parallel: the QKV product's output rows (each rank's query heads and the KV heads
  they read) and the gate/up product's rows (the same slice of the gate and of the up);
  each rank then attends over its own heads, and applies the activation to its own slice,
  with nothing to exchange;
- row-parallel: the output and down projections take the matching slice of their input
  columns, so each rank's product is a partial sum of the full one, and one all-reduce
  per projection adds them: two all-reduces per layer, of [tokens, hidden] each.

The embedding table and the LM head are split by vocabulary rows (padded to a multiple of
the size): a rank looks up the ids in its range and zeros the rest before an all-reduce,
and the head's logits are gathered from every rank's slice. When there are fewer KV heads
than ranks, each KV head is held by size / kv_heads ranks (replicated), as the planner's
`plan fit --tp` assumes.

The sums of a row-parallel product come in a different order than one process's, so the
logits agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tokenworks.kernels.block_linear import dense
from tokenworks.kernels.blocks import BlockTensor
from tokenworks.models.spec import ModelSpec


@dataclass
class Comms:
    """The messages this rank took part in, by kind (all_reduce, all_gather, send, recv):
    how many, their bytes (as this rank holds them: an all-gather's whole result) and the
    seconds each call took here (waiting for the slowest rank included)."""

    count: dict = field(default_factory=dict)
    nbytes: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def reset(self) -> None:
        self.count, self.nbytes, self.seconds = {}, {}, {}


def all_reduce(x: torch.Tensor, group, comms: Comms | None) -> None:
    """Sum x across the group's ranks, in place, counted in comms."""
    t0 = time.perf_counter()
    dist.all_reduce(x, group=group)
    if comms is not None:
        comms.add("all_reduce", x.numel() * x.element_size(), time.perf_counter() - t0)


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group."""

    rank: int
    size: int
    group: object = None  # a torch.distributed ProcessGroup (None: the default group)
    comms: Comms = field(default_factory=Comms, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.size - 1}")


def check_divisible(spec: ModelSpec, size: int) -> None:
    """Raise, saying what to change, where `size` ranks cannot split this model."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if spec.mla is not None:
        raise ValueError(
            f"tensor parallelism splits Llama-shaped models (MoE ones too) and GPT-2; "
            f"{spec.name or spec.arch}'s latent attention is not split (run it with "
            "--tensor-parallel-size 1)"
        )
    if spec.qk_norm_whole and size > 1:
        raise ValueError(
            f"{spec.name or spec.arch}'s Q/K norms span all heads at once, which tensor "
            "parallelism would split across ranks (run it with --tensor-parallel-size 1)"
        )
    kv = spec.n_kv_heads
    problems = []
    if spec.moe is not None and spec.moe.n_experts % size:
        problems.append(f"its {spec.moe.n_experts} experts")
    if spec.moe is not None and spec.moe.shared_intermediate % size:
        problems.append(f"its shared experts' width {spec.moe.shared_intermediate}")
    if spec.n_heads % size:
        problems.append(f"its {spec.n_heads} query heads")
    if kv % size and size % kv:
        problems.append(f"its {kv} KV heads (nor is the size a multiple of them)")
    if spec.intermediate_size % size:
        problems.append(f"its MLP width {spec.intermediate_size}")
    if problems:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide {' or '.join(problems)}; "
            f"sizes that do: {', '.join(map(str, divisors(spec)))}"
        )


def divisors(spec: ModelSpec) -> list[int]:
    """The tensor-parallel sizes that split this model's heads and MLP evenly."""
    out = []
    moe = spec.moe
    for s in range(1, spec.n_heads + 1):
        kv_ok = spec.n_kv_heads % s == 0 or s % spec.n_kv_heads == 0
        moe_ok = moe is None or (moe.n_experts % s == 0 and moe.shared_intermediate % s == 0)
        if spec.n_heads % s == 0 and spec.intermediate_size % s == 0 and kv_ok and moe_ok:
            out.append(s)
    return out


def vocab_rows(spec: ModelSpec, size: int) -> int:
    """Rows of the embedding and head each rank holds (the vocabulary padded up)."""
    return -(-spec.vocab_size // size)


def shard_spec(spec: ModelSpec, size: int, rank: int = 0) -> ModelSpec:
    """The spec of rank `rank`'s model: its heads, MLP width, vocabulary rows and (MoE)
    its experts and slice of the shared experts."""
    check_divisible(spec, size)
    moe = spec.moe
    if moe is not None:
        per = moe.n_experts // size
        moe = dataclasses.replace(
            moe,
            local_experts=(rank * per, (rank + 1) * per),
            shared_intermediate=moe.shared_intermediate // size,
        )
    return dataclasses.replace(
        spec,
        n_heads=spec.n_heads // size,
        n_kv_heads=max(1, spec.n_kv_heads // size),
        intermediate_size=spec.intermediate_size // size,
        vocab_size=vocab_rows(spec, size),
        moe=moe,
    )


def kv_heads(spec: ModelSpec, shard: Shard) -> range:
    """The KV heads rank `shard.rank` holds: its query heads' groups."""
    per_rank = spec.n_heads // shard.size
    group = spec.n_heads // spec.n_kv_heads  # query heads per KV head
    first = shard.rank * per_rank // group
    return range(first, first + max(1, spec.n_kv_heads // shard.size))


def shard_weights(weights: Mapping, spec: ModelSpec, shard: Shard) -> dict:
    """This rank's slices of the (engine-named) weights; norms and the rest whole. A GGUF
    tensor stays blocks: its rows as a view of the file (only this rank's pages are ever
    read), its columns copied out whole blocks at a time; only a column split that falls
    inside a block is dequantised (that tensor's slice alone)."""
    check_divisible(spec, shard.size)
    if spec.arch == "gpt2":
        return _gpt2_weights(weights, spec, shard)
    r, d = shard.rank, spec.head_dim
    q = _share(spec.q_size, shard)
    heads = kv_heads(spec, shard)
    kv_rows = slice(heads.start * d, heads.stop * d)
    width = _share(spec.intermediate_size, shard)
    vr = vocab_rows(spec, shard.size)
    rows = {
        "self_attn.q_proj": q,
        "self_attn.k_proj": kv_rows,
        "self_attn.v_proj": kv_rows,
        "mlp.gate_proj": width,
        "mlp.up_proj": width,
    }
    cols = {"self_attn.o_proj": q, "mlp.down_proj": width}
    experts = range(spec.moe.n_experts) if spec.moe else range(0)
    if spec.moe is not None:
        per = spec.moe.n_experts // shard.size
        experts = range(r * per, (r + 1) * per)
        shared = _share(spec.moe.shared_intermediate, shard)
        rows |= {"mlp.shared_experts.gate_proj": shared, "mlp.shared_experts.up_proj": shared}
        cols |= {"mlp.shared_experts.down_proj": shared}
    out = {}
    for name in weights:
        base, _, kind = name.rpartition(".")
        product = base.partition(".layers.")[2].partition(".")[2]  # "self_attn.q_proj"
        expert = product.partition("mlp.experts.")[2].partition(".")[0]
        if expert and int(expert) not in experts:
            continue  # another rank's expert
        if product in rows:
            out[name] = _rows(weights[name], rows[product])
        elif product == "self_attn" and kind == "sinks":  # gpt-oss: a logit per query head
            out[name] = _rows(weights[name], _share(spec.n_heads, shard))
        elif product in cols and kind == "weight":
            out[name] = _columns(weights[name], cols[product])
        elif product in cols and r:  # a bias of a split sum: added once, on rank 0
            out[name] = torch.zeros_like(dense(weights[name]))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            # the last rank's rows past the vocabulary: zeros
            out[name] = _rows(weights[name], slice(r * vr, (r + 1) * vr), pad_to=vr)
        else:
            out[name] = weights[name]
    return out


def _gpt2_weights(weights: Mapping, spec: ModelSpec, shard: Shard) -> dict:
    """GPT-2's shard, in its file's names and Conv1D layout ([in, out]): c_attn's q, k and
    v columns of this rank's heads, c_fc's of its MLP width; the rows of the two output
    projections that read them, their biases on rank 0 alone (the all-reduce adds them
    once); the token embedding's (and tied head's) vocabulary rows; positions and norms
    whole."""
    r, h = shard.rank, spec.hidden_size
    heads, width = _share(spec.q_size, shard), _share(spec.intermediate_size, shard)
    qkv = torch.cat([torch.arange(j * h + heads.start, j * h + heads.stop) for j in range(3)])
    vr = vocab_rows(spec, shard.size)
    out = {}
    for name, w in weights.items():
        w = dense(w)
        part = name.removeprefix("transformer.").partition(".")[2]  # after "h"
        product = part.partition(".")[2]  # "attn.c_attn.weight"
        if name.endswith("wte.weight"):
            out[name] = _rows(w, slice(r * vr, (r + 1) * vr), pad_to=vr)
        elif product in ("attn.c_attn.weight", "attn.c_attn.bias"):
            out[name] = w[..., qkv].clone()
        elif product in ("mlp.c_fc.weight", "mlp.c_fc.bias"):
            out[name] = w[..., width].clone()
        elif product == "attn.c_proj.weight":
            out[name] = w[heads].clone()
        elif product == "mlp.c_proj.weight":
            out[name] = w[width].clone()
        elif product in ("attn.c_proj.bias", "mlp.c_proj.bias"):
            out[name] = w if r == 0 else torch.zeros_like(w)
        else:
            out[name] = w
    return out


def _share(total: int, shard: Shard) -> slice:
    """This rank's equal part of `total` rows or columns (heads x head_dim, a width)."""
    part = total // shard.size
    return slice(shard.rank * part, (shard.rank + 1) * part)


def _rows(w, index: slice, pad_to: int | None = None):
    """Rows of a weight (a GGUF tensor's as a view of its blocks), zero rows appended up
    to pad_to."""
    if isinstance(w, BlockTensor):
        part = w.rows(index)
        return part.padded(pad_to) if pad_to and pad_to > part.shape[0] else part
    part = w[index].clone()
    if pad_to and pad_to > part.shape[0]:
        part = torch.cat([part, part.new_zeros(pad_to - part.shape[0], *part.shape[1:])])
    return part


def _columns(w, index: slice):
    """Columns of a weight: a GGUF tensor's whole blocks where the split allows, else
    its slice dequantised."""
    if isinstance(w, BlockTensor):
        part = w.columns(index)
        if part is not None:
            return part
    return dense(w)[:, index].clone()


class RowParallel(nn.Module):
    """A product over a slice of its input columns, its partial sums added across ranks."""

    def __init__(self, inner: nn.Module, shard: Shard):
        super().__init__()
        self.inner, self.shard = inner, shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        all_reduce(y, self.shard.group, self.shard.comms)
        return y


class VocabParallelEmbedding(nn.Module):
    """A slice of the table's rows: ids outside it look up zeros, and the all-reduce gives
    every rank each id's row from the one rank that holds it."""

    def __init__(self, inner: nn.Module, shard: Shard, rows: int):
        super().__init__()
        self.inner, self.shard = inner, shard
        self.first, self.rows = shard.rank * rows, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        inside = (local >= 0) & (local < self.rows)
        x = self.inner(local.clamp(0, self.rows - 1)).masked_fill(~inside.unsqueeze(-1), 0)
        all_reduce(x, self.shard.group, self.shard.comms)
        return x


class VocabParallelHead(nn.Module):
    """Logits of a slice of the vocabulary, gathered from every rank into the whole row."""

    def __init__(self, inner: nn.Module, shard: Shard, vocab: int):
        super().__init__()
        self.inner, self.shard, self.vocab = inner, shard, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.inner(x).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.shard.size)]
        t0 = time.perf_counter()
        dist.all_gather(parts, part, group=self.shard.group)
        seconds = time.perf_counter() - t0
        self.shard.comms.add("all_gather", part.numel() * part.element_size() * len(parts), seconds)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def parallelize_(model: nn.Module, spec: ModelSpec, shard: Shard) -> nn.Module:
    """Wrap a model built from shard_spec and shard_weights with its collectives."""
    rows = vocab_rows(spec, shard.size)
    if spec.arch == "gpt2":
        model.wte = VocabParallelEmbedding(model.wte, shard, rows)
        model.lm_head = VocabParallelHead(model.lm_head, shard, spec.vocab_size)
        for block in model.blocks:
            block.c_proj = RowParallel(block.c_proj, shard)
            block.mlp_proj = RowParallel(block.mlp_proj, shard)
        model.tensor_parallel = shard
        return model
    if model.embed is not None:  # (a later pipeline stage has none)
        model.embed = VocabParallelEmbedding(model.embed, shard, rows)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(model.lm_head, shard, spec.vocab_size)
    for layer in model.layers:
        layer.o_proj = RowParallel(layer.o_proj, shard)
        if layer.moe is not None:  # its experts' outputs and shared slice, all-reduced
            layer.moe.parallel = shard
        else:
            layer.down = RowParallel(layer.down, shard)
    model.tensor_parallel = shard
    return model
