"""Property-based tests of the block manager: references, copy-on-write, prefix cache, and
layer groups whose windows give blocks back."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenworks.engine.kv_cache import BlockManager, NoFreeBlocksError
from tokenworks.engine.kv_groups import NULL, KVGroup, KVLayout
from tokenworks.engine.prefix_cache import block_hash, prefix_hashes

BS = 4


@dataclass(eq=False)  # identity, like the engine's sequences
class FakeSeq:
    """What the block manager reads of a sequence."""

    all_ids: list[int]
    request_id: str = "s"
    cache_salt: str | None = None
    block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    tokens_hashes: list[bytes] = field(default_factory=list)
    n_registered: int = 0
    n_cached: int = 0
    prefix_miss: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def reusable_tokens(self) -> int:
        return self.num_tokens - 1


def layouts() -> st.SearchStrategy[KVLayout | None]:
    """One group; a global group beside windowed ones; every group windowed."""
    window = st.integers(1, 3 * BS + 1)
    mixed = st.builds(
        lambda w, n: KVLayout(
            (KVGroup((0,), None),) + tuple(KVGroup((i + 1,), w) for i in range(n)), 1
        ),
        window,
        st.integers(1, 2),
    )
    local = st.builds(lambda w: KVLayout((KVGroup((0,), w),), 1), window)
    return st.one_of(st.none(), mixed, local)


class BlockMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans(), layout=layouts())
    def setup(self, num_blocks, caching, layout):
        self.bm = BlockManager(
            num_blocks * (len(layout.groups) if layout else 1), BS, caching, layout
        )
        self.seqs: list[FakeSeq] = []
        self.owner: dict[int, tuple[int, ...]] = {}  # block -> tokens it holds (model of content)

    def _live(self, seq: FakeSeq):
        """(group, index, block) of every block seq's next token may read."""
        for g, table in enumerate(seq.block_tables):
            first = KVLayout.first_needed(self.bm.windows[g], seq.n_cached, BS)
            for i in range(first, len(table)):
                yield g, i, table[i]

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30))
    def admit(self, tokens):
        seq = FakeSeq(list(tokens))
        hit = self.bm.match_prefix(seq)
        assert hit % BS == 0 and hit < seq.num_tokens
        for _, i, b in self._live(seq):  # a hit holds exactly the same tokens
            assert self.owner[b] == tuple(tokens[i * BS : (i + 1) * BS])
        n = seq.num_tokens - seq.n_cached
        if not self.bm.can_append(seq, n):
            self.bm.free_seq(seq)
            return
        self._write(seq, n)
        self.seqs.append(seq)

    def _write(self, seq: FakeSeq, n: int) -> None:
        copies = self.bm.append(seq, n)
        for src, dst in copies:
            self.owner[dst] = self.owner.get(src, ())
        self.bm.commit(seq, seq.n_cached + n)
        start, end = seq.n_cached, seq.n_cached + n
        for table in seq.block_tables:  # the pass writes every new token in every group
            for i in range(start // BS, self.bm.blocks_for(end)):
                self.owner[table[i]] = tuple(seq.all_ids[i * BS : min((i + 1) * BS, end)])
        self.bm.computed(seq, n)  # and the windows move on

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.seqs))
        seq.all_ids.append(token)
        n = seq.num_tokens - seq.n_cached
        if self.bm.can_append(seq, n):
            self._write(seq, n)
        else:
            seq.all_ids.pop()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs))
        child = FakeSeq(list(parent.all_ids))
        self.bm.fork(parent, child)
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule()
    def reset_cache(self):
        self.bm.reset_prefix_cache()
        assert not self.bm.prefix or not self.bm.prefix.evictable

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.bm.free_seq(seq)

    @invariant()
    def references_match_tables(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check(self.seqs)  # references = entries; a window holds <= its blocks + 1
        counts = Counter(b for s in self.seqs for t in s.block_tables for b in t if b != NULL)
        for b in range(self.bm.num_blocks):
            assert self.bm.ref[b] == counts.get(b, 0)
        for s in self.seqs:  # every group spans the same positions
            assert len({len(t) for t in s.block_tables}) <= 1

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        for s in self.seqs:
            for _, i, b in self._live(s):
                assert b != NULL, "a block the window still reads was given back"
                want = tuple(s.all_ids[i * BS : min((i + 1) * BS, s.n_cached)])
                assert self.owner[b][: len(want)] == want

    @invariant()
    def an_idle_pool_is_empty(self):
        if not hasattr(self, "bm") or self.seqs:
            return
        assert self.bm.num_free == self.bm.num_blocks


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_hash_chain_depends_on_parent_tokens_and_salt():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4])
    assert a != block_hash(None, [1, 2, 3, 5])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert a != block_hash(None, [1, 2, 3, 4], salt="tenant")
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [a, block_hash(a, [5, 6, 7, 8])]


def test_lru_evicts_the_least_recently_released_block():
    bm = BlockManager(4, BS)
    seqs = [FakeSeq([i] * BS + [9]) for i in range(3)]
    for s in seqs:  # one after another: each leaves its full block cached, unreferenced
        bm.append(s, s.num_tokens)
        bm.commit(s, s.num_tokens)
        bm.free_seq(s)
    assert bm.num_free == 4
    fresh = FakeSeq([7] * 12)
    bm.append(fresh, 12)  # 3 blocks: the free one, then the two oldest cached
    again = [FakeSeq([i] * BS + [9]) for i in range(3)]
    hits = [bm.match_prefix(s) for s in again]
    assert hits == [0, 0, BS]  # only the most recently released prefix survived


def test_an_exhausted_pool_says_so():
    bm = BlockManager(2, BS, enable_prefix_caching=False)
    with pytest.raises(NoFreeBlocksError):
        bm.append(FakeSeq([1] * 12), 12)


def _decode_to(bm: BlockManager, seq: FakeSeq, n: int) -> None:
    """Feed seq's tokens one pass each until n are cached, as decoding does."""
    while seq.n_cached < n:
        bm.append(seq, 1)
        bm.commit(seq, seq.n_cached + 1)
        bm.computed(seq, 1)


WINDOWED = KVLayout((KVGroup((0,), None), KVGroup((1,), 2 * BS)), 1)


def test_a_window_gives_back_the_blocks_it_no_longer_reads():
    bm = BlockManager(64, BS, layout=WINDOWED)
    seq = FakeSeq(list(range(40)))
    _decode_to(bm, seq, 40)
    held = bm.held(seq)
    assert held[0] == 10  # the global group keeps every block
    assert held[1] <= 2 + 1 and bm.released == 10 - held[1]
    assert seq.block_tables[1][: 10 - held[1]] == [NULL] * (10 - held[1])
    bm.check([seq])
    other = FakeSeq(list(range(8)))
    _decode_to(bm, other, 8)
    # what the engine panel shows per group: each group's blocks, once each
    assert bm.held_by_group([seq, other]) == [held[0] + 2, held[1] + 2]
    bm.free_seq(other)
    bm.free_seq(seq)
    assert bm.num_free == 64


def test_a_prefix_hit_needs_the_blocks_the_window_reads():
    bm = BlockManager(64, BS, layout=WINDOWED)
    first = FakeSeq(list(range(40)))
    _decode_to(bm, first, 40)
    bm.free_seq(first)  # its blocks stay cached, the windowed ones given back earlier too
    again = FakeSeq(list(range(41)))
    assert bm.match_prefix(again) == 40
    assert bm.held(again) == [10, 2]  # the window of position 40 reads blocks 8 and 9
    bm.free_seq(again)
    lost = FakeSeq(list(range(41)))
    gone = bm.prefix.get(bm._key(prefix_hashes(list(range(40)), BS)[8], 1))
    bm.prefix.forget(gone)  # evicted, as the pool does when it needs the block
    bm.free.append(gone)
    assert bm.match_prefix(lost) == 8 * BS  # block 8 of the window is gone: stop before it
    bm.check([lost])


def _run(bm: BlockManager, seq: FakeSeq) -> None:
    """seq's prompt computed in one pass and the sequence freed (its full blocks stay
    cached)."""
    n = seq.num_tokens - seq.n_cached
    bm.append(seq, n)
    bm.commit(seq, seq.num_tokens)
    bm.computed(seq, n)
    bm.free_seq(seq)


def _admitted(bm: BlockManager, tokens, salt: str | None = None) -> FakeSeq:
    seq = FakeSeq(list(tokens), cache_salt=salt)
    bm.match_prefix(seq)
    return seq


def test_a_miss_says_why_its_first_missing_block_was_not_found():
    bm = BlockManager(16, BS)
    prompt = list(range(3 * BS + 1))
    first = _admitted(bm, prompt)
    assert (first.n_cached, first.prefix_miss) == (0, "never_cached")
    _run(bm, first)
    again = _admitted(bm, prompt)  # every full block found; the last token must run
    assert (again.n_cached, again.prefix_miss) == (3 * BS, "not_full")
    _run(bm, again)
    assert _admitted(bm, prompt[: BS - 1]).prefix_miss == "not_full"  # no full block at all
    branch = _admitted(bm, prompt[:BS] + [99] * BS + [1])  # shares one block, then differs
    assert (branch.n_cached, branch.prefix_miss) == (BS, "never_cached")
    bm.free_seq(branch)
    tenant = _admitted(bm, prompt, salt="tenant-b")  # the same tokens, another tenant's
    assert (tenant.n_cached, tenant.prefix_miss) == (0, "salt")
    _run(bm, tenant)
    assert _admitted(bm, prompt, salt="tenant-c").prefix_miss == "salt"
    bm.reset_prefix_cache()
    filler = FakeSeq([7] * (16 * BS))  # takes every block: whatever was cached is evicted
    bm.append(filler, filler.num_tokens)
    bm.free_seq(filler)
    for salt in (None, "tenant-b"):
        gone = _admitted(bm, prompt, salt)
        assert (gone.n_cached, gone.prefix_miss) == (0, "evicted")
        bm.free_seq(gone)


def test_a_miss_in_a_windowed_group_is_the_windows():
    """The windowed group gives a block back as soon as its window has passed, so it waits
    longest among the evictable and goes first: a prompt that branches off later finds
    the global group's blocks and not the window's."""
    bm = BlockManager(64, BS, layout=WINDOWED)
    first = FakeSeq(list(range(40)))
    _decode_to(bm, first, 40)
    bm.free_seq(first)
    filler = FakeSeq([7] * (24 * BS))  # 48 blocks: the 44 never used, then the 4 oldest
    bm.append(filler, filler.num_tokens)
    bm.free_seq(filler)
    branch = _admitted(bm, list(range(4 * BS)) + [99] * 5)
    assert branch.n_cached < 4 * BS and branch.prefix_miss == "window"
    bm.check([branch])


def test_requests_that_could_hit_and_none_do_are_logged_once(caplog):
    from tokenworks.engine.prefix_cache import WARN_AFTER, PrefixCache

    cache = PrefixCache()
    with caplog.at_level("WARNING", logger="tokenworks.engine"):
        for _ in range(WARN_AFTER - 1):
            cache.record_miss("salt")
        cache.record_miss("never_cached")  # (tokens seen by nobody: no sign of a repeat)
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        cache.record_miss("salt")
        cache.record_miss("evicted")
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "none hit" in warning.message and f"salt {WARN_AFTER}" in warning.message


def test_the_miss_history_stays_bounded(monkeypatch):
    from tokenworks.engine import prefix_cache

    monkeypatch.setattr(prefix_cache, "HISTORY", 5)
    bm = BlockManager(2, BS)
    for i in range(20):  # each prompt's block cached, then evicted by the next ones
        _run(bm, FakeSeq([i] * BS + [1]))
    assert len(bm.prefix.evicted) <= 5 and len(bm.prefix.salt_of) <= 5
    assert _admitted(bm, [19] * BS + [1]).prefix_miss == "not_full"  # the newest, cached


def _value(h: bytes) -> float:
    """What the model of a pool writes into a full block of these tokens."""
    return float(int.from_bytes(h[:2], "little"))


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5 * BS), max_size=30),
    budget=st.integers(0, 6),
)
def test_the_host_tier_stays_in_its_budget_and_gives_back_what_it_kept(prompts, budget):
    """Random prompts over a pool of 6 blocks and a host tier of `budget` blocks: the tier
    never holds more, every block a prompt finds (cached or copied back) holds its
    tokens' K/V, and only blocks it kept are restored."""
    import torch

    from tokenworks.engine.kv_offload import HostTier
    from tokenworks.engine.kv_pool import KVPool

    pool = KVPool(1, 6, BS, 1, 1, torch.float32)
    bm = BlockManager(6, BS)
    bm.host = tier = HostTier(pool, budget * pool.nbytes // 6)
    for tokens in prompts:
        seq = FakeSeq(list(tokens))
        bm.match_prefix(seq)
        hashes = prefix_hashes(tokens, BS)
        for i in range(seq.n_cached // BS):
            b = seq.block_tables[0][i]
            assert (pool.k[0][b * BS : (b + 1) * BS] == _value(hashes[i])).all()
        n = seq.num_tokens - seq.n_cached
        if bm.can_append(seq, n):
            bm.append(seq, n)
            bm.commit(seq, seq.num_tokens)
            for i in range(seq.n_cached // BS, len(hashes)):  # the pass writes its blocks
                b = seq.block_tables[0][i]
                for t in pool.tensors:
                    t[b * BS : (b + 1) * BS] = _value(hashes[i])
            bm.computed(seq, n)
        bm.free_seq(seq)
        assert len(tier.store) <= budget and tier.nbytes <= budget * tier.block_bytes
        bm.check()
    assert tier.restored <= tier.offloaded


@pytest.mark.parametrize("tier_blocks", [0, 3])
def test_a_prefix_evicted_to_the_host_tier_is_found_again(tier_blocks):
    import torch

    from tokenworks.engine.kv_offload import HostTier
    from tokenworks.engine.kv_pool import KVPool

    pool = KVPool(1, 6, BS, 1, 1, torch.float32)
    bm = BlockManager(6, BS)
    bm.host = tier = HostTier(pool, tier_blocks * pool.nbytes // 6)
    prompt = list(range(3 * BS + 1))
    _run(bm, _admitted(bm, prompt))
    filler = FakeSeq([7] * (6 * BS))  # takes every block: the prompt's three are evicted
    bm.append(filler, filler.num_tokens)
    bm.free_seq(filler)
    assert tier.offloaded == len(tier.store) == tier_blocks
    again = _admitted(bm, prompt)
    assert again.n_cached == tier_blocks * BS and tier.restored == tier_blocks
    assert again.prefix_miss == ("not_full" if tier_blocks else "evicted")
    bm.check([again])
