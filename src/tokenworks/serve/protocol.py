"""Request bodies of the OpenAI and Anthropic APIs, as pydantic models.

Ranges follow the APIs (and vLLM for the extension fields), so a bad value is refused with
a 400 that names the field before anything reaches the engine. Unknown fields are ignored,
as vLLM and the OpenAI API do.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenworks.engine.request import MAX_SEED

_SURROGATE = re.compile("[\ud800-\udfff]")


class NotTextError(ValueError):
    """A string of the body holds a lone UTF-16 surrogate: valid JSON ("\\ud800"), but not
    text, so no tokenizer or stop-string matcher can take it."""

    def __init__(self, field: str):
        self.field = field
        super().__init__(
            f"{field}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
            "pair), which is not text; send valid Unicode"
        )


def surrogate_field(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in a JSON value holding a lone
    surrogate, or None."""
    if isinstance(value, str):
        return (path or "body") if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return path or "body"
            found = surrogate_field(item, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = surrogate_field(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(_Body):
    """A whole request body: refused with a 400 naming the field if any string in it is
    not text."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        field = surrogate_field(data)
        if field is not None:
            raise NotTextError(field)
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputs(_Body):
    """vLLM's extension: exactly one of these constrains the output."""

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Request):
    """Fields both OpenAI endpoints share (standard ones, then vLLM-style extensions)."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # bounded in serve/limits.py
    # extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    deadline: float | None = Field(default=None, gt=0, description="seconds to finish in")
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0, with echo: score the prompt alone
    logprobs: int | None = Field(default=None, ge=0, le=5)
    # vLLM's extension: each prompt token's logprob and top alternatives
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # vLLM's extension: logprob tokens as "token_id:N", so a client can tell tokens apart
    return_tokens_as_token_ids: bool = False
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    response_format: dict | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # a reasoning model's thinking: its budget in tokens, or an effort mapped to one
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    max_reasoning_tokens: int | None = Field(default=None, ge=0)


class ResponsesRequest(_Request):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {...}}: structured output
    reasoning: dict[str, Any] | None = None  # {"effort": ...}
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # extensions
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    deadline: float | None = Field(default=None, gt=0)


class EmbeddingRequest(_Request):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # only the model's own width
    user: str | None = None


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0)


class AnthropicPrompt(_Request):
    """What makes an Anthropic prompt (all /v1/messages/count_tokens reads)."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None


class AnthropicMessagesRequest(AnthropicPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's spelling
    # extensions
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    deadline: float | None = Field(default=None, gt=0)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
