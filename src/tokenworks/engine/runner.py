"""ModelRunner: turns the scheduled sequences into one flat batch and runs it.

The batch runs on the C kernels where they are open for this engine and take it
(kernels/backend.py), else through the torch model over the same paged pool.
"""

from __future__ import annotations

import torch

from tokenworks.engine.sampler import ForwardOutput
from tokenworks.engine.scheduler import ScheduledSeq
from tokenworks.ops.attention import AttentionMetadata


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool,  # engine.kv_cache.KVPool
        block_size: int,
        device: str,
        batch_decode: bool = True,
        kernels=None,  # kernels.CKernels, or None: the torch model runs every batch
    ):
        self.model, self.pool, self.block_size = model, pool, block_size
        self.device, self.batch_decode = device, batch_decode
        self.kernels = kernels

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], argmax_only: bool = False) -> ForwardOutput:
        """Feed each sequence its scheduled tokens; return the logits [sampling seqs, V] of
        the sequences whose chunk reaches their last token (the others are mid-prompt and
        sample nothing yet), in batch order and in the dtype the model computes them.
        argmax_only: every sampling row is plain greedy, and a forward path that can may
        hand back each row's argmax instead (the C decode step writes no logits then)."""
        ids, positions, q_lens, ctx_lens, tables, last_rows = [], [], [], [], [], []
        end = 0
        for item in batch:
            s, n = item.seq, item.n_tokens
            ids.extend(s.ids_between(s.n_cached, s.n_cached + n))
            positions.extend(range(s.n_cached, s.n_cached + n))
            q_lens.append(n)
            ctx_lens.append(s.n_cached)
            tables.append(s.block_table)
            end += n
            if item.sample:
                last_rows.append(end - 1)
        ids_t = torch.tensor(ids, device=self.device)
        pos_t = torch.tensor(positions, device=self.device)
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        if self.kernels is not None:
            layout = self.kernels.layout(q_lens, ctx_lens, tables)
            if layout is not None:
                logits, argmax = self.kernels.forward(ids_t, pos_t, layout, rows, argmax_only)
                return ForwardOutput(logits, argmax)
        meta = AttentionMetadata.paged(
            q_lens, ctx_lens, tables, self.block_size, self.device, self.batch_decode
        )
        logits = self.model(ids_t, pos_t, meta, self.pool, logits_rows=rows, float_logits=False)
        return ForwardOutput(logits)

    @torch.inference_mode()
    def run_uncached(self, token_ids: list[int]) -> torch.Tensor:
        """The whole sequence, no cache: logits for every position [n, V] (the slow oracle)."""
        n = len(token_ids)
        return self.model(
            torch.tensor(token_ids, device=self.device),
            torch.arange(n, device=self.device),
            AttentionMetadata.single(n),
            None,
        )
