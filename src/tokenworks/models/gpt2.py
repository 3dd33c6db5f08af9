"""GPT-2 as plain torch modules: learned positions, pre-LayerNorm blocks, GELU (tanh) MLP.

Hugging Face stores GPT-2's projections as Conv1D, weight [in, out]; we transpose them to
nn.Linear's [out, in] once at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenworks.models.spec import ModelSpec
from tokenworks.ops.attention import AttentionMetadata, attention


class GPT2Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.spec, self.layer = spec, layer
        h = spec.hidden_size
        self.ln_1 = nn.LayerNorm(h, eps=spec.norm_eps)
        q = spec.q_size  # h, or a tensor-parallel rank's heads' share of it
        self.c_attn = nn.Linear(h, 3 * q)
        self.c_proj = nn.Linear(q, h)
        self.ln_2 = nn.LayerNorm(h, eps=spec.norm_eps)
        self.c_fc = nn.Linear(h, spec.intermediate_size)
        self.mlp_proj = nn.Linear(spec.intermediate_size, h)
        self.scale = spec.head_dim**-0.5
        self.attention_tile: int | None = None  # tiled online-softmax attention; None: SDPA

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache):
        s = self.spec
        t = x.shape[0]
        q, k, v = self.c_attn(self.ln_1(x)).view(t, 3, s.n_heads, s.head_dim).unbind(1)
        a = attention(q, k, v, meta, cache, self.layer, self.scale, tile=self.attention_tile)
        x = x + self.c_proj(a)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Model(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.wpe = nn.Embedding(spec.max_position, spec.hidden_size)
        self.blocks = nn.ModuleList(GPT2Block(spec, i) for i in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def load_weights(self, w: dict[str, torch.Tensor]) -> None:
        w = {k.removeprefix("transformer."): v for k, v in w.items()}
        with torch.no_grad():
            self.wte.weight.copy_(w["wte.weight"])
            self.wpe.weight.copy_(w["wpe.weight"])
            self.ln_f.weight.copy_(w["ln_f.weight"])
            self.ln_f.bias.copy_(w["ln_f.bias"])
            for i, b in enumerate(self.blocks):
                p = f"h.{i}."
                for ln in ("ln_1", "ln_2"):
                    getattr(b, ln).weight.copy_(w[p + ln + ".weight"])
                    getattr(b, ln).bias.copy_(w[p + ln + ".bias"])
                for ours, theirs in (
                    ("c_attn", "attn.c_attn"),
                    ("c_proj", "attn.c_proj"),
                    ("c_fc", "mlp.c_fc"),
                    ("mlp_proj", "mlp.c_proj"),
                ):
                    getattr(b, ours).weight.copy_(w[p + theirs + ".weight"].t())  # Conv1D
                    getattr(b, ours).bias.copy_(w[p + theirs + ".bias"])
            self.lm_head.weight = self.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache=None,
        logits_rows: torch.Tensor | None = None,
        float_logits: bool = True,  # False: logits in the weights' dtype (no float32 copy)
        greedy: bool = False,  # (LlamaModel's option; logits here whatever it says)
    ) -> torch.Tensor:
        logits = self.head(self.final_hidden(input_ids, positions, meta, cache, logits_rows))
        return logits.float() if float_logits else logits

    def final_hidden(self, input_ids, positions, meta, cache=None, rows=None) -> torch.Tensor:
        """The hidden states of `rows` (None: all) after the final norm."""
        x = self.wte(input_ids) + self.wpe(positions)
        for b in self.blocks:
            x = b(x, meta, cache)
        if rows is not None:
            x = x[rows]
        return self.ln_f(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)
