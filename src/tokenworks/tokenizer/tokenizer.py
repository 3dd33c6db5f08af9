"""Text <-> token ids with Hugging Face `tokenizers`, built from GGUF metadata
(tokenizer/gguf_vocab.py: the same `tokenizers.Tokenizer` the model's own tokenizer.json
describes) or read from tokenizer.json.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from tokenworks.tokenizer.chat import ChatTemplate
from tokenworks.tokenizer.errors import TokenizerError
from tokenworks.tokenizer.gguf_vocab import tokenizer_from_gguf_fields

__all__ = ["TokenizerError", "TokenizerWrapper", "tokenizer_from_gguf_fields"]


class TokenizerWrapper:
    """The one tokenizer interface the engine uses: encode, decode, chat templates."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token_id: int | None = None,
        add_bos: bool = False,
        eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
    ):
        self.tk = tokenizer
        self._literal_tk: Tokenizer | None = None
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.eos_token_ids = eos_token_ids
        self.chat = ChatTemplate(chat_template, self) if chat_template else None

    @classmethod
    def from_loaded(cls, loaded) -> TokenizerWrapper:
        src = loaded.tokenizer_source
        if src.get("kind") == "gguf":
            f = src["fields"]
            built = loaded.built_tokenizer  # (a tokenizer is never changed once built)
            if built is None or built[0] is not f:
                built = (f, tokenizer_from_gguf_fields(f, loaded.spec.arch))
                loaded.built_tokenizer = built
            tk = built[1]
            add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False))
        elif src.get("kind") == "object":
            tk, add_bos = src["tokenizer"], False
        elif src.get("kind") == "json":
            tk = Tokenizer.from_file(src["path"])
            add_bos = False  # tokenizer.json's post-processor adds BOS where the model wants it
        else:
            raise TokenizerError(
                f"{loaded.model_id} has no tokenizer (no tokenizer.json, no GGUF vocabulary)"
            )
        return cls(
            tk,
            bos_token_id=loaded.spec.bos_token_id,
            add_bos=add_bos,
            eos_token_ids=loaded.spec.eos_token_ids,
            chat_template=loaded.chat_template,
        )

    def _literal(self) -> Tokenizer:
        """A copy of the tokenizer that reads control tokens' text as text (a copy, so the
        one shared by every request keeps parsing them)."""
        if self._literal_tk is None:
            tk = Tokenizer.from_str(self.tk.to_str())
            tk.encode_special_tokens = True
            self._literal_tk = tk
        return self._literal_tk

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of text; add_special_tokens: the BOS the model wants in front;
        parse_special: a control token's text ("<|im_start|>") is that token, else it is
        tokenised as text (llama.cpp's parse_special)."""
        tk = self.tk if parse_special else self._literal()
        ids = tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.tk.id_to_token(token_id) or ""

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        if self.chat is None:
            raise TokenizerError(
                "this model has no chat template; use generate() with a plain prompt"
            )
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
