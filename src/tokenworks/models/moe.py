"""A mixture-of-experts MLP: route each token to a few experts, run them, sum the results.

The router scores every expert for every token (softmax over all, or DeepSeek's sigmoid
with a bias that steers the choice), the top_k run, and their outputs are summed weighted
by the scores. Which experts a batch touches decides what the layer reads: one decode
token reads top_k experts' weights; 64 tokens read nearly all of them.

Three ways to compute the same sum, chosen per batch (`strategy`, or "auto"):
- loop: for each expert a token chose, gather its tokens and run one gated MLP on them
  (a matrix-vector product where an expert has one token, in bfloat16). Reads only the
  experts touched; pays a fixed cost per expert.
- grouped: sort the (token, expert) pairs by expert and run every group in one grouped
  product (torch's `_grouped_mm`: one call, each group against its expert's weights,
  no padding; where torch lacks it, equal-size padded groups in one batched product).
- dense: every expert on every token, the unchosen ones weighted 0. Reads and computes
  everything, in two large products: only for experts so small that the per-expert cost
  is all there is.

With a capacity factor (GShard, Switch), an expert takes at most
ceil(factor x tokens x top_k / n_experts) tokens a batch; the rest of its tokens skip it
(their share of the layer is the residual alone). The drop depends on which other tokens
share the batch: a token's output then depends on its neighbours. Off by default.

Experts a GGUF file stores quantised stay as its blocks (`--quantization gguf`): each
expert is a pair of BlockLinears, and every batch runs the loop (the grouped and dense
products need the experts stacked as floats).

gpt-oss departs in three places: its router has a bias and softmaxes only the top_k
logits it chose; its experts' products have biases; and their gate is clamped
(`swiglu_oai`, see `gated`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenworks.kernels.block_linear import BlockLinear, dense, stored
from tokenworks.kernels.blocks import BlockTensor
from tokenworks.models.spec import ModelSpec
from tokenworks.models.tensor_parallel import all_reduce
from tokenworks.ops.linear import rows_product

STRATEGIES = ("auto", "loop", "grouped", "dense")
# auto runs grouped once a batch touches this many experts and they take this many tokens
# each on average (bench moe, bfloat16): the grouped product saves the loop's per-expert
# cost, which counts with Qwen3-30B-A3B's 128 small experts and not with Mixtral's 8 large
# ones; and the loop's matrix-vector products win while most experts take one token
GROUPED_MIN_EXPERTS = 32
GROUPED_FROM = 2.0


class RoutingStats:
    """Tokens each expert of each MoE layer took in the forward passes since the last take."""

    def __init__(self) -> None:
        self._counts: dict[int, torch.Tensor] = {}
        self.dropped = 0  # (token, expert) pairs a capacity limit turned away

    def record(self, layer: int, counts: torch.Tensor) -> None:
        prev = self._counts.get(layer)
        self._counts[layer] = counts if prev is None else prev + counts

    def take(self) -> np.ndarray | None:
        """[moe layers, experts] int64 token counts since the last take (None: none)."""
        if not self._counts:
            return None
        out = torch.stack([self._counts[k] for k in sorted(self._counts)]).cpu().numpy()
        self._counts.clear()
        return out


def routing_summary(counts: np.ndarray | None) -> dict:
    """What a step's routing did: experts touched and imbalance (max / mean tokens per
    expert), each averaged over the MoE layers; {} for a dense model."""
    if counts is None:
        return {}
    mean = counts.mean(axis=1)
    imbalance = np.where(mean > 0, counts.max(axis=1) / np.maximum(mean, 1e-12), 0.0)
    return {
        "experts_touched": float((counts > 0).sum(axis=1).mean()),
        "imbalance": float(imbalance.mean()),
        "tokens_per_expert": counts.tolist(),
    }


def gated(gate_up: torch.Tensor, m) -> torch.Tensor:
    """An expert's gated activation of its gate and up halves [.., 2I] -> [.., I]: SwiGLU,
    or gpt-oss's: gate clamped above at the limit, up to +-limit, then
    gate * sigmoid(alpha gate) * (up + 1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if m.act == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=m.swiglu_limit)
    up = up.clamp(-m.swiglu_limit, m.swiglu_limit)
    return gate * torch.sigmoid(gate * m.swiglu_alpha) * (up + 1)


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        m = spec.moe
        self.m, self.layer = m, layer
        e, h, inter = m.n_experts, spec.hidden_size, m.intermediate
        self.router = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.router_bias = (
            nn.Parameter(torch.zeros(e), requires_grad=False) if m.router_bias else None
        )
        # the experts this module holds (expert parallelism: a rank's share, their
        # outputs added across ranks by `parallel`'s all-reduce); the router scores all
        self.first, last = m.local_experts or (0, e)
        e = self.local = last - self.first
        self.parallel = None  # models.tensor_parallel.Shard where experts are split
        self.score_bias = (
            nn.Parameter(torch.zeros(e), requires_grad=False) if m.score_bias else None
        )
        # experts stacked: [E, 2I, h] (gate rows, then up rows) and [E, h, I]
        self.gate_up = nn.Parameter(torch.empty(e, 2 * inter, h), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, inter), requires_grad=False)
        # gpt-oss: the experts' biases, [E, 2I] (gate, then up) and [E, h]
        self.gate_up_bias = self.down_bias = None
        if m.expert_bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(e, 2 * inter), requires_grad=False)
            self.down_bias = nn.Parameter(torch.zeros(e, h), requires_grad=False)
        s = m.shared_intermediate
        self.shared_gate_up = nn.Linear(h, 2 * s, bias=False) if s else None
        self.shared_down = nn.Linear(s, h, bias=False) if s else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if m.shared_gate else None
        self.strategy = "auto"
        self.capacity_factor: float | None = None
        self.tile: int | None = None  # batch-invariant mode: products over fixed row tiles
        self.stats: RoutingStats | None = None
        # a GGUF's quantised experts as stored: (gate_up, down) BlockLinears per expert
        self.blocks: nn.ModuleList | None = None

    def load(self, w: dict, p: str) -> None:
        """Copy weights named p + "mlp.*" in (engine names: models/arch); experts stored as
        GGUF BlockTensors are kept as they are (self.blocks)."""
        self.router.copy_(dense(w[p + "mlp.gate.weight"]))
        if self.router_bias is not None:
            self.router_bias.copy_(dense(w[p + "mlp.gate.bias"]))
        if self.score_bias is not None:
            self.score_bias.copy_(dense(w[p + "mlp.gate.e_score_correction_bias"]))
        experts = [f"{p}mlp.experts.{j}." for j in range(self.first, self.first + self.local)]
        names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        if self.gate_up_bias is not None:
            for j, x in enumerate(experts):
                self.gate_up_bias[j].copy_(
                    torch.cat([dense(w[x + n]) for n in ("gate_proj.bias", "up_proj.bias")])
                )
                self.down_bias[j].copy_(dense(w[x + "down_proj.bias"]))
        if all(isinstance(w[x + n], BlockTensor) for x in experts for n in names):
            self.gate_up = self.down = None  # never allocated: the blocks are the experts
            gu_b, d_b = self.gate_up_bias, self.down_bias
            self.blocks = nn.ModuleList(
                nn.ModuleList([
                    BlockLinear([w[x + n] for n in names[:2]],
                                None if gu_b is None else gu_b[j].clone()),
                    BlockLinear([w[x + names[2]]], None if d_b is None else d_b[j].clone()),
                ])
                for j, x in enumerate(experts)
            )  # fmt: skip
        else:
            for j, x in enumerate(experts):
                self.gate_up[j].copy_(torch.cat([dense(w[x + n]) for n in names[:2]]))
                self.down[j].copy_(dense(w[x + names[2]]))
        if self.shared_gate_up is not None:
            x = p + "mlp.shared_experts."
            self.shared_gate_up = stored(self.shared_gate_up, [w[x + n] for n in names[:2]])
            self.shared_down = stored(self.shared_down, [w[x + names[2]]])
        if self.shared_gate is not None:
            self.shared_gate.weight.copy_(dense(w[p + "mlp.shared_expert_gate.weight"]))

    # ------------------------------------------------------------------ routing

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (weights [T, k] float32, expert ids [T, k])."""
        m = self.m
        logits = rows_product(x.float(), self.router.float(), self.tile)  # [T, E]
        if self.router_bias is not None:
            logits = logits + self.router_bias.float()
        if m.scoring == "topk_softmax":  # gpt-oss: the chosen logits alone, softmaxed
            top = logits.topk(m.top_k, dim=-1)
            return top.values.softmax(dim=-1) * m.routed_scaling_factor, top.indices
        if m.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            choice = scores
        else:
            scores = logits.sigmoid()
            choice = scores if self.score_bias is None else scores + self.score_bias.float()
        if m.n_group > 1:  # keep the experts of the topk_group best groups
            t = x.shape[0]
            grouped = choice.view(t, m.n_group, -1)
            best = (
                grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
                if m.group_scoring == "top2"
                else grouped.amax(dim=-1)
            )  # [T, G]
            keep = torch.zeros_like(best, dtype=torch.bool)
            keep.scatter_(1, best.topk(m.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], 1), -math.inf)
        ids = choice.topk(m.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, ids

    def _capacity(self, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """weights with each expert's pairs beyond its capacity set to 0: first choices
        before second ones, earlier tokens before later ones (GShard's priority)."""
        t, k = ids.shape
        cap = math.ceil(self.capacity_factor * t * k / self.m.n_experts)
        order = ids.t().reshape(-1)  # slot-major: every token's first choice first
        onehot = F.one_hot(order, self.m.n_experts)  # [k*T, E]
        place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # this pair's place in its expert
        kept = (place < cap).view(k, t).t()
        if self.stats is not None:
            self.stats.dropped += int((~kept).sum())
        return weights * kept

    # ------------------------------------------------------------------ strategies

    def pick(self, counts: torch.Tensor) -> str:
        """The strategy for a batch routed as counts [E] (tokens per expert): see the
        module docstring; measured by `tokenworks bench moe`."""
        if self.blocks is not None:
            return "loop"  # the only one that runs on each expert's own weights
        if self.strategy != "auto":
            return self.strategy
        if self.tile is not None:
            return "loop"  # the only one computed row by row in fixed tiles
        pairs, touched = int(counts.sum()), int((counts > 0).sum())
        if touched < GROUPED_MIN_EXPERTS or pairs < GROUPED_FROM * touched:
            return "loop"
        return "grouped"

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.blocks is not None:  # (their biases are the BlockLinears')
            gate_up, down = self.blocks[e]
            return down(gated(gate_up(x), self.m))
        if x.shape[0] == 1 and self.tile is None and x.dtype == torch.bfloat16:
            # one row: torch.mv streams bfloat16 weights faster than a 1-row product
            gu = self._biased(torch.mv(self.gate_up[e], x[0])[None], self.gate_up_bias, e)
            return self._biased(torch.mv(self.down[e], gated(gu, self.m)[0])[None],
                                self.down_bias, e)  # fmt: skip
        gu = self._biased(rows_product(x, self.gate_up[e], self.tile), self.gate_up_bias, e)
        return self._biased(rows_product(gated(gu, self.m), self.down[e], self.tile),
                            self.down_bias, e)  # fmt: skip

    @staticmethod
    def _biased(y: torch.Tensor, bias, e) -> torch.Tensor:
        """y plus expert e's row of bias (e: an int, or a tensor of each row's expert, shaped
        to broadcast against y's leading dimensions)."""
        return y if bias is None else y + bias[e].to(y.dtype)

    def _pairs_by_expert(self, weights, ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, expert) pairs of this module's experts, sorted by expert: (each
        pair's token, its weight, tokens per local expert [local])."""
        flat, w = ids.reshape(-1), weights.reshape(-1)
        token = torch.arange(flat.numel(), device=ids.device) // ids.shape[1]
        if self.local != self.m.n_experts:  # expert parallel: the pairs of our experts
            mine = (flat >= self.first) & (flat < self.first + self.local)
            flat, w, token = flat[mine] - self.first, w[mine], token[mine]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.local)
        return token[order], w[order], counts

    def _loop(self, x, weights, ids) -> torch.Tensor:
        token, w, counts = self._pairs_by_expert(weights, ids)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows, rw = token[start : start + n], w[start : start + n, None]
                if self.m.weighted_inputs:
                    y = self._expert(x.index_select(0, rows) * rw, e)
                else:
                    y = self._expert(x.index_select(0, rows), e) * rw
                out.index_add_(0, rows, y)
            start += n
        return out

    def _grouped(self, x, weights, ids) -> torch.Tensor:
        token, w, counts = self._pairs_by_expert(weights, ids)
        xs = x.index_select(0, token)  # the pairs' tokens, grouped by expert
        w = w.to(x.dtype)[:, None]
        if self.m.weighted_inputs:
            xs, w = xs * w, 1
        # torch's grouped product: every dtype on the CPU, bfloat16 on CUDA
        if hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
            ends = torch.cumsum(counts, 0).to(torch.int32)
            expert = torch.repeat_interleave(torch.arange(self.local, device=x.device), counts)
            gu = torch._grouped_mm(xs, self.gate_up.transpose(1, 2), offs=ends)
            gu = self._biased(gu, self.gate_up_bias, expert)
            ys = torch._grouped_mm(gated(gu, self.m), self.down.transpose(1, 2), offs=ends)
            ys = self._biased(ys, self.down_bias, expert)
        else:
            ys = self._padded_groups(xs, counts)
        out = torch.zeros_like(x)
        out.index_add_(0, token, ys * w)
        return out

    def _padded_groups(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The grouped product as one batched product over the touched experts' groups,
        each padded to the largest (the weights of those experts gathered first)."""
        hit = torch.nonzero(counts).squeeze(1)
        n = counts[hit]
        width = int(n.max())
        group = torch.repeat_interleave(torch.arange(len(hit), device=xs.device), n)
        slot = (
            group * width
            + torch.arange(len(xs), device=xs.device)
            - (torch.cumsum(n, 0) - n)[group]
        )
        padded = xs.new_zeros(len(hit) * width, xs.shape[1])
        padded[slot] = xs
        padded = padded.view(len(hit), width, -1)
        gu = self._biased(torch.bmm(padded, self.gate_up[hit].transpose(1, 2)),
                          self.gate_up_bias, hit[:, None])  # fmt: skip
        ys = self._biased(torch.bmm(gated(gu, self.m), self.down[hit].transpose(1, 2)),
                          self.down_bias, hit[:, None])  # fmt: skip
        return ys.view(len(hit) * width, -1)[slot]

    def _dense(self, x, weights, ids) -> torch.Tensor:
        if self.m.weighted_inputs:  # (each expert would read inputs of its own)
            return self._grouped(x, weights, ids)
        token, w, counts = self._pairs_by_expert(weights, ids)
        expert = torch.repeat_interleave(torch.arange(self.local, device=x.device), counts)
        dense = torch.zeros(x.shape[0], self.local, dtype=x.dtype, device=x.device)
        dense.index_put_((token, expert), w.to(x.dtype), accumulate=True)  # 0: unchosen
        every = torch.arange(self.local, device=x.device)[:, None]  # each expert's rows
        gu = torch.matmul(x, self.gate_up.transpose(1, 2))  # [E, T, 2I]
        gu = self._biased(gu, self.gate_up_bias, every)
        ys = torch.matmul(gated(gu, self.m), self.down.transpose(1, 2))  # [E, T, h]
        ys = self._biased(ys, self.down_bias, every)
        return torch.einsum("eth,te->th", ys, dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, h] -> [T, h]
        weights, ids = self.route(x)
        if self.capacity_factor is not None:
            weights = self._capacity(weights, ids)
        kept = ids[weights != 0] if self.capacity_factor is not None else ids
        counts = torch.bincount(kept.reshape(-1), minlength=self.m.n_experts)
        if self.stats is not None:
            self.stats.record(self.layer, counts)
        run = {"loop": self._loop, "grouped": self._grouped, "dense": self._dense}
        out = run[self.pick(counts)](x, weights, ids)
        if self.shared_gate_up is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            shared = self.shared_down(F.silu(gate) * up)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        if self.parallel is not None:  # each rank's experts and slice of the shared ones
            all_reduce(out, self.parallel.group, self.parallel.comms)
        return out
