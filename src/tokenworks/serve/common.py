"""What both protocols share: the server's state, request -> SamplingParams, submitting to
the engine with its refusals mapped to HTTP errors, and server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenworks.engine.messages import (
    DeadlineExceededError,
    EngineNotRunningError,
    LoRANotFoundError,
    QueueFullError,
    ReaderTooSlowError,
    RequestFailedError,
)
from tokenworks.engine.request import SamplingError, SamplingParams
from tokenworks.front.interface import EngineFront, Submission
from tokenworks.serve import api_times
from tokenworks.serve.errors import APIError, bad_request
from tokenworks.serve.lab_records import RecordsFolder
from tokenworks.serve.limits import ServerLimits
from tokenworks.serve.metrics import ServerMetrics
from tokenworks.serve.reasoning import Reasoning
from tokenworks.serve.response_store import ResponseStore
from tokenworks.serve.tool_formats import ToolFormat
from tokenworks.serve.tools import Tool, prepare_messages
from tokenworks.tokenizer.chat import ChatTemplate, ChatTemplateError

if TYPE_CHECKING:
    from tokenworks.serve.remote import RemoteBackend


@dataclass
class ServerState:
    engine: EngineFront
    model_names: list[str]  # the first is the name /v1/models reports
    metrics: ServerMetrics
    request_timeout: float | None = None  # seconds; a request's own deadline may be shorter
    retry_after_s: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    limits: ServerLimits = field(default_factory=ServerLimits)
    # API keys; with any, every endpoint but /health (and /metrics unless
    # metrics_require_key) needs one, and with tenant_salts each key's requests get a
    # prefix-cache salt of their own: tenants never share cached blocks, so one cannot
    # tell from its time to first token what another has sent
    api_keys: tuple[str, ...] = ()
    metrics_require_key: bool = False
    tenant_salts: bool = True
    embedding_pooling: str = "mean"  # how /v1/embeddings pools (SamplingParams.pooling)
    reasoning: Reasoning | None = None  # the model's think markers (serve/reasoning.py)
    chat_template: ChatTemplate | None = None  # --chat-template, over the model's own
    tool_format: ToolFormat = field(default_factory=ToolFormat)  # how the model writes calls
    responses: ResponseStore | None = None  # made from the limits
    # the other models this server serves, each behind a backend of its own (--backend
    # NAME=SPEC): name -> its ServerState, sharing this one's limits, keys and store
    others: dict[str, ServerState] = field(default_factory=dict)
    remote: RemoteBackend | None = None  # the model is an upstream's (serve/remote.py)
    # LoRA adapters served over this model (--lora-modules, /v1/load_lora_adapter): name ->
    # a view of this state whose requests run with that adapter
    adapters: dict[str, ServerState] = field(default_factory=dict)
    lora: str | None = None  # the adapter this view's requests run with
    lora_path: str | None = None
    parent: str | None = None  # an adapter's base model, by the name it is served under
    runtime_lora: bool = False  # adapters may be loaded and unloaded while serving
    records: RecordsFolder = field(default_factory=lambda: RecordsFolder(None))  # for /lab
    draining: bool = False  # shutting down: new requests get 503 (serve/guards.py's Drain)
    active: int = 0  # HTTP requests in flight, streams until their last event

    def __post_init__(self) -> None:
        if self.responses is None:
            limits = self.limits
            self.responses = ResponseStore(
                limits.max_stored_responses, limits.stored_response_ttl_s
            )

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def chat(self) -> ChatTemplate | None:
        """The chat template requests are rendered with."""
        return self.chat_template or self.tokenizer.chat

    def encode(self, text: str) -> list[int]:
        """A prompt's tokens (timed as the request's tokenize phase)."""
        with api_times.timing("tokenize"):
            return self.tokenizer.encode(text)

    @property
    def max_model_len(self) -> int | None:
        return None if self.remote is not None else self.engine.engine.max_model_len

    def for_model(self, name: str | None) -> ServerState:
        """The state of the model a request names (this one's, or another backend's)."""
        if name in self.model_names:
            return self
        if name in self.adapters:
            return self.adapters[name]
        if name in self.others:
            return self.others[name]
        raise APIError(
            404,
            f"the model {name!r} does not exist here; this server serves "
            f"{', '.join(map(repr, self.served_names))}",
            param="model",
            code="model_not_found",
        )

    @property
    def served_names(self) -> list[str]:
        return [*self.model_names, *self.adapters, *self.others]

    def add_adapter(self, name: str, path: str) -> None:
        """Serve LoRA adapter `name` (loaded in the engine already) under its own name."""
        self.adapters[name] = dataclasses.replace(
            self,
            model_names=[name],
            adapters={},
            others={},
            lora=name,
            lora_path=path,
            parent=self.model_names[0],
        )

    @property
    def fronts(self) -> list:
        """Every backend's engine front: this model's first."""
        return [self.engine, *(s.engine for s in self.others.values())]

    def deadline(self, requested: float | None) -> float | None:
        limits = [x for x in (requested, self.request_timeout) if x]
        return time.monotonic() + min(limits) if limits else None


def sampling_params(param_names: dict[str, str] | None = None, **kw) -> SamplingParams:
    """SamplingParams(**kw), with a range error turned into a 400 naming the field."""
    try:
        return SamplingParams(**kw)
    except SamplingError as e:
        message = str(e)
        field_name = message.split(" ", 1)[0]
        names = param_names or {}
        raise bad_request(message, names.get(field_name, field_name)) from e


def clamp_max_tokens(
    state: ServerState,
    requested: int | None,
    prompt_len: int,
    field_name: str = "max_tokens",
    prompt_field: str = "messages",
    n: int = 1,
) -> int:
    """max_tokens, or what is left of the context when the request does not say, after the
    engine's admission (engine/admission.py) says the request can be served: a refusal is
    a 400 naming the field to change, as vLLM's are."""
    admission = state.engine.engine.admission
    refusal = admission.check_lengths(prompt_len, requested, n, field_name)
    if refusal is not None:
        field = prompt_field if refusal.field == "prompt" else refusal.field
        raise bad_request(refusal.reason, field)
    return requested if requested is not None else admission.default_max_tokens(prompt_len)


def tenant_salt(state: ServerState, request: Request, salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its own cache_salt, under its API key's when
    keys are configured and tenant_salts is on (the key itself never leaves this
    function: the salt is a hash of it)."""
    key = getattr(request.state, "api_key", None)
    if not (state.tenant_salts and key):
        return salt
    tenant = hashlib.sha256(b"tokenworks-tenant\0" + key.encode()).hexdigest()[:16]
    return tenant if salt is None else f"{tenant}:{salt}"


# what render_chat passes the template itself: a request's chat_template_kwargs may not
CHAT_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def render_chat(state: ServerState, messages: list[dict], tools: list[Tool], **kwargs) -> str:
    chat = state.chat
    if chat is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    state.limits.check_messages(messages)
    with api_times.timing("template"):
        prepared, extra = prepare_messages(messages, tools, chat.source, state.tool_format)
        try:
            return chat.render(prepared, **extra, **kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from e


async def submit(
    state: ServerState,
    params: SamplingParams,
    prompt_ids: list[int],
    full_status: int = 429,  # a full queue's HTTP status (Anthropic's API says 529)
    **kw,
):
    """Queue a request; refusals become HTTP errors (400 bad input, 429/529 when full)."""
    try:
        stream = await state.engine.submit(Submission(params, prompt_ids, lora=state.lora, **kw))
        api_times.owns(stream)
        return stream
    except QueueFullError as e:
        wait = state.retry_after_s
        raise APIError(full_status, str(e), code="queue_full", retry_after=wait) from e
    except DeadlineExceededError as e:
        raise APIError(504, str(e), code="deadline_exceeded") from e
    except EngineNotRunningError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e
    except LoRANotFoundError as e:  # unloaded since the request named it
        raise APIError(404, str(e), param="model", code="model_not_found") from e
    except RequestFailedError as e:  # the engine failed before it said it took the request
        raise APIError(500, str(e), code="engine_failure") from e
    except ValueError as e:  # too long, too large, bad token ids, bad grammar
        raise bad_request(str(e), "prompt" if "prompt" in str(e) else None) from e


def stream_error(e: BaseException) -> APIError:
    """An error that ends a request already under way."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, DeadlineExceededError):
        return APIError(504, str(e), code="deadline_exceeded")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="engine_failure")
    if isinstance(e, EngineNotRunningError):
        return APIError(503, str(e), code="engine_unavailable")
    if isinstance(e, ReaderTooSlowError):
        return APIError(408, str(e), code="reader_too_slow")
    return APIError(500, f"internal error: {e}")


async def answer(state, request: Request, request_ids: list[str], items, stream: bool,
                 events, fold):  # fmt: skip
    """A protocol's answer from its assembled items (an async iterator of chunks or events):
    streamed, `events(items)` as server-sent events, the requests cancelled the moment the
    client leaves; or `fold(list of the items)` as one JSON body."""
    if stream:

        async def body():
            async with abort_on_disconnect(state, request, request_ids):
                async for event in events(items):
                    yield event

        return StreamingResponse(body(), media_type="text/event-stream")
    return respond(fold(await collect(request, items)))


async def collect(request: Request, updates) -> list:
    """Drain an async iterator of a request's updates (or of what is assembled from them);
    if the client disconnects first, cancel the request."""

    async def drain():
        return [u async for u in updates]

    task = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await updates.aclose()
    if task.cancelled():
        raise APIError(499, "the client went away")
    try:
        return task.result()
    except Exception as e:
        raise stream_error(e) from e


def sse(data: dict | str, event: str | None = None) -> str:
    with api_times.timing("respond"):
        payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        head = f"event: {event}\n" if event else ""
        return f"{head}data: {payload}\n\n"


def respond(body: dict):
    """A whole JSON response (timed as the request's respond phase)."""
    from fastapi.responses import JSONResponse

    with api_times.timing("respond"):
        return JSONResponse(body)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def abort_on_disconnect(state: ServerState, request: Request, request_ids: list[str]):
    """While a response streams, cancel its engine requests the moment the client leaves
    (the engine frees their blocks before its next step)."""
    watch = asyncio.ensure_future(_disconnected(request))

    def gone(task: asyncio.Future) -> None:
        if not task.cancelled():
            for rid in request_ids:
                state.engine.abort(rid)

    watch.add_done_callback(gone)
    try:
        yield
    finally:
        watch.cancel()


async def merge(streams: list) -> object:
    """Interleave several update streams (one per prompt) as their updates arrive:
    yields (stream number, update). The queue holds one update a stream: a pump takes the
    next only when its last was taken, so a client that reads slowly leaves its output in
    the request streams, where --max-stream-backlog and --max-stream-stall see it."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i, stream):
        try:
            async for u in stream:
                await queue.put((i, u, None))
        except Exception as e:
            await queue.put((i, None, e))
        finally:
            await queue.put((i, None, StopAsyncIteration()))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, u, e = await queue.get()
            if isinstance(e, StopAsyncIteration):
                live -= 1
            elif e is not None:
                raise e
            else:
                yield i, u
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()
