"""ModelRunner: turns the scheduled sequences into one flat batch and runs the model."""

from __future__ import annotations

import torch

from tokenworks.engine.sequence import Sequence
from tokenworks.ops.attention import AttentionMetadata, KVCache


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache | None, device: str):
        self.model = model
        self.cache = cache
        self.device = device

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence its uncached tokens; return last-token logits [len(seqs), V]."""
        ids, positions, q_lens, ctx_lens, rows = [], [], [], [], []
        for s in seqs:
            new = s.all_ids[s.n_cached :]
            ids.extend(new)
            positions.extend(range(s.n_cached, s.n_cached + len(new)))
            q_lens.append(len(new))
            ctx_lens.append(s.n_cached)
            rows.append(s.cache_row)
        last_rows = torch.tensor(q_lens).cumsum(0) - 1
        meta = AttentionMetadata(q_lens, ctx_lens, rows)
        logits = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            self.cache,
            logits_rows=last_rows.to(self.device),
        )
        for s, n in zip(seqs, q_lens, strict=True):
            s.n_cached += n
        return logits

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
