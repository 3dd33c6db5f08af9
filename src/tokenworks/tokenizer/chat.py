"""Chat templates: the model's own Jinja template, rendered in a sandbox.

Templates come from model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment (no attribute access to Python internals, no mutation of
the messages we pass in). The helpers templates expect in the wild (`raise_exception`,
`tojson`, `strftime_now`) are provided the way transformers provides them.
"""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

_ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, tokenizer):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            undefined=Undefined,
            extensions=["jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.template = env.from_string(source)
        self._tokenizer = tokenizer

    def _special(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tokenizer.token_to_str(token_id)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        validate_messages(messages)
        eos = self._tokenizer.eos_token_ids
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special(self._tokenizer.bos_token_id),
                eos_token=self._special(eos[0] if eos else None),
                **kwargs,
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
