"""Speculative decoding's options: one JSON value on the command line, in vLLM's shape."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from tokenworks.config.json_values import json_arg, json_object
from tokenworks.config.model import DTYPES

SPECULATIVE_METHODS = ("ngram", "draft_model")
DRAFT_QUANTIZATIONS = (None, "int8", "int4")
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's shape: --speculative-config '{"method": "ngram",
    "num_speculative_tokens": 4}'. The guesses are checked by the target in one pass and
    the output distribution stays the target's (engine/speculative/)."""

    method: str = "ngram"  # ngram (prompt lookup) or draft_model
    num_speculative_tokens: int = 4  # k: the most tokens proposed per step
    model: str | None = None  # draft_model: the drafter (same tokenizer as the target)
    quantization: str | None = None  # the drafter's weight-only quantisation (int8, int4)
    dtype: str | None = None  # the drafter's dtype (default: the target's)
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: the shortest suffix that counts as a match
    # stop proposing for a sequence while its measured acceptance and the measured draft
    # and verify costs say a step gains less than plain decoding; try again later
    adaptive: bool = True

    @classmethod
    def parse(cls, value) -> SpeculativeConfig:
        """From a JSON string (the command line), a dict (the Python API) or itself."""
        value = json_object(value, cls, "speculative_config", EXAMPLE)
        if isinstance(value, cls):
            return value
        if "method" not in value and value.get("model"):
            value["method"] = "draft_model"  # vLLM infers the method from a model
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r}: expected one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, not {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": the drafter to load')
        if self.method == "ngram" and self.model:
            raise ValueError('the ngram method takes no "model"; use "method": "draft_model"')
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft quantization {self.quantization!r}: expected int8 or int4")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"draft dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    def __str__(self) -> str:
        return json.dumps(asdict(self))


speculative_arg = json_arg(SpeculativeConfig.parse)  # --speculative-config's parser
