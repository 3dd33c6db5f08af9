"""Chat templates: the model's own Jinja template, rendered in a sandbox.

Templates come from model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment (no attribute access to Python internals, no mutation of
the messages we pass in). The helpers templates expect in the wild (`raise_exception`,
`tojson`, `strftime_now`, the `{% generation %}` tag that marks what the assistant wrote for
training masks) are provided the way transformers provides them, and a message's reasoning
is there under each name templates read it by, as transformers passes it. A template that
names `functions` or `datetime` without setting them (Firefunction's) gets them as
llama.cpp gives them: the tools as JSON, and the time now.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime

from jinja2 import TemplateError, Undefined, meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

_ROLES = ("system", "user", "assistant", "tool", "developer")
# a message's reasoning, by the names templates read it under (gpt-oss's: "thinking")
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      default=_listed)  # fmt: skip


def _listed(value):
    """A filter's generator (`tools | map(...)`) as the list it yields."""
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: its body, rendered in place."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _with_reasoning_names(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_NAMES if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    def __init__(self, source: str, tokenizer=None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            undefined=Undefined,
            extensions=["jinja2.ext.loopcontrols", _GenerationTag],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.template = env.from_string(source)
        self._tokenizer = tokenizer
        self._names = meta.find_undeclared_variables(env.parse(source))

    def _special(self, token_id: int | None) -> str:
        if token_id is None or self._tokenizer is None:  # (a template read without its model)
            return ""
        return self._tokenizer.token_to_str(token_id)

    def special_tokens(self) -> dict[str, str]:
        """The special tokens' text a template is given, as bos_token and eos_token."""
        tok = self._tokenizer
        eos = tok.eos_token_ids if tok is not None else ()
        return {
            "bos_token": self._special(tok.bos_token_id if tok is not None else None),
            "eos_token": self._special(eos[0] if eos else None),
        }

    def variables(self, tools: list | None = None) -> dict[str, str]:
        """What the template is given beyond the messages, the tools and the special tokens,
        where it names them: `functions` and `datetime`."""
        given = {"functions": lambda: json.dumps(tools or [], indent=2),
                 "datetime": lambda: datetime.now().strftime("%b %d %Y %H:%M:%S GMT")}  # fmt: skip
        return {name: value() for name, value in given.items() if name in self._names}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        validate_messages(messages)
        if "enable_thinking" in kwargs:  # DeepSeek V3.1's and Kimi K3's name for it, too
            kwargs.setdefault("thinking", kwargs["enable_thinking"])
        try:
            return self.template.render(
                messages=_with_reasoning_names(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens() | self.variables(kwargs.get("tools")) | kwargs,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # a template doing string or list work on a value a client shaped otherwise
            raise ChatTemplateError(
                f"the chat template failed to render: {type(e).__name__}: {e}"
            ) from e


def validate_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"messages[{i}] must be a dict with a 'role' and 'content'")
        if m["role"] not in _ROLES:
            raise ChatTemplateError(
                f"messages[{i}] has role {m['role']!r}; expected one of {', '.join(_ROLES)}"
            )
