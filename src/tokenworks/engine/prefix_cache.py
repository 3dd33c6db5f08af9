"""Prefix caching: full KV blocks found again by the content they hold.

A full block's identity is a chained hash: sha256(parent block's hash, the block's token
ids, an optional isolation salt). Two sequences that share their first k full blocks of
tokens (a system prompt, a few-shot preamble, an earlier turn) therefore share the first k
hashes, and the second one reuses the first one's blocks instead of recomputing them. The
salt keeps tenants apart: the same tokens under a different salt hash differently, so one
tenant can never read (or time) another's cached prefix.

A cached block whose reference count drops to zero is not freed at once: it waits in an
LRU list, still findable, and is evicted (its hash forgotten) only when the pool needs a
block and has no truly free one left.

A request that misses is told why: the first of its prompt's blocks that was not found
has one of MISS_REASONS. To tell them apart the cache remembers, for a bounded number of
blocks, the hashes it evicted and the salt each block's tokens were last cached under.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence

log = logging.getLogger("tokenworks.engine")

_NONE = b"\x00" * 32

# why the first block of a prompt not served from the cache was not:
MISS_REASONS = (
    "never_cached",  # its tokens (after this prefix) were never cached
    "evicted",  # they were, and the block was evicted (or dropped) since
    "salt",  # they are or were cached under another tenant's cache salt
    "adapter",  # they are or were cached by requests of another LoRA adapter (or none)
    "window",  # the layers without a window hold it; a windowed group gave its block
    # back early (its window had passed) and it has gone since
    "not_full",  # no full block is left to find: the rest of the prompt is a partial
    # block, or the block holding the last token, which must run to give logits
)
ADAPTER_MARK = "\x00lora:"  # what joins a LoRA adapter's name to a request's salt
HISTORY = 1 << 16  # blocks remembered for telling the reasons apart
WARN_AFTER = 8  # requests that could have hit, and none did, before the log says so


def adapter_salt(cache_salt: str | None, lora: str | None) -> str | None:
    """A request's prefix-cache salt with its LoRA adapter's name joined to it: the same
    tokens under another adapter (or none) hold other keys and values."""
    return cache_salt if lora is None else f"{cache_salt or ''}{ADAPTER_MARK}{lora}"


def adapter_of(salt: str | None) -> str:
    """The LoRA adapter a prefix-cache salt was made for ("" for the base model)."""
    return salt.partition(ADAPTER_MARK)[2] if salt else ""


def block_hash(parent: bytes | None, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """The chained content hash of one full block."""
    h = hashlib.sha256(parent or _NONE)
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"\x01salt:" + salt.encode())
    return h.digest()


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None, start: list[bytes] = ()
) -> list[bytes]:
    """Hashes of every full block of token_ids, extending an already-computed chain."""
    hashes = list(start)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
    return hashes


def movable_blocks(n_prompt: int, block_size: int) -> int:
    """The full blocks of a prompt another engine can take from this one's cache: all but
    the one holding the last token, which must run there to give its logits."""
    return (n_prompt - 1) // block_size


class PrefixCache:
    """hash -> block id for full blocks, plus the LRU of cached blocks nobody references."""

    def __init__(self) -> None:
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.queried_tokens = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
        self.hit_tokens = 0  # of which found cached (vLLM: prefix_cache_hits)
        self.evictions = 0
        self.misses = dict.fromkeys(MISS_REASONS, 0)  # requests, by why they missed
        self.evicted: OrderedDict[bytes, None] = OrderedDict()  # keys dropped, newest last
        self.salt_of: OrderedDict[bytes, str | None] = OrderedDict()  # tokens' hash -> salt
        self.warned = False
        self.events = None  # engine/kv_events.py's KVEventLog, where events are published

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of leading hashes that are cached."""
        found = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def get(self, h: bytes) -> int | None:
        """The block cached under this hash, if any."""
        return self.by_hash.get(h)

    def record_query(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def record_miss(self, reason: str) -> None:
        """A request's first admission missed for this reason (MISS_REASONS). Once enough
        requests could have hit (their tokens were cached, or are under another salt or
        window) and none did, the log says so, once."""
        self.misses[reason] += 1
        could = self.misses["evicted"] + self.misses["salt"] + self.misses["window"]
        if could >= WARN_AFTER and self.hit_tokens == 0 and not self.warned:
            self.warned = True
            log.warning(
                "prefix caching: %d requests repeated a prefix that was cached and none "
                "hit (first misses: %s)", could,
                ", ".join(f"{r} {n}" for r, n in self.misses.items() if n),
            )  # fmt: skip

    def remember_salt(self, tokens_hash: bytes, salt: str | None) -> None:
        """A block of these tokens (their chained hash without a salt) was cached under
        this salt."""
        _remember(self.salt_of, tokens_hash, salt)

    def forget_history(self) -> None:
        """Forget the misses counted and what the cache held (after the warm-up)."""
        self.misses = dict.fromkeys(MISS_REASONS, 0)
        self.evicted.clear()
        self.salt_of.clear()
        self.warned = False

    def register(
        self, block: int, h: bytes, parent: bytes | None = None, tokens: list[int] | None = None
    ) -> None:
        """A block just became full with this content (its parent's key and its tokens,
        where known, go into its event); make it findable (first one wins)."""
        if h not in self.by_hash and block not in self.hash_of:
            self.by_hash[h] = block
            self.hash_of[block] = h
            self.evicted.pop(h, None)
            if self.events is not None:
                self.events.stored(h, parent, tokens)

    def is_cached(self, block: int) -> bool:
        return block in self.hash_of

    def park(self, block: int) -> None:
        """Its last reference went away: keep it, most recently used last."""
        self.evictable[block] = None
        self.evictable.move_to_end(block)

    def unpark(self, block: int) -> None:
        """Referenced again (a hit): no longer a candidate for eviction."""
        self.evictable.pop(block, None)

    def evict(self) -> tuple[int, bytes] | None:
        """Forget the least recently used unreferenced block and hand it back to be reused,
        with the key it was cached under."""
        if not self.evictable:
            return None
        block, _ = self.evictable.popitem(last=False)
        h = self.hash_of.pop(block)
        del self.by_hash[h]
        _remember(self.evicted, h, None)
        self.evictions += 1
        if self.events is not None:
            self.events.removed(h)
        return block, h

    def forget(self, block: int) -> None:
        """The block's content is about to change (it is being reused): drop its hash."""
        h = self.hash_of.pop(block, None)
        if h is not None and self.by_hash.get(h) == block:
            del self.by_hash[h]
            _remember(self.evicted, h, None)
            if self.events is not None:
                self.events.removed(h)
        self.evictable.pop(block, None)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _remember(memory: OrderedDict, key: bytes, value) -> None:
    """key -> value as the newest of a bounded memory (the oldest go past HISTORY)."""
    memory[key] = value
    memory.move_to_end(key)
    if len(memory) > HISTORY:
        memory.popitem(last=False)
