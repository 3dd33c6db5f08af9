"""Prefill / decode disaggregation's KV transfer: a prompt's full blocks, written by the
engine that prefilled it and read into the prefix cache of the engine that decodes it.

export_prefix runs after a prefill-only request has ended. Its prompt's full blocks are
then parked in the prefill engine's prefix cache, findable by their chained hashes (each
layer group's blocks under its own key). It writes them, block after block, to one file in
shared memory: every pool tensor's rows of the block, K then V, layer by layer, as the
pool holds them. The request's message carries the file's path and each block's hash.

import_prefix runs on the decode engine before the request is added there. It reads the
file block by block into free blocks of its own pool and registers each under its hash,
unreferenced (BlockManager.adopt). The request then finds them as prefix-cache hits, as
it would blocks an earlier request had computed, and runs only the prompt's tail: the
partial last block and the last token, whose logits it samples. So both engines' prefix
caches stay correct: what each holds under a hash is the K/V of exactly those tokens
(and salt), computed by the same model.

Both engines must hold the same model with the same KV layout, block size and dtype; a
block of another size is refused. A file in shared memory moves blocks between processes
of one machine; the router (front/disaggregated.py) deletes it once the decode engine
has taken it.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

import torch

from tokenworks.engine.messages import KVBlocks
from tokenworks.engine.prefix_cache import movable_blocks, prefix_hashes

SHARED_MEMORY = "/dev/shm"  # where it exists; the temporary directory otherwise


def _rows(pool, block: int) -> list[torch.Tensor]:
    """The block's slots in every pool tensor (a contiguous run of rows in each)."""
    bs = pool.block_size
    return [t[block * bs : (block + 1) * bs] for t in pool.tensors]


def block_bytes(pool) -> int:
    return sum(r.numel() * r.element_size() for r in _rows(pool, 0))


def export_prefix(engine, prompt_ids: list[int], cache_salt: str | None) -> KVBlocks:
    """Write the full blocks the decode side can reuse of this prompt (all but the one
    holding its last token, which must run there) from the prefix cache to a file."""
    t0 = time.perf_counter()
    blocks, pool = engine.blocks, engine.pool
    if blocks.prefix is None:
        raise ValueError("exporting a prompt's KV blocks needs the prefix cache")
    bs = blocks.block_size
    usable = movable_blocks(len(prompt_ids), bs)
    found = []  # (hash, group, block)
    for h in prefix_hashes(prompt_ids[: usable * bs], bs, cache_salt):
        for g in range(len(blocks.windows)):
            b = blocks.cached(h, g)
            if b is not None:
                found.append((h, g, b))
    size = block_bytes(pool)
    where = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
    fd, path = tempfile.mkstemp(prefix="tokenworks-kv-", dir=where)
    try:
        if found:
            os.ftruncate(fd, size * len(found))
            with mmap.mmap(fd, size * len(found)) as out:
                for j, (_, _, b) in enumerate(found):
                    _write(pool, b, out, j * size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return KVBlocks(path, [h for h, _, _ in found], [g for _, g, _ in found], size,
                    time.perf_counter() - t0)  # fmt: skip


def import_prefix(engine, kv: KVBlocks) -> int:
    """Read the file's blocks into this engine's prefix cache; the number taken (those
    cached here already, and those past a full pool, are skipped)."""
    blocks, pool = engine.blocks, engine.pool
    if blocks.prefix is None:
        raise ValueError("importing KV blocks needs the prefix cache")
    if kv.block_bytes != block_bytes(pool):
        raise ValueError(
            f"the KV blocks are {kv.block_bytes} bytes and this engine's {block_bytes(pool)}: "
            "the prefill and decode engines must run the same model, dtype and block size"
        )
    if not kv.hashes:
        return 0
    taken = 0
    # (a private mapping: torch takes it as writable, and nothing is copied unless written)
    with open(kv.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as src:
        for j, (h, g) in enumerate(zip(kv.hashes, kv.groups, strict=True)):
            fill = lambda b, at=j * kv.block_bytes: _read(pool, b, src, at)  # noqa: E731
            taken += blocks.adopt(h, g, fill) is not None
    return taken


def _write(pool, block: int, out, at: int) -> None:
    """Copy one block's rows from the pool to byte `at` of the file."""
    for r in _rows(pool, block):
        n = r.numel() * r.element_size()
        dst = torch.frombuffer(out, dtype=torch.uint8, count=n, offset=at)
        dst.copy_(r.contiguous().view(torch.uint8).reshape(-1))
        at += n


def _read(pool, block: int, src, at: int) -> None:
    """Copy one block's rows, from byte `at` of the file, into the pool."""
    for r in _rows(pool, block):
        n = r.numel() * r.element_size()
        data = torch.frombuffer(src, dtype=torch.uint8, count=n, offset=at)
        r.copy_(data.view(r.dtype).view(r.shape))
        at += n
