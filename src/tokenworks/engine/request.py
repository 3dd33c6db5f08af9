"""What a request asks for (SamplingParams) and what it gets back (RequestOutput)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
POOLINGS = (None, "mean", "last")  # how a prompt's hidden states become one embedding
# A temperature below this samples as greedy (vLLM's _SAMPLING_EPS): dividing logits by
# 1e-45 gives infinities, and no distribution is left to draw from.
MIN_TEMPERATURE = 1e-5
# repetition_penalty divides (or multiplies) logits: outside this range a logit of a few
# tens leaves float32's range, and the draw has nothing finite to sample from
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_SEED = 2**63 - 1  # torch.Generator takes 64 bits; siblings of n > 1 add their index


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed for this request alone (the others carry on)


class SamplingError(ValueError):
    """A sampling option outside its valid range; the message says which and why."""


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thinking, between its think markers (as token ids: single
    tokens in Qwen3 and DeepSeek-R1). Its tokens are counted (reasoning_tokens), and with
    a budget the end marker is forced once `budget` tokens have been thought, so the
    answer follows (engine/thinking.py)."""

    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()  # output that starts with these opens thinking
    opened: bool = False  # the prompt already opened it (a template ending in the marker)
    budget: int | None = None  # tokens between the markers at most; None: no bound

    def __post_init__(self) -> None:
        if not self.end_ids or (self.budget is not None and self.budget < 0):
            raise SamplingError("thinking needs end marker ids and a budget >= 0 (or None)")


# One line of JSON with a space after ',' and ':'. Free whitespace lets a small model pad
# forever between tokens (newline after newline) without ever closing the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def close_objects(schema):
    """Objects that list their properties take no others unless the schema says so
    (additionalProperties / patternProperties), as in OpenAI's strict structured outputs;
    otherwise a model may append invented keys until max_tokens."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v) for k, v in schema.items()}
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in out and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to a language (engine/structured.py applies it as a token mask).

    kind is one of STRUCTURED_KINDS; value is the JSON schema as JSON text, the regex, the
    choice list as a JSON array, or the Lark grammar. Build one with the class methods.
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingError(
                f"structured output kind {self.kind!r} is not one of {', '.join(STRUCTURED_KINDS)}"
            )

    @classmethod
    def json(cls, schema: dict | str | None = None) -> StructuredOutput:
        """Output that validates against `schema` (any JSON object when None)."""
        if schema is None:
            return cls("json_object")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SamplingError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise SamplingError("a JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema))  # keeps property order

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise SamplingError("a choice list needs at least one non-empty string")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("grammar", grammar)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value)


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """How to pick tokens, and when to stop. Names and ranges follow vLLM / the OpenAI API.

    temperature 0 means greedy. top_k <= 0 and top_p = 1 and min_p = 0 disable those filters.
    repetition_penalty (> 1 discourages repeats) acts on prompt and output tokens, the way
    Hugging Face defines it; frequency_penalty and presence_penalty act on output tokens,
    the way OpenAI defines them. A seed makes sampling reproducible per request.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives per generated token (0: just the chosen)
    # each prompt token's logprob given the tokens before it, with top-n alternatives (vLLM's
    # prompt_logprobs; the first token has none): the prompt then skips the prefix cache
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # completions per prompt; they share the prompt's KV blocks (copy-on-write)
    structured: StructuredOutput | None = None  # constrain the output to a grammar
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's
    # logit_bias); logprobs are still reported from the model's own distribution
    logit_bias: dict[int, float] | None = None
    # embed the prompt instead of generating (max_tokens 0): its final hidden states (after
    # the last norm) pooled by "mean" over every position or "last" (the last position's),
    # then scaled to unit length
    pooling: str | None = None
    thinking: Thinking | None = None  # count (and bound) a reasoning model's thinking

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.temperature, int | float) and 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0  # greedy
        lo, hi = REPETITION_PENALTY_RANGE
        checks = [
            (
                isinstance(self.max_tokens, int) and self.max_tokens >= 0,
                "max_tokens must be >= 0 (0: read the prompt, generate nothing)",
            ),
            (isinstance(self.n, int) and 1 <= self.n <= 128, "n must be an integer in [1, 128]"),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature must be a finite number >= 0 (0 means greedy)",
            ),
            (isinstance(self.top_k, int), "top_k must be an integer (0 or -1 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (
                lo <= self.repetition_penalty <= hi,
                f"repetition_penalty must be in [{lo}, {hi:g}] (1 disables it)",
            ),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be non-negative integers",
            ),
            (
                all(
                    isinstance(t, int) and t >= 0 and -100 <= b <= 100
                    for t, b in (self.logit_bias or {}).items()
                ),
                "logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]",
            ),
            (self.pooling in POOLINGS, f"pooling must be one of {', '.join(POOLINGS[1:])}"),
            (
                self.pooling is None or self.max_tokens == 0,
                "pooling embeds the prompt: it needs max_tokens 0",
            ),
            (
                self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
                "seed must be an integer in [0, 2**63 - 1]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(f"{message}; got {self._describe()}")

    @property
    def fast_greedy(self) -> bool:
        """Plain argmax is enough: greedy, no penalties, no logprobs (a grammar's mask is
        already on the logits by then)."""
        return (
            self.greedy
            and self.logprobs is None
            and not self.uses_penalties
            and not self.logit_bias
        )

    def _describe(self) -> str:
        return (
            f"max_tokens={self.max_tokens}, temperature={self.temperature}, top_k={self.top_k}, "
            f"top_p={self.top_p}, min_p={self.min_p}, "
            f"repetition_penalty={self.repetition_penalty}, "
            f"frequency_penalty={self.frequency_penalty}, "
            f"presence_penalty={self.presence_penalty}, logprobs={self.logprobs}, "
            f"prompt_logprobs={self.prompt_logprobs}, n={self.n}, "
            f"seed={self.seed}"
        )

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the token history (so the hot path can skip building it)."""
        return bool(
            self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]  # (id, text, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier (reported for prompt tokens)


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] | None = None
    reasoning_tokens: int = 0  # of token_ids, those of the thinking (SamplingParams.thinking)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prefix_miss: str | None = None  # why the first block not found missed (MISS_REASONS)
    # where asked (SamplingParams.prompt_logprobs): one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # where asked (SamplingParams.pooling), unit length


class StructuredOutputError(ValueError):
    """The requested grammar cannot be compiled; the message says what is wrong."""
