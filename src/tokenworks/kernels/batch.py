"""One flat batch of the paged engine, laid out as the C paths read it.

The C kernels read decode tokens' keys and values straight through each sequence's block
table, so a decode row needs only its table, its context length and the slot its new
token is written to; a prompt chunk needs the slots of every key it attends to (its
context, then its own rows), as the torch path does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenworks.ops.attention import context_slots, window_start


@dataclass
class KernelBatch:
    query_lens: list[int]  # new tokens of each sequence, in batch order
    slot_mapping: torch.Tensor  # [T] int64: the pool slot each new token is written to
    decode_rows: torch.Tensor  # [B] int64: each decode token's row in the flat batch
    block_tables: torch.Tensor  # [B, max_blocks] int64, zero-padded
    context_lens: torch.Tensor  # [B] int64: keys each decode token attends to, itself included
    block_size: int
    chunks: list[tuple[int, int, torch.Tensor]]  # prompt chunks: (first row, rows, key slots)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        tables: list[list[int]],
        block_size: int,
        window: int | None = None,  # the tables give back blocks behind this window
        rows_alone: bool = False,
    ) -> KernelBatch:
        """Decode rows read their tables from the window's start in C; a prompt chunk
        gathers the keys from its first token's window on (all of them without one).
        rows_alone: every token is a row read through its table, seeing the keys up to its
        own, as a decode token at its position would (the batch-invariant whole step)."""
        slots: list[int] = []
        rows, dec_tables, dec_lens, chunks = [], [], [], []
        start = 0
        for n, ctx, table in zip(query_lens, context_lens, tables, strict=True):
            if rows_alone:
                for i, pos in enumerate(range(ctx, ctx + n)):
                    slots.append(table[pos // block_size] * block_size + pos % block_size)
                    rows.append(start + i)
                    dec_tables.append(table)
                    dec_lens.append(pos + 1)
            elif n == 1:  # a decode token (or a one-token prompt): read through its table
                slots.append(table[ctx // block_size] * block_size + ctx % block_size)
                rows.append(start)
                dec_tables.append(table)
                dec_lens.append(ctx + 1)
            else:
                first = window_start(ctx, window)
                index = context_slots(table, ctx + n, block_size, first)
                slots.extend(index[ctx - first :].tolist())
                chunks.append((start, n, index))
            start += n
        width = max((len(t) for t in dec_tables), default=0)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.long)
        return cls(
            list(query_lens),
            torch.tensor(slots, dtype=torch.long),
            torch.tensor(rows, dtype=torch.long),
            padded.reshape(len(dec_tables), width),
            torch.tensor(dec_lens, dtype=torch.long),
            block_size,
            chunks,
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def decode_only(self) -> bool:
        """Every row a decode token."""
        return decode_only(self.query_lens)


def decode_only(query_lens: list[int]) -> bool:
    """Whether a batch of these query lengths is decode tokens only (each read through its
    block table), known before the batch is laid out."""
    return bool(query_lens) and all(n == 1 for n in query_lens)
