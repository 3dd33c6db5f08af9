"""ModelRunner: turns the scheduled sequences into one flat batch and runs the model."""

from __future__ import annotations

import torch

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
        decode_kernel: bool = False,
    ):
        self.model, self.pool, self.block_size = model, pool, block_size
        self.device, self.batch_decode = device, batch_decode
        self.decode_kernel = decode_kernel

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], greedy: bool = False) -> torch.Tensor:
        """Feed each sequence its scheduled tokens; return logits [sampling seqs, V], in
        the dtype the model computes them (the sampler converts what it needs).

        Rows come back in batch order for the sequences whose chunk reaches their last
        token (the others are mid-prefill and sample nothing yet). greedy: every sampling
        row takes the plain argmax, and the model may return those [sampling seqs] (int64)
        instead of logits (the C decode step does, writing no logits).
        """
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
        meta = AttentionMetadata.paged(
            q_lens,
            ctx_lens,
            tables,
            self.block_size,
            self.device,
            self.batch_decode,
            self.decode_kernel,
        )
        logits = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            self.pool,
            logits_rows=torch.tensor(last_rows, dtype=torch.long, device=self.device),
            float_logits=False,
            greedy=greedy,
        )
        for item in batch:
            item.seq.n_cached += item.n_tokens
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
