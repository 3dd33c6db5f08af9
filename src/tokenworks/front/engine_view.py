"""What the API process holds of an engine whose core runs elsewhere: enough to tokenise,
template and refuse a request before sending it, and the errors a core's refusal names."""

from __future__ import annotations

from dataclasses import dataclass

from tokenworks.config import EngineConfig
from tokenworks.engine import core_messages as m
from tokenworks.engine.admission import Admission, PromptTooLongError, RequestTooLargeError
from tokenworks.engine.kv_groups import KVGroup, KVLayout
from tokenworks.engine.messages import LoRANotFoundError, QueueFullError
from tokenworks.engine.request import SamplingError, StructuredOutputError
from tokenworks.models.spec import ModelSpec
from tokenworks.tokenizer import TokenizerWrapper

# what the core's add_request may raise, raised again here by name
REFUSALS = {
    cls.__name__: cls
    for cls in (
        PromptTooLongError, RequestTooLargeError, QueueFullError, SamplingError,
        StructuredOutputError, LoRANotFoundError,
    )
}  # fmt: skip


@dataclass
class EngineView:
    """What the API process holds of an engine in another process: enough to tokenise,
    template and refuse a request before sending it (the core's own admission, rebuilt
    from its Ready)."""

    spec: ModelSpec
    tokenizer: TokenizerWrapper
    max_model_len: int
    admission: Admission

    @classmethod
    def build(cls, config: EngineConfig, ready: m.Ready) -> EngineView:
        from tokenworks.models import load

        # the core holds the weights
        loaded = load(config.model, weights=False, keep_index=config.keep_gguf_index)
        layout = KVLayout(
            tuple(KVGroup(tuple(layers), window) for layers, window in ready.kv_groups),
            ready.kv_group_size,
        )
        admission = Admission(
            vocab_size=ready.vocab_size, context=ready.max_model_len,
            context_source=ready.context_source, num_blocks=ready.num_blocks,
            block_size=ready.block_size, layout=layout, chunk=ready.prompt_pass,
        )  # fmt: skip
        return cls(
            loaded.spec, TokenizerWrapper.from_loaded(loaded), ready.max_model_len, admission
        )
