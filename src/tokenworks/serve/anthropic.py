"""The Anthropic Messages API: POST /v1/messages, streamed and not.

A streamed answer is the exact event sequence the Anthropic SDK expects: message_start,
then per content block content_block_start / content_block_delta (text_delta, or
input_json_delta for a tool_use block) / content_block_stop, then message_delta (stop
reason and output tokens) and message_stop.
"""

from __future__ import annotations

import json
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tokenworks.serve import api_times, structured, tools
from tokenworks.serve.common import (
    ServerState,
    abort_on_disconnect,
    clamp_max_tokens,
    collect,
    merged_text,
    render_chat,
    respond,
    sampling_params,
    sse,
    stream_error,
    submit,
    tenant_salt,
)
from tokenworks.serve.errors import bad_request
from tokenworks.serve.protocol import AnthropicMessagesRequest

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


def to_chat_messages(body: AnthropicMessagesRequest) -> list[dict]:
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


@router.post("/v1/messages")
async def messages(body: AnthropicMessagesRequest, request: Request):
    api_times.handler_entered()
    state: ServerState = request.app.state.tokenworks
    state.check_model(body.model)
    state.limits.check_stop(list(body.stop_sequences or []), "stop_sequences")
    state.limits.check_tools(body.tools)
    tool_list = tools.anthropic_tools(body.tools)
    mode, name = tools.anthropic_choice(body.tool_choice, tool_list)
    offered, constraint = tools.resolve(
        tool_list,
        mode,
        name,
        structured.from_anthropic(body),
        "tool_choice any or tool cannot be combined with an output format",
    )
    prompt = render_chat(state, to_chat_messages(body), offered)
    prompt_ids = state.encode(prompt)
    max_tokens = clamp_max_tokens(state, body.max_tokens, len(prompt_ids))
    params = sampling_params(
        {"stop": "stop_sequences"},
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=list(body.stop_sequences or []),
        structured=constraint,
    )
    rid = state.engine.new_request_id("msg")
    updates = await submit(
        state,
        params,
        prompt_ids,
        anthropic=True,
        request_id=rid,
        deadline=state.deadline(body.deadline),
        cache_salt=tenant_salt(state, request, None),
    )
    message_id = "msg_" + secrets.token_hex(12)
    parse = bool(offered)
    if body.stream:
        return StreamingResponse(
            _stream(state, request, body, updates, rid, message_id, parse),
            media_type="text/event-stream",
        )
    try:
        got = await collect(request, updates)
    except Exception as e:
        raise stream_error(e) from e
    out = merged_text(got, 1)[0]
    content: list[dict] = []
    has_calls = False
    if parse:
        parser = tools.ToolCallParser("toolu_")
        for kind, value in parser.feed(out["text"]) + parser.finish():
            if kind == "text":
                content.append({"type": "text", "text": value})
            elif kind == "call_end":
                has_calls = True
                content.append(
                    {
                        "type": "tool_use",
                        "id": value.id,
                        "name": value.name,
                        "input": _input(value.arguments),
                    }
                )
    elif out["text"]:
        content.append({"type": "text", "text": out["text"]})
    stop_reason, stop_sequence = _stop_reason(out["finish_reason"], out["stop_reason"], has_calls)
    last = got[-1]
    return respond(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": last.prompt_tokens,
                "output_tokens": len(out["token_ids"]),
                "cache_read_input_tokens": last.cached_tokens,
                "cache_creation_input_tokens": 0,
            },
        }
    )


async def _stream(state, request, body, updates, rid, message_id, parse):
    parser = tools.ToolCallParser("toolu_")
    index = -1  # the open content block, if any
    open_text = False
    output_tokens = 0
    has_calls = False

    def event(kind: str, data: dict) -> str:
        return sse({"type": kind, **data}, event=kind)

    def blocks_for(events):
        nonlocal index, open_text, has_calls
        for kind, value in events:
            if kind == "text":
                if not open_text:
                    index += 1
                    open_text = True
                    yield event(
                        "content_block_start",
                        {"index": index, "content_block": {"type": "text", "text": ""}},
                    )
                yield event(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "text_delta", "text": value}},
                )
                continue
            if kind == "call_start":
                if open_text:
                    yield event("content_block_stop", {"index": index})
                    open_text = False
                has_calls = True
                index += 1
                block = {"type": "tool_use", "id": value.id, "name": value.name, "input": {}}
                yield event("content_block_start", {"index": index, "content_block": block})
            elif kind == "call_args":
                delta = {"type": "input_json_delta", "partial_json": value}
                yield event("content_block_delta", {"index": index, "delta": delta})
            else:  # call_end
                yield event("content_block_stop", {"index": index})

    async with abort_on_disconnect(state, request, [rid]):
        try:
            first = True
            async for u in updates:
                if first:
                    first = False
                    yield event(
                        "message_start",
                        {
                            "message": {
                                "id": message_id,
                                "type": "message",
                                "role": "assistant",
                                "model": body.model,
                                "content": [],
                                "stop_reason": None,
                                "stop_sequence": None,
                                "usage": {
                                    "input_tokens": u.prompt_tokens,
                                    "output_tokens": 0,
                                    "cache_read_input_tokens": u.cached_tokens,
                                    "cache_creation_input_tokens": 0,
                                },
                            }
                        },
                    )
                for d in u.deltas:
                    output_tokens += len(d.token_ids)
                    if parse:
                        events = parser.feed(d.text)
                        if d.finish_reason is not None:
                            events += parser.finish()
                    else:
                        events = [("text", d.text)] if d.text else []
                    for e in blocks_for(events):
                        yield e
                    if d.finish_reason is not None:
                        if open_text:
                            yield event("content_block_stop", {"index": index})
                            open_text = False
                        reason, sequence = _stop_reason(d.finish_reason, d.stop_reason, has_calls)
                        yield event(
                            "message_delta",
                            {
                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                "usage": {"output_tokens": output_tokens},
                            },
                        )
                        yield event("message_stop", {})
        except Exception as e:
            yield sse(stream_error(e).anthropic_body(), event="error")
