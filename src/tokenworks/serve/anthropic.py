"""The Anthropic Messages API: POST /v1/messages, streamed and not.

A streamed answer is the exact event sequence the Anthropic SDK expects: message_start,
then per content block content_block_start / content_block_delta (text_delta, or
input_json_delta for a tool_use block) / content_block_stop, then message_delta (stop
reason and output tokens) and message_stop. The non-streamed answer is those same events
folded into one message, so the two cannot disagree.
"""

from __future__ import annotations

import json
import secrets

from fastapi import APIRouter, Request

from tokenworks.serve import api_times, remote, structured, tools
from tokenworks.serve.answer_parser import AnswerStep
from tokenworks.serve.chat_job import ChatJob, offered_tools, remote_chunks, render, start
from tokenworks.serve.common import ServerState, answer, sse, stream_error
from tokenworks.serve.errors import bad_request
from tokenworks.serve.protocol import AnthropicMessagesRequest, AnthropicPrompt

router = APIRouter()


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", "messages")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") not in ("text", "tool_use", "tool_result"):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad_request(
                f"{where}.content.{j} has type {kind!r}; supported: text, tool_use, tool_result",
                "messages",
            )
    return content


def _result_text(content) -> str:
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return "" if content is None else str(content)


def to_chat_messages(body: AnthropicPrompt) -> list[dict]:
    """Anthropic messages -> the OpenAI-shaped messages the chat template is fed."""
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _result_text(body.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(
                f"messages.{i}.role must be user or assistant; got {role!r}", "messages"
            )
        blocks = _blocks(m.get("content"), f"messages.{i}")
        text = "".join(b.get("text", "") for b in blocks if b["type"] == "text")
        if role == "assistant":
            calls = [
                {
                    "id": b.get("id"),
                    "type": "function",
                    "function": {
                        "name": b.get("name"),
                        "arguments": json.dumps(b.get("input", {})),
                    },
                }
                for b in blocks
                if b["type"] == "tool_use"
            ]
            msg = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in blocks:
            if b["type"] == "tool_result":
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.get("tool_use_id"),
                        "content": _result_text(b.get("content")),
                    }
                )
        if text or not any(b["type"] == "tool_result" for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def _input(arguments: str) -> dict:
    """A tool_use block's input: the call's arguments, {} if the model broke the JSON."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def _stop_reason(finish: str | None, stop_reason, has_calls: bool) -> tuple[str, str | None]:
    if has_calls and finish == "stop":
        return "tool_use", None
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP.get(finish or "stop", "end_turn"), None


def parse_messages(state: ServerState, body: AnthropicPrompt, output=None) -> ChatJob:
    """A Messages request's conversation, tools and thinking (and, for POST /v1/messages,
    its sampling) as the job every protocol's requests become. Thinking disabled: a
    budget of 0, and the template is told (Qwen3's enable_thinking)."""
    state.limits.check_tools(body.tools)
    tool_list = tools.anthropic_tools(body.tools)
    mode, name = tools.anthropic_choice(body.tool_choice, tool_list)
    think = body.thinking
    disabled = think is not None and think.type == "disabled"
    job = ChatJob(
        to_chat_messages(body),
        tools=tool_list,
        tool_mode=mode,
        tool_name=name,
        output=output,
        reasoning_budget=0 if disabled else (think.budget_tokens if think is not None else None),
        template_kwargs={"enable_thinking": False} if disabled else {},
        names={"stop": "stop_sequences", "max_reasoning_tokens": "thinking.budget_tokens"},
        tool_conflict="tool_choice any or tool cannot be combined with an output format",
        id_prefix="msg",
        call_id_prefix="toolu_",
        full_status=529,
    )
    if isinstance(body, AnthropicMessagesRequest):
        job.max_tokens, job.temperature, job.top_p = body.max_tokens, body.temperature, body.top_p
        job.top_k, job.seed, job.timeout = body.top_k, body.seed, body.deadline
        job.stop = list(body.stop_sequences or [])
    return job


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: AnthropicPrompt, request: Request):
    """The tokens a Messages request with this conversation, system prompt and tools would
    read (its template and tool descriptions included)."""
    api_times.handler_entered()
    state = request.app.state.tokenworks.for_model(body.model)
    job = parse_messages(state, body)
    if state.remote is not None:  # the upstream's own count (vLLM's /tokenize)
        messages = {"model": state.remote.model, "messages": job.messages}
        counted = await state.remote.post("/tokenize", messages, state.deadline(None), root=True)
        return {"input_tokens": counted["count"]}
    offered, _ = offered_tools(state, job)
    return {"input_tokens": len(state.encode(render(state, job, offered)))}


@router.post("/v1/messages")
async def messages(body: AnthropicMessagesRequest, request: Request):
    api_times.handler_entered()
    state: ServerState = request.app.state.tokenworks.for_model(body.model)
    message_id = "msg_" + secrets.token_hex(12)
    job = parse_messages(state, body, structured.from_anthropic(body))
    if state.remote is not None:
        steps = remote.chunk_steps(remote_chunks(state, job))
        items = message_events(body, steps, message_id)
        return await answer(state, request, [], items, body.stream, stream_body, fold_message)
    started = await start(state, request, job)
    items = message_events(body, engine_steps(started.updates, started.parser(state)), message_id)
    return await answer(
        state, request, [started.request_id], items, body.stream, stream_body, fold_message
    )


def _usage(input_tokens: int, output_tokens: int, cached: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


_BLOCKS = {  # an answer event -> its content block, and its deltas' type and field
    "text": ({"type": "text", "text": ""}, "text_delta", "text"),
    "reasoning": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta",
                  "thinking"),
}  # fmt: skip


async def engine_steps(updates, parser):
    """The engine's updates as AnswerSteps, their text read through parser
    (serve/answer_parser.py)."""
    try:
        async for u in updates:
            if not u.deltas:
                yield AnswerStep(u.prompt_tokens, u.cached_tokens, [], 0)
            for d in u.deltas:
                finished = d.finish_reason is not None
                events = parser.feed(d.text, finished)
                yield AnswerStep(u.prompt_tokens, u.cached_tokens, events, len(d.token_ids),
                                 d.finish_reason, d.stop_reason)  # fmt: skip
    finally:
        await updates.aclose()  # the request ends with its answer, however that ends


async def message_events(body, steps, message_id: str):
    """The answer as the Messages API's stream events, (type, data), from its AnswerSteps
    (engine_steps, or serve/remote.py's from an upstream's chunks): message_start; per
    content block content_block_start, content_block_delta (thinking_delta for a thinking
    block, text_delta, or input_json_delta for a tool_use block) and content_block_stop;
    then message_delta (stop reason, output tokens) and message_stop."""
    index = -1  # the open content block, if any
    open_kind = None  # "text" or "reasoning" while such a block is open
    has_calls = False
    output_tokens = 0

    def blocks_for(events):
        nonlocal index, open_kind, has_calls
        for kind, value in events:
            if open_kind is not None and kind != open_kind:
                yield "content_block_stop", {"index": index}
                open_kind = None
            if kind in _BLOCKS:
                block, delta_type, key = _BLOCKS[kind]
                if open_kind is None:
                    index += 1
                    open_kind = kind
                    yield "content_block_start", {"index": index, "content_block": dict(block)}
                delta = {"type": delta_type, key: value}
                yield "content_block_delta", {"index": index, "delta": delta}
                continue
            if kind == "call_start":
                has_calls = True
                index += 1
                block = {"type": "tool_use", "id": value.id, "name": value.name, "input": {}}
                yield "content_block_start", {"index": index, "content_block": block}
            elif kind == "call_args":
                delta = {"type": "input_json_delta", "partial_json": value}
                yield "content_block_delta", {"index": index, "delta": delta}
            else:  # call_end
                yield "content_block_stop", {"index": index}

    try:
        first = True
        async for step in steps:
            if first:
                first = False
                message = {
                    "id": message_id, "type": "message", "role": "assistant",
                    "model": body.model, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": _usage(step.prompt_tokens, 0, step.cached_tokens),
                }  # fmt: skip
                yield "message_start", {"message": message}
            output_tokens += step.tokens
            for event in blocks_for(step.events):
                yield event
            if step.finish is not None:
                if open_kind is not None:
                    yield "content_block_stop", {"index": index}
                    open_kind = None
                reason, sequence = _stop_reason(step.finish, step.stop_reason, has_calls)
                usage = {"output_tokens": output_tokens}
                if step.known_usage:  # (an upstream says its counts at the end)
                    usage = _usage(step.prompt_tokens, output_tokens, step.cached_tokens)
                delta = {"stop_reason": reason, "stop_sequence": sequence}
                yield "message_delta", {"delta": delta, "usage": usage}
                yield "message_stop", {}
    finally:
        await steps.aclose()  # (and so the request, however the answer ends)


def stream_body(events):
    """The events as server-sent events; an error event if the engine fails."""

    async def sse_events():
        try:
            async for kind, data in events:
                yield sse({"type": kind, **data}, event=kind)
        except Exception as e:
            yield sse(stream_error(e).anthropic_body(), event="error")

    return sse_events()


def fold_message(events: list[tuple[str, dict]]) -> dict:
    """The non-streamed answer: the events folded into one message (each tool_use block's
    input the JSON its deltas spelled out)."""
    message: dict = {}
    partial: dict[int, str] = {}  # a tool_use block's arguments, as they came
    for kind, data in events:
        if kind == "message_start":
            message = dict(data["message"], content=[])
        elif kind == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            delta, block = data["delta"], message["content"][data["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = _input(partial[data["index"]])
        elif kind == "message_delta":
            message.update(data["delta"])
            message["usage"] = dict(message["usage"], **data["usage"])
    return message
