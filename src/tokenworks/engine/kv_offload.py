"""The host tier of the prefix cache: full blocks evicted from the KV pool, kept in host
memory and copied back on a later hit instead of computed again.

When the pool needs a block and takes a cached one nobody references (LRU), that block's
K/V rows, in every tensor of the pool and in the pool's own format, are copied here under
the block's prefix-cache key. A later prompt whose prefix reaches that key takes a block,
gets the rows copied back and finds it cached as if it had never left. The tier is bounded
by bytes and drops its least recently stored block first. A block copied back leaves the
tier (if it is evicted again, it is stored again).

On a GPU this is the cheaper memory: host RAM is many times the device's, and copying a
block back over PCIe costs far less than recomputing its tokens. On a CPU the pool and the
tier are both RAM. The tier there is a second budget, beside --kv-cache-memory, that
admission does not reserve for running sequences: it only ever holds blocks nobody is
using, so it keeps more of a returning conversation than the pool alone could.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tokenworks.engine.kv_events import HOST


class HostTier:
    """Evicted blocks by prefix-cache key, each a copy of its rows in every pool tensor."""

    def __init__(self, pool, budget_bytes: int):
        self.pool = pool  # engine.kv_pool.KVPool
        self.block_bytes = pool.nbytes // pool.num_blocks
        self.capacity = budget_bytes // self.block_bytes if self.block_bytes else 0
        self.store: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self.pin = torch.cuda.is_available() and pool.k[0].device.type == "cuda"
        self.offloaded = 0  # blocks stored (since the last reset)
        self.restored = 0  # blocks copied back to the pool
        self.dropped = 0  # blocks the budget pushed out
        self.events = None  # engine/kv_events.py's KVEventLog, where events are published

    @property
    def nbytes(self) -> int:
        """Host bytes the tier holds now."""
        return len(self.store) * self.block_bytes

    def _rows(self, block: int) -> slice:
        bs = self.pool.block_size
        return slice(block * bs, (block + 1) * bs)

    def save(self, block: int, key: bytes) -> None:
        """Pool block `block`, about to be reused, held prefix-cache key `key`: keep it."""
        if self.capacity == 0:
            return
        rows = self._rows(block)
        copies = []
        for t in self.pool.tensors:
            part = t[rows]
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=self.pin)
            host.copy_(part)
            copies.append(host)
        self.keep(key, copies)
        self.offloaded += 1

    def keep(self, key: bytes, copies: list[torch.Tensor]) -> None:
        """Store a block's rows under its key as the newest, dropping the oldest past the
        budget."""
        self.store[key] = copies
        self.store.move_to_end(key)
        if self.events is not None:
            self.events.stored(key, medium=HOST)
        while len(self.store) > self.capacity:
            dropped, _ = self.store.popitem(last=False)
            self.dropped += 1
            if self.events is not None:
                self.events.removed(dropped, HOST)

    def has(self, key: bytes) -> bool:
        return key in self.store

    def take(self, key: bytes) -> list[torch.Tensor]:
        """The rows stored under `key`, out of the tier (write() puts them in the pool)."""
        if self.events is not None:
            self.events.removed(key, HOST)
        return self.store.pop(key)

    def write(self, block: int, copies: list[torch.Tensor]) -> None:
        """Copy a block's stored rows into pool block `block`."""
        rows = self._rows(block)
        for t, host in zip(self.pool.tensors, copies, strict=True):
            t[rows].copy_(host)
        self.restored += 1

    def clear(self) -> None:
        if self.events is not None:
            for key in self.store:
                self.events.removed(key, HOST)
        self.store.clear()

    def reset_counts(self) -> None:
        self.offloaded = self.restored = self.dropped = 0
