"""What the API process and an engine core process say to each other (engine/core.py).

Each message is a msgspec Struct, tagged by its class name and sent as msgpack over a ZeroMQ
socket: typed on both ends, and no pickle, so a request's text never reaches an unpickler.
The engine's own dataclasses (SamplingParams, RequestUpdate) travel as they are; msgspec
checks them on decoding and runs their __post_init__ validation.
"""

from __future__ import annotations

import msgspec

from tokenworks.engine.messages import EngineGauges, KVBlocks, RequestMetrics, RequestUpdate
from tokenworks.engine.request import SamplingParams

# ------------------------------------------------------------------ API -> core


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    # prefill / decode disaggregation (engine/kv_transfer.py): write the prompt's blocks
    # out when the request ends; or read these blocks in before it starts
    kv_export: bool = False
    kv_import: KVBlocks | None = None
    lora: str | None = None  # the LoRA adapter to run it with (None: the base model)


class Abort(msgspec.Struct, tag=True):
    request_id: str


class StopSequence(msgspec.Struct, tag=True):
    """A stop string (found in the API process, which holds the text) ended completion
    `index` after its first `keep` tokens."""

    request_id: str
    index: int
    stop: str
    keep: int


class Shutdown(msgspec.Struct, tag=True):
    pass


class LoRACommand(msgspec.Struct, tag=True):
    """Load (from path) or unload a LoRA adapter; answered Accepted or Refused by id."""

    request_id: str
    action: str  # load or unload
    name: str
    path: str | None = None


# ------------------------------------------------------------------ core -> API


class Ready(msgspec.Struct, tag=True):
    """The core loaded its model and takes requests; what the API process needs of it."""

    pid: int
    model_id: str
    describe: str
    # what the API process's admission needs to refuse exactly as the core's would
    vocab_size: int
    max_model_len: int
    context_source: str
    num_blocks: int
    block_size: int
    kv_groups: list[tuple[list[int], int | None]]  # each group's layers and window
    kv_group_size: int
    prompt_pass: int | None


class Accepted(msgspec.Struct, tag=True):
    request_id: str


class Refused(msgspec.Struct, tag=True):
    """add_request raised: the error's class name (one of REFUSALS) and its message."""

    request_id: str
    error: str
    message: str


class Failed(msgspec.Struct, tag=True):
    """The engine failed while running the request (it carries on for the others)."""

    request_id: str
    message: str


class Outputs(msgspec.Struct, tag=True):
    """One step's updates, every request's in one message, and what /metrics hears of the
    step (sent after commands alone too, when they changed the engine's state)."""

    updates: list[RequestUpdate]
    gauges: EngineGauges
    preemptions: int = 0
    inter_token_s: list[float] = []  # the gap before each update, for requests past their first
    finished: list[RequestMetrics] = []


ToCore = AddRequest | Abort | StopSequence | Shutdown | LoRACommand
FromCore = Ready | Accepted | Refused | Failed | Outputs

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


def request_id_of(data: bytes) -> str | None:
    """The request id of a message that did not decode as its type, where it has one."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None
