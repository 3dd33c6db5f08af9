"""Property-based tests of the block manager: references, copy-on-write, prefix cache."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenworks.engine.kv_cache import BlockManager, NoFreeBlocksError
from tokenworks.engine.prefix_cache import block_hash, prefix_hashes

BS = 4


@dataclass(eq=False)  # identity, like the engine's sequences
class FakeSeq:
    """What the block manager reads of a sequence."""

    all_ids: list[int]
    request_id: str = "s"
    cache_salt: str | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    n_registered: int = 0
    n_cached: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)


class BlockMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.bm = BlockManager(num_blocks, BS, caching)
        self.seqs: list[FakeSeq] = []
        self.owner: dict[int, tuple[int, ...]] = {}  # block -> tokens it holds (model of content)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30))
    def admit(self, tokens):
        seq = FakeSeq(list(tokens))
        hit = self.bm.match_prefix(seq)
        assert hit % BS == 0 and hit < seq.num_tokens
        for i, b in enumerate(seq.block_table):  # a hit holds exactly the same tokens
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
        start = seq.n_cached
        seq.n_cached += n
        for b_index in range(start // BS, self.bm.blocks_for(seq.n_cached)):
            b = seq.block_table[b_index]
            self.owner[b] = tuple(seq.all_ids[b_index * BS : min((b_index + 1) * BS, seq.n_cached)])

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
        self.bm.check()
        counts = Counter(b for s in self.seqs for b in s.block_table)
        for b in range(self.bm.num_blocks):
            assert self.bm.ref[b] == counts.get(b, 0)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        for s in self.seqs:
            for i in range(self.bm.blocks_for(s.n_cached)):
                want = tuple(s.all_ids[i * BS : min((i + 1) * BS, s.n_cached)])
                assert self.owner[s.block_table[i]][: len(want)] == want


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
