"""The engine's door to speculative decoding: propose before the scheduler, verify after
the forward pass, measure and roll back at the end of the step.

A running sequence in its decode phase may get k proposed tokens; the scheduler then
gives it k + 1 query rows beside other sequences' prompt chunks and plain decodes, and the
target returns logits for every one of them. `verify` applies the acceptance rule
(acceptance.py); the engine appends what it returns, marks that many tokens' K/V as
computed and trims the blocks written for the rejected ones.
"""

from __future__ import annotations

import time

import torch

from tokenworks.config import SpeculativeConfig
from tokenworks.engine.sampler import NO_HISTORY, SampleResult
from tokenworks.engine.speculative.acceptance import verify
from tokenworks.engine.speculative.controller import Controller
from tokenworks.engine.speculative.metrics import SpeculativeMetrics


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, draft_cost: float = 0.0):
        """draft_cost: a proposal round's cost in target passes, as far as it is known
        before anything runs (a drafter's parameters over the target's)."""
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.controller = Controller(
            self.k, config.adaptive, proposer.name == "draft_model", draft_cost
        )
        self.metrics = SpeculativeMetrics(accepted_per_pos=[0] * self.k)
        self._q: dict[int, torch.Tensor | None] = {}  # id(seq) -> the drafter's q rows
        self._propose_s = 0.0
        self._rounds = 0

    def describe(self) -> str:
        mode = "adaptive" if self.config.adaptive else "always"
        return f"{self.proposer.describe()}, up to {self.k} tokens a step ({mode})"

    @staticmethod
    def decoding(seq) -> bool:
        """In its decode phase: past its prompt, one token not yet in the cache."""
        return bool(seq.output_ids) and seq.num_tokens - seq.n_cached == 1 and not seq.finished

    def propose(self, running: list) -> dict:
        """{seq: proposed tokens} for this step's running sequences."""
        t0 = time.perf_counter()
        self._q.clear()
        self._rounds = 0
        seqs = [s for s in running if self.decoding(s)]
        costs = self.controller.costs
        m = self.metrics
        m.proposing, m.held_back, m.losing = 0, 0, False
        alphas = [self.controller.state(s).alpha for s in seqs]
        m.mean_acceptance = sum(alphas) / len(alphas) if alphas else None
        if not seqs or (self.config.adaptive and not costs.plain_known(len(seqs))):
            self._propose_s = time.perf_counter() - t0
            return {}  # a plain step first: what speculation is measured against
        # guesses that have been losing at this batch size: only the seeded requests, whose
        # choices may not hang on timings, still decide for themselves
        losing = self.config.adaptive and costs.losing(len(seqs))
        m.losing = bool(losing)
        wants = []
        for seq in seqs:
            if losing and seq.params.seed is None:
                continue
            # guesses past max_tokens could never be kept; past the context, not scored
            limit = min(seq.params.max_tokens - len(seq.output_ids), seq.max_len - seq.num_tokens)
            free = seq.free_tokens  # a thinking budget's end comes at its own step
            if free is not None:
                limit = min(limit, free - 1)
            k = self.controller.choose(seq, len(seqs), limit)
            if k:
                wants.append((seq, k))
        m.held_back = len(seqs) - len(wants)
        drafts = {}
        for seq, (tokens, q) in self.proposer.propose(wants).items():
            if seq.matcher is not None:  # the grammar checks each guess
                tokens = tokens[: seq.matcher.valid_prefix(tokens)]
            if tokens:
                drafts[seq] = tokens
                self._q[id(seq)] = q
                self._rounds = max(self._rounds, len(tokens))
        m.proposing = len(drafts)
        self._propose_s = time.perf_counter() - t0
        return drafts

    def row_matchers(self, seq, draft: list[int]) -> list:
        """The grammar state each verify row is masked with: after the guesses before it."""
        if seq.matcher is None:
            return [None] * (len(draft) + 1)
        rows, m = [seq.matcher], seq.matcher
        for token in draft:
            m = m.fork()
            m.accept(token)
            rows.append(m)
        return rows

    def verify(self, seq, draft: list[int], logits, argmax: list[int]) -> list[SampleResult]:
        """The tokens seq emits from its k + 1 verify rows (logits [k + 1, V] or None where
        the forward pass gave argmaxes only); counts the verdict."""
        q = self._q.get(id(seq))
        if q is not None:
            q = q[: len(draft)]
        p = seq.params
        history = p.uses_penalties
        results = verify(
            logits,
            argmax,
            draft,
            q,
            p,
            seq.prompt_tensor() if history else NO_HISTORY,
            seq.output_tensor() if history else NO_HISTORY,
            seq.generator,
        )
        accepted = len(results) - 1
        m = self.metrics
        m.num_drafts += 1
        m.num_draft_tokens += len(draft)
        m.num_accepted_tokens += accepted
        m.num_emitted_tokens += len(results)
        m.num_rejections += accepted < len(draft)
        for j in range(accepted):
            m.accepted_per_pos[j] += 1
        self.controller.state(seq).update(len(draft), accepted)
        return results

    def end_step(self, scheduled: list, running: list, seconds: float, emitted: int) -> None:
        """Timings into the cost model (decode-only steps: a prompt chunk would blur them),
        the drafter rolled back to the real tokens, state of departed sequences dropped.
        emitted: the tokens the step added."""
        m = self.metrics
        drafted = [item for item in scheduled if item.draft]
        m.draft_seconds += self._propose_s
        if drafted:
            m.verify_seconds += seconds - self._propose_s
        if scheduled and not any(item.prefill for item in scheduled):
            costs, batch = self.controller.costs, len(scheduled)
            if seconds > 0:
                costs.observe_rate(batch, bool(drafted), emitted / seconds)
            if not drafted:
                costs.observe_plain(batch, seconds)
            else:
                rows = round(sum(item.n_tokens for item in scheduled) / batch)
                costs.observe_verify(batch, rows, seconds - self._propose_s)
                per_round = self.controller.rounds_per_token
                costs.observe_round(
                    batch, self._propose_s / max(1, self._rounds) if per_round else self._propose_s
                )
        self.controller.step += 1
        self.controller.forget_except(running)
        self.proposer.end_step(running)
        self._q.clear()
