"""A draft model: a smaller model with the target's tokenizer guesses k tokens, one
batched forward pass per token, over its own paged KV pool.

Each target sequence has a shadow here (DraftState) holding the drafter's block table.
A round first feeds the drafter whatever real tokens it has not seen (the whole prompt the
first time, then the tokens the target accepted), then its own guesses one at a time.
After the target's verdict the shadow rolls back to the tokens that really happened, and
the blocks past them go back to the drafter's pool.
"""

from __future__ import annotations

import torch

from tokenworks.engine.kv_cache import BlockManager
from tokenworks.engine.kv_pool import KVPool
from tokenworks.engine.runner import ModelRunner
from tokenworks.engine.sampler import distribution
from tokenworks.engine.scheduler import ScheduledSeq


class DraftState:
    """The drafter's view of one target sequence: what BlockManager and ModelRunner read."""

    def __init__(self, seq):
        self.seq = seq
        self.request_id, self.cache_salt = seq.request_id, None
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[bytes] = []
        self.n_registered = 0
        self.n_cached = 0
        self.base = 0  # where the guesses fed this round start (the real length then)
        self.guesses: list[int] = []  # guesses fed to the drafter past the real tokens

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.guesses)

    @property
    def reusable_tokens(self) -> int:
        return self.num_tokens - 1

    def prompt_rows(self, n: int) -> range:
        return range(0)  # the drafter reports no prompt logprobs and pools nothing

    pooled_rows = prompt_rows

    def ids_between(self, start: int, end: int) -> list[int]:
        real = self.seq.num_tokens
        ids = self.seq.ids_between(start, min(end, real))
        return ids + self.guesses[max(0, start - real) : max(0, end - real)]

    def valid_tokens(self) -> int:
        """Cached tokens that are still true: the real ones, and the guesses the target
        kept (the same tokens at the same places)."""
        kept = 0
        real = self.seq.all_ids[self.base : self.base + len(self.guesses)]
        for g, r in zip(self.guesses, real, strict=False):
            if g != r:
                break
            kept += 1
        return min(self.n_cached, self.base + kept)


class DraftModelProposer:
    name = "draft_model"

    def __init__(
        self, model, pool: KVPool, block_size: int, device: str, kernels, budget: int, label: str
    ):
        self.model, self.pool, self.device, self.label = model, pool, device, label
        self.blocks = BlockManager(pool.num_blocks, block_size, enable_prefix_caching=False)
        # catch-ups of a few tokens (the last round's accepted guesses) as decode rows
        self.runner = ModelRunner(model, pool, block_size, device, kernels=kernels, rows_up_to=16)
        self.kernels = kernels
        self.budget = budget  # tokens the drafter may feed in one pass (its catch-up)
        self.states: dict[int, DraftState] = {}  # by id() of the target sequence

    def _state(self, seq) -> DraftState:
        st = self.states.get(id(seq))
        if st is None or st.seq is not seq:
            st = self.states[id(seq)] = DraftState(seq)
        return st

    def _roll_back(self, st: DraftState) -> None:
        st.n_cached = st.valid_tokens()
        st.guesses = []
        st.base = st.seq.num_tokens
        self.blocks.trim(st)

    @torch.inference_mode()
    def propose(self, wants: list[tuple[object, int]]) -> dict:
        """{seq: (k tokens, q [k, V] float32 or None for greedy)}; wants: (seq, k). A
        sequence whose catch-up does not fit what is left of this pass's budget, or whose
        blocks the pool cannot give, gets no proposal this step."""
        active, budget = [], self.budget
        for seq, _ in wants:
            st = self._state(seq)
            self._roll_back(st)
            self._prefill_long(st)
        free = self.blocks.num_free
        for seq, k in wants:
            st = self.states[id(seq)]
            catch_up = seq.num_tokens - st.n_cached
            need = self.blocks.blocks_needed(st, catch_up + k - 1)
            if catch_up > budget or need > free:
                continue
            budget, free = budget - catch_up, free - need
            active.append((seq, st, k))
        tokens = {seq: [] for seq, _, _ in active}
        qs = {seq: [] for seq, _, _ in active}
        round_ = active
        while round_:
            batch = []
            for _, st, _ in round_:
                n = st.num_tokens - st.n_cached
                self.blocks.append(st, n)
                batch.append(ScheduledSeq(st, n, sample=True, prefill=n > 1))
            logits = self.runner.run(batch).logits.float()
            for item in batch:
                self.blocks.computed(item.seq, item.n_tokens)
            for r, (seq, _, _) in enumerate(round_):
                token, q = self._choose(logits[r], seq)
                tokens[seq].append(token)
                qs[seq].append(q)
            next_round = []
            for seq, st, k in round_:
                if len(tokens[seq]) < k:
                    st.guesses.append(tokens[seq][-1])
                    next_round.append((seq, st, k))
            round_ = next_round
        out = {}
        for seq, _, _ in active:
            q = None if qs[seq][0] is None else torch.stack(qs[seq])
            out[seq] = (tokens[seq], q)
        return out

    def _prefill_long(self, st: DraftState) -> None:
        """A prompt longer than one pass's budget: the drafter reads it a budget at a time,
        leaving the last stretch for the round that guesses."""
        while st.seq.num_tokens - st.n_cached > self.budget:
            if not self.blocks.can_append(st, self.budget):
                return
            self.blocks.append(st, self.budget)
            self.runner.run([ScheduledSeq(st, self.budget, sample=False, prefill=True)])
            self.blocks.computed(st, self.budget)

    def _choose(self, row: torch.Tensor, seq) -> tuple[int, torch.Tensor | None]:
        """The drafter's guess, and the distribution it drew it from (None: greedy)."""
        params = seq.params
        if params.greedy:
            return int(torch.argmax(row)), None
        q = distribution(row, params)
        return int(torch.multinomial(q, 1, generator=seq.generator)), q

    def end_step(self, live) -> None:
        """Roll every shadow back to the real tokens; drop those of sequences gone from
        the running set (finished, aborted, preempted), giving back their blocks."""
        live_ids = {id(s): s for s in live}
        for key, st in list(self.states.items()):
            if live_ids.get(key) is st.seq:
                self._roll_back(st)
            else:
                self.blocks.free_seq(st)
                del self.states[key]

    def describe(self) -> str:
        return self.label
