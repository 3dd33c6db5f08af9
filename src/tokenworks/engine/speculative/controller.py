"""How many tokens to propose for each sequence, from what speculation has measured.

A sequence's acceptance rate alpha is estimated from its own recent verdicts. The costs
are the engine's: seconds of a plain decode step, of a verify step with r query rows per
sequence, and of a proposal round, each kept per batch size (in powers of two). The
expected gain of proposing k tokens is the expected tokens per step,
(1 - alpha^(k+1)) / (1 - alpha) (plan/speculative.py), over the cost of the step relative
to a plain one. Each sequence takes the k with the best gain; when no k gains at least 1
it stops proposing for a while (8 decode steps, doubling up to 256 while it keeps losing)
and then probes with one token to measure its acceptance again. Above the estimates, the
end result is watched: where decode steps with guesses emit fewer tokens a second than
steps without at the same batch size, no step guesses; one step in 16 takes the other
side, so that both rates stay current. A
seeded request weighs fixed costs instead of timings, so that its output depends on its
seed alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenworks.plan.speculative import expected_tokens

EMA = 0.2  # weight of the newest timing
DECAY = 0.8  # weight an acceptance verdict keeps per newer one
PRIOR_ALPHA, PRIOR_WEIGHT = 0.7, 2.0  # before any verdict: guesses are worth trying
PRIOR_ROW_COST = 0.1  # a verify row's cost relative to a plain step, before it is measured
MIN_OFF, MAX_OFF = 8, 256  # decode steps a losing sequence waits before it probes
PROBE_EVERY = 16  # one step in this many tries the side the rates do not favour


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2, 4, 8, ... (the next power of two)."""
    return 1 << max(0, batch - 1).bit_length()


class StepCosts:
    """Measured seconds by batch bucket: plain decode steps, verify steps by rows per
    sequence, proposal rounds."""

    def __init__(self):
        self.plain: dict[int, float] = {}
        self.plain_count: dict[int, int] = {}
        self.verify: dict[tuple[int, int], float] = {}
        self.round: dict[int, float] = {}
        # tokens a second from decode steps, with guesses and without: the end result
        # every estimate above is a means to, compared directly
        self.rate: dict[tuple[int, bool], float] = {}
        self.decided: dict[int, int] = {}  # steps losing() has answered, by bucket

    @staticmethod
    def _ema(table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - EMA) * old + EMA * value

    def observe_plain(self, batch: int, seconds: float) -> None:
        b = bucket(batch)
        self._ema(self.plain, b, seconds)
        self.plain_count[b] = self.plain_count.get(b, 0) + 1

    def observe_verify(self, batch: int, rows_per_seq: int, seconds: float) -> None:
        self._ema(self.verify, (bucket(batch), rows_per_seq), seconds)

    def observe_round(self, batch: int, seconds: float) -> None:
        self._ema(self.round, bucket(batch), seconds)

    def observe_rate(self, batch: int, speculated: bool, tokens_per_s: float) -> None:
        self._ema(self.rate, (bucket(batch), speculated), tokens_per_s)

    def losing(self, batch: int) -> bool:
        """Whether this step should not guess: steps with guesses have been emitting fewer
        tokens a second than steps without at this batch size. Every PROBE_EVERY-th step
        takes the other side, so both rates stay measured and a change of fortune (longer
        contexts, other requests) is seen."""
        b = bucket(batch)
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        if spec is None or plain is None:
            return False
        n = self.decided[b] = self.decided.get(b, 0) + 1
        return (spec < plain) != (n % PROBE_EVERY == 0)

    def plain_known(self, batch: int) -> bool:
        return self.plain_count.get(bucket(batch), 0) >= 2

    def verify_seconds(self, batch: int, rows: int) -> float:
        """A verify step with `rows` query rows per sequence: measured, or drawn on a line
        from the plain step to the nearest measured row count, or a prior."""
        b = bucket(batch)
        plain = self.plain[b]
        if (b, rows) in self.verify:
            return self.verify[(b, rows)]
        known = [r for (bb, r) in self.verify if bb == b and r > 1]
        if not known:
            return plain * (1 + PRIOR_ROW_COST * (rows - 1))
        near = min(known, key=lambda r: abs(r - rows))
        return plain + (self.verify[(b, near)] - plain) * (rows - 1) / (near - 1)

    def ratio(self, batch: int, k: int, rounds_per_token: bool, static: float | None = None):
        """The cost of a step that proposes k tokens per sequence, in plain steps. static:
        a drafter pass's cost, fixed rather than measured (with the prior row cost)."""
        if static is not None:
            return 1 + PRIOR_ROW_COST * k + static * (k if rounds_per_token else 1)
        b = bucket(batch)
        draft = self.round.get(b, 0.0) * (k if rounds_per_token else 1)
        return (self.verify_seconds(batch, k + 1) + draft) / self.plain[b]


@dataclass
class SequenceAcceptance:
    """One sequence's recent verdicts, and whether it is sitting out."""

    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT
    off_until: int = 0  # the decode step it may propose again
    backoff: int = MIN_OFF

    @property
    def alpha(self) -> float:
        return min(self.accepted / self.trials, 0.999)

    def update(self, proposed: int, accepted: int) -> None:
        """A verdict: the first `accepted` of `proposed` guesses passed (a truncated
        geometric draw: each accepted guess is one success, a rejection one failure)."""
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + accepted + (1 if accepted < proposed else 0)


class Controller:
    def __init__(self, k_max: int, adaptive: bool, rounds_per_token: bool, static_cost: float):
        self.k_max, self.adaptive = k_max, adaptive
        self.rounds_per_token = rounds_per_token  # a drafter runs once per guess; n-gram once
        # a proposal round's cost in target passes, fixed: what a seeded request decides
        # by, so that its tokens never depend on timings (its seed fixes its output)
        self.static_cost = static_cost
        self.costs = StepCosts()
        self.seqs: dict[int, tuple[object, SequenceAcceptance]] = {}
        self.step = 0

    def state(self, seq) -> SequenceAcceptance:
        entry = self.seqs.get(id(seq))
        if entry is None or entry[0] is not seq:
            entry = self.seqs[id(seq)] = (seq, SequenceAcceptance())
        return entry[1]

    def gain(self, alpha: float, k: int, batch: int, static: bool = False) -> float:
        cost = self.static_cost if static else None
        return expected_tokens(alpha, k) / self.costs.ratio(batch, k, self.rounds_per_token, cost)

    def choose(self, seq, batch: int, limit: int) -> int:
        """Tokens to propose for seq this step (0: none), at most limit. A seeded request
        decides from its own acceptance and fixed costs alone."""
        k_max = min(self.k_max, limit)
        if k_max < 1:
            return 0
        if not self.adaptive:
            return k_max
        st = self.state(seq)
        if self.step < st.off_until:
            return 0
        static = seq.params.seed is not None
        best = max(range(1, k_max + 1), key=lambda k: self.gain(st.alpha, k, batch, static))
        if self.gain(st.alpha, best, batch, static) >= 1.0:
            st.backoff = MIN_OFF
            return best
        probing = st.off_until > 0  # back from sitting out: one guess, to measure again
        st.off_until = self.step + st.backoff
        st.backoff = min(2 * st.backoff, MAX_OFF)
        return 1 if probing else 0

    def forget_except(self, live) -> None:
        keep = {id(s) for s in live}
        for key in [k for k in self.seqs if k not in keep]:
            del self.seqs[key]
