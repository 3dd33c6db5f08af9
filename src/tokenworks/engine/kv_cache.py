"""Paged KV memory's bookkeeping: block tables, reference counts, copy-on-write.

The pool is sized once from a memory budget. A sequence owns a block table (the list of
block ids that hold its tokens' keys and values, in order); token position p lives in slot
`table[p // block_size] * block_size + p % block_size` of the flat pool. Memory is
committed one block at a time as a sequence grows, instead of reserving its whole
possible length up front the way a contiguous cache must.

Blocks are shared by reference count: a prefix-cache hit or a fork (parallel sampling
with n > 1) points several tables at the same block. Writing into a shared block copies
it first (copy-on-write), so a writer never changes what another sequence reads.

The memory itself, per layer, is engine/kv_pool.py's KVPool; this module keeps the
tables and counts over its blocks.
"""

from __future__ import annotations

from collections import deque

from tokenworks.engine.kv_groups import NULL, KVLayout
from tokenworks.engine.prefix_cache import PrefixCache, adapter_of, prefix_hashes


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    """Which blocks are free, who references each, and what each sequence's tables hold.

    The sequence objects it manages carry `block_tables` (one list[int] per layer group of
    the layout, engine/kv_groups.py; empty until the first block), `n_cached` (tokens whose
    K/V are written), `all_ids`, `num_tokens`, `reusable_tokens` (how many may come from
    the prefix cache), `cache_salt`, `block_hashes` and `n_registered` (leading full blocks
    already offered to the prefix cache); with prefix caching, `tokens_hashes` (the block
    hashes without the salt) and `prefix_miss` (why its first admission missed). In a windowed
    group the blocks wholly behind the window are given back once a pass has moved past
    them, and their entries read NULL.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        layout: KVLayout | None = None,  # None: one group that keeps everything
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layout = layout or KVLayout.single(1)
        self.windows = self.layout.windows
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.prefix = PrefixCache() if enable_prefix_caching else None
        self.host = None  # engine.kv_offload.HostTier: where evicted cached blocks go
        self.cow_copies = 0
        self.released = 0  # blocks given back from behind a window
        # blocks handed out at least once: on the CPU, the pool's pages that are resident
        self._touched = bytearray(num_blocks)
        self.touched = 0

    # ------------------------------------------------------------------ counting

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: never used, or cached but unreferenced."""
        return len(self.free) + (len(self.prefix.evictable) if self.prefix else 0)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by live sequences (vLLM's kv_cache_usage)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _tables(self, seq) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        return seq.block_tables

    def _needs_copy(self, table: list[int], n_cached: int) -> bool:
        i = n_cached // self.block_size
        return i < len(table) and table[i] != NULL and self.ref[table[i]] > 1

    def blocks_needed(self, seq, n_new: int) -> int:
        """New blocks that writing n_new more tokens of seq would take (copies included)."""
        want = self.blocks_for(seq.n_cached + n_new)
        tables = seq.block_tables or [[]] * len(self.windows)
        return sum(
            max(want - len(t), 0) + (1 if n_new and self._needs_copy(t, seq.n_cached) else 0)
            for t in tables
        )

    def can_append(self, seq, n_new: int) -> bool:
        return self.blocks_needed(seq, n_new) <= self.num_free

    def room(self, seq) -> int:
        """Tokens seq could append with the blocks free now (copies aside): each group
        grows by the same number of blocks."""
        held = len(seq.block_tables[0]) if seq.block_tables else 0
        return (held + self.num_free // len(self.windows)) * self.block_size - seq.n_cached

    def held(self, seq) -> list[int]:
        """Blocks seq references in each group."""
        return [sum(b != NULL for b in t) for t in seq.block_tables] or [0] * len(self.windows)

    def held_by_group(self, seqs) -> list[int]:
        """Blocks the sequences reference in each group, each shared block once."""
        held: list[set[int]] = [set() for _ in self.windows]
        for seq in seqs:
            for g, table in enumerate(seq.block_tables):
                held[g].update(b for b in table if b != NULL)
        return [len(h) for h in held]

    # ------------------------------------------------------------------ references

    def _take(self) -> int:
        if self.free:
            b = self.free.popleft()
        else:
            evicted = self.prefix.evict() if self.prefix else None
            if evicted is None:
                raise NoFreeBlocksError("the KV block pool is exhausted")
            b, key = evicted
            if self.host is not None:  # its K/V go to host memory before it is reused
                self.host.save(b, key)
        self.ref[b] = 1
        if not self._touched[b]:
            self._touched[b] = 1
            self.touched += 1
        return b

    def _incref(self, b: int) -> None:
        if self.ref[b] == 0 and self.prefix:
            self.prefix.unpark(b)
        self.ref[b] += 1

    def _decref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] < 0:
            raise AssertionError(f"block {b} freed more often than referenced")
        if self.ref[b] == 0:
            if self.prefix and self.prefix.is_cached(b):
                self.prefix.park(b)
            else:  # first out again: its pages are resident, untouched ones stay unpaid
                self.free.appendleft(b)

    @staticmethod
    def _key(h: bytes, group: int) -> bytes:
        """A block's prefix-cache key in a group: the same tokens sit in another block in
        every group."""
        return h if group == 0 else h + group.to_bytes(2, "little")

    # ------------------------------------------------------------------ sequences

    def match_prefix(self, seq) -> int:
        """Point a fresh sequence's tables at cached blocks of its prefix; return tokens hit.

        At most seq.reusable_tokens are reused (the last token must run to give logits, and
        a prompt whose logprobs are asked runs whole). A
        hit of k blocks needs the first k blocks in every global group, and in a windowed
        group the blocks the window of the next token reads.
        """
        if self.prefix is None or any(seq.block_tables):
            return 0
        bs = self.block_size
        usable = seq.reusable_tokens // bs
        seq.block_hashes = prefix_hashes(
            seq.all_ids[: usable * bs], bs, seq.cache_salt, seq.block_hashes[:usable]
        )
        hashes = seq.block_hashes[:usable]
        pinned = self._restore(hashes) if self.host is not None and self.host.store else []
        if len(self.windows) == 1 and self.windows[0] is None:
            found = [self.prefix.lookup(hashes)]
            k = len(found[0])
        else:
            found = [
                [self.prefix.get(self._key(h, g)) for h in hashes] for g in range(len(self.windows))
            ]
            k = self._longest_hit(found)
        seq.prefix_miss = self._why_missed(seq, k, usable, found)
        tables = []
        for window, blocks in zip(self.windows, found, strict=True):
            first = self.layout.first_needed(window, k * bs, bs)
            table = [NULL] * first + blocks[first:k]
            for b in table[first:]:
                self._incref(b)
            tables.append(table)
        seq.block_tables = tables if k else []
        seq.n_cached = k * bs
        for b in pinned:
            self._decref(b)
        return seq.n_cached

    def _restore(self, hashes: list[bytes]) -> list[int]:
        """Copy back from the host tier the leading blocks of this prefix it holds and the
        pool does not, each registered as cached; return every block of the prefix found
        or restored, referenced once more, so that restoring one never evicts another
        (the caller drops those references once it has taken its own)."""
        pinned = []
        for h in hashes:
            for g in range(len(self.windows)):
                key = self._key(h, g)
                b = self.prefix.get(key)
                if b is None and self.host.has(key):
                    # (out of the tier first: taking a block may store an evicted one)
                    rows = self.host.take(key)
                    b = self.adopt(h, g, lambda block, rows=rows: self.host.write(block, rows))
                    if b is None:  # no block to put it in: it stays in the tier
                        self.host.keep(key, rows)
                if b is None:
                    return pinned
                self._incref(b)
                pinned.append(b)
        return pinned

    def _why_missed(self, seq, k: int, usable: int, found: list[list[int | None]]) -> str:
        """Why block k, the first of seq's prompt the cache did not serve, was not found
        (prefix_cache.MISS_REASONS); found: each group's lookups, as match_prefix made them."""
        if k >= usable:
            return "not_full"
        held = [blocks for w, blocks in zip(self.windows, found, strict=True) if w is None]
        if len(found[0]) > k and all(blocks[k] is not None for blocks in held):
            return "window"
        h, cache = seq.block_hashes[k], self.prefix
        if any(self._key(h, g) in cache.evicted for g in range(len(self.windows))):
            return "evicted"
        salt = cache.salt_of.get(self._tokens_hashes(seq, k + 1)[k], seq.cache_salt)
        if salt == seq.cache_salt:
            return "never_cached"
        return "adapter" if adapter_of(salt) != adapter_of(seq.cache_salt) else "salt"

    def _tokens_hashes(self, seq, n: int) -> list[bytes]:
        """The chained hashes of seq's first n full blocks without its cache salt (its
        block hashes, where it has none)."""
        if not seq.cache_salt:
            return seq.block_hashes
        if len(seq.tokens_hashes) < n:
            seq.tokens_hashes = prefix_hashes(
                seq.all_ids[: n * self.block_size], self.block_size, None, seq.tokens_hashes
            )
        return seq.tokens_hashes

    def _longest_hit(self, found: list[list[int | None]]) -> int:
        """The most leading blocks every group can serve from the cache."""
        k = len(found[0])
        last_missing = []  # windowed groups: [i] the last index <= i not cached (-1: none)
        for window, blocks in zip(self.windows, found, strict=True):
            if window is None:
                k = min(k, next((i for i, b in enumerate(blocks) if b is None), len(blocks)))
                continue
            gaps, last = [], -1
            for i, b in enumerate(blocks):
                last = i if b is None else last
                gaps.append(last)
            last_missing.append((window, gaps))
        while k > 0:
            if all(
                gaps[k - 1] < self.layout.first_needed(w, k * self.block_size, self.block_size)
                for w, gaps in last_missing
            ):
                break
            k -= 1
        return k

    def append(self, seq, n_new: int) -> list[tuple[int, int]]:
        """Make room for n_new tokens after seq.n_cached; return (src, dst) blocks to copy."""
        if self.blocks_needed(seq, n_new) > self.num_free:
            raise NoFreeBlocksError(f"{seq.request_id}: not enough free KV blocks")
        copies = []
        want = self.blocks_for(seq.n_cached + n_new)
        for table in self._tables(seq):
            if n_new and self._needs_copy(table, seq.n_cached):
                i = seq.n_cached // self.block_size
                old, new = table[i], self._take()
                copies.append((old, new))
                self._decref(old)
                table[i] = new
                self.cow_copies += 1
            while len(table) < want:
                table.append(self._take())
        return copies

    def commit(self, seq, n_tokens: int) -> None:
        """Make the blocks that n_tokens fill findable by later lookups.

        Called when a chunk is scheduled, before the forward pass: a request admitted later
        in the same step may then share blocks another sequence is computing in this very
        pass. That is safe because each layer writes every new token's K/V into the pool
        before any sequence's attention reads it.
        """
        if self.prefix is None:
            return
        full = n_tokens // self.block_size
        if full > len(seq.block_hashes):
            seq.block_hashes = prefix_hashes(
                seq.all_ids[: full * self.block_size],
                self.block_size,
                seq.cache_salt,
                seq.block_hashes,
            )
        bs, hashes = self.block_size, seq.block_hashes
        for g, table in enumerate(seq.block_tables):
            for i in range(seq.n_registered, full):
                if table[i] != NULL:
                    parent = self._key(hashes[i - 1], g) if i else None
                    tokens = seq.all_ids[i * bs : (i + 1) * bs]
                    self.prefix.register(table[i], self._key(hashes[i], g), parent, tokens)
        if full > seq.n_registered:
            for h in self._tokens_hashes(seq, full)[seq.n_registered : full]:
                self.prefix.remember_salt(h, seq.cache_salt)
        seq.n_registered = max(seq.n_registered, full)

    def forget_seq(self, seq) -> None:
        """Drop the prefix-cache entries of seq's blocks (their content is not to be trusted,
        e.g. the forward pass that was to fill them failed)."""
        if self.prefix is not None:
            for table in seq.block_tables:
                for b in table:
                    if b != NULL:
                        self.prefix.forget(b)
        seq.n_registered = 0

    def forget_touched(self) -> None:
        """Count every block as never handed out (after KVPool.discard gave their pages back)."""
        self._touched = bytearray(self.num_blocks)
        self.touched = 0

    def reset_counts(self) -> None:
        """Copy-on-write, window and prefix-cache counters back to zero, and the misses'
        history forgotten (the blocks are untouched)."""
        self.cow_copies = self.released = 0
        if self.prefix is not None:
            self.prefix.queried_tokens = self.prefix.hit_tokens = self.prefix.evictions = 0
            self.prefix.forget_history()
        if self.host is not None:
            self.host.reset_counts()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody references (they become free); return how many."""
        if self.prefix is None:
            return 0
        parked = list(self.prefix.evictable)
        for b in parked:
            self.prefix.forget(b)
            self.free.appendleft(b)
        if self.host is not None:
            self.host.clear()
        return len(parked)

    def cached(self, h: bytes, group: int) -> int | None:
        """The block the prefix cache holds for full-block hash h in a layer group."""
        return self.prefix.get(self._key(h, group)) if self.prefix else None

    def adopt(self, h: bytes, group: int, fill, parent: bytes | None = None,
              tokens: list[int] | None = None) -> int | None:  # fmt: skip
        """Cache a block whose K/V come from elsewhere (another engine prefilled it, or the
        host tier kept it): take a block, let fill(block) write it, and register it under
        (h, group) unreferenced, for a later prompt to find (parent: the previous block's
        hash; tokens: its own, where known). None where it is cached already or no block
        is free."""
        if self.prefix is None or self.cached(h, group) is not None:
            return None
        try:
            b = self._take()
        except NoFreeBlocksError:
            return None
        fill(b)
        parent = self._key(parent, group) if parent is not None else None
        self.prefix.register(b, self._key(h, group), parent, tokens)
        self._decref(b)  # parked: findable, and evicted first when nobody asks for it
        return b

    def fork(self, parent, child) -> None:
        """child shares every block of parent (parallel sampling): references, not copies."""
        for table in parent.block_tables:
            for b in table:
                if b != NULL:
                    self._incref(b)
        child.block_tables = [list(t) for t in parent.block_tables]
        child.n_cached = parent.n_cached
        child.block_hashes = list(parent.block_hashes)
        child.tokens_hashes = list(parent.tokens_hashes)
        child.n_registered = parent.n_registered

    def computed(self, seq, n_tokens: int) -> None:
        """A forward pass wrote the K/V of seq's next n_tokens into its blocks: in a
        windowed group, the blocks no later token's window reaches go back."""
        seq.n_cached += n_tokens
        for window, table in zip(self.windows, seq.block_tables, strict=True):
            if window is None:
                continue
            # given-back entries are a leading run: walk back from the window's edge
            i = self.layout.first_needed(window, seq.n_cached, self.block_size) - 1
            while i >= 0 and table[i] != NULL:
                self._decref(table[i])
                table[i] = NULL
                self.released += 1
                i -= 1

    def trim(self, seq) -> None:
        """Give back seq's blocks past its cached tokens: those a speculative step took for
        proposals the target rejected (never registered in the prefix cache, which only
        sees real tokens)."""
        keep = self.blocks_for(seq.n_cached)
        for table in seq.block_tables:
            for b in table[keep:]:
                if b != NULL:
                    self._decref(b)
            del table[keep:]

    def free_seq(self, seq) -> None:
        """seq gives back its blocks (cached ones stay findable) and holds no K/V."""
        for table in seq.block_tables:
            for b in table:
                if b != NULL:
                    self._decref(b)
        seq.block_tables = []
        seq.n_registered = 0
        seq.n_cached = 0

    def check(self, seqs=None) -> None:
        """Invariants (for tests): every block is free, parked or referenced, exactly once;
        with the live sequences given, each block's references are its table entries, and
        no windowed group holds more than its window needs (ceil(window / block_size) + 1
        blocks once a pass has run)."""
        free = set(self.free)
        parked = set(self.prefix.evictable) if self.prefix else set()
        assert len(free) == len(self.free), "a block is on the free list twice"
        assert not free & parked, "a block is both free and parked"
        for b in range(self.num_blocks):
            state = (b in free) + (b in parked) + (self.ref[b] > 0)
            assert state == 1, f"block {b}: free={b in free} parked={b in parked} ref={self.ref[b]}"
        if seqs is None:
            return
        counts = [0] * self.num_blocks
        for s in seqs:
            for table in s.block_tables:
                for b in table:
                    if b != NULL:
                        counts[b] += 1
        assert counts == self.ref, "reference counts differ from the tables' entries"
        for s in seqs:
            for window, held in zip(self.windows, self.held(s), strict=True):
                if window is not None:
                    cap = self.blocks_for(window) + 1
                    assert held <= cap, f"{s.request_id}: {held} blocks in a {window}-token window"
