"""--compile: each decoder layer's dense work through torch.compile, attention left eager.

A layer is cut at its attention, as vLLM's piecewise compilation cuts it: the part before
(input norm, QKV, Q/K norms, RoPE) and the part after (output projection, norms, residuals,
MLP) are traced by Dynamo and compiled by Inductor (on the CPU into C++ with OpenMP; on
CUDA into Triton kernels), which fuses the elementwise work (norms, RoPE, SiLU x up,
residual adds) into the products' neighbours and removes most per-op dispatch. Attention
reads and writes the paged pool through block tables whose shapes change every step, so
it stays eager. Shapes are marked dynamic: one graph serves every token count (Dynamo
still specialises a count of 1, so batch-1 decode has its own graph), and every layer
shares the same code, so a serving run compiles a handful of graphs, not one a batch.

Dynamo's guards decide when a graph may be reused; when one fails (a new dtype, a count of
1 after larger ones) it recompiles, which torch's own `recompiles` log names and which
CompileStats counts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tokenworks.models.llama import LlamaLayer

log = logging.getLogger(__name__)


def compile_layers_(model: torch.nn.Module) -> int:
    """Give each Llama-shaped layer without experts or latent attention compiled halves
    (LlamaLayer.compiled); the number of layers compiled."""
    torch._logging.set_logs(recompiles=True)  # a failed guard's reason, in the log
    n = 0
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, LlamaLayer) and layer.mla is None and layer.moe is None:
            layer.compiled = (
                torch.compile(layer._before_attention, dynamic=True),
                torch.compile(layer._projected, dynamic=True),
            )
            n += 1
    return n


def graphs() -> int:
    """Graphs Dynamo has compiled in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@dataclass
class CompileStats:
    """What compilation cost an engine: graphs built and the seconds of the steps that
    built them (tracing and Inductor's code generation, with that step's own run)."""

    layers: int = 0
    graphs: int = 0
    seconds: float = 0.0
    tokens_of_new_graphs: list = field(default_factory=list)  # the step sizes that compiled

    def around(self, tokens: int, run):
        """run() (one forward pass of `tokens` tokens), counting the graphs it built."""
        before = graphs()
        t = time.perf_counter()
        out = run()
        new = graphs() - before
        if new:
            self.graphs += new
            self.seconds += time.perf_counter() - t
            self.tokens_of_new_graphs.append(tokens)
            log.info("torch.compile: %d new graph(s) for a step of %d tokens (%d in all, "
                     "%.1f s compiling)", new, tokens, self.graphs, self.seconds)  # fmt: skip
        return out

    def to_dict(self) -> dict:
        return {
            "layers": self.layers,
            "graphs": self.graphs,
            "seconds": self.seconds,
            "tokens_of_new_graphs": list(self.tokens_of_new_graphs),
        }
