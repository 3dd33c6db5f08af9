"""The OpenAI Responses API: POST /v1/responses (streamed and not), GET and DELETE
/v1/responses/{id}.

A request is a chat underneath: `instructions`, the `input` items (messages, function
calls and their outputs) and, with `previous_response_id`, the stored conversation before
them become chat messages; the answer is the chat assembler's chunks (serve/
openai_answer.py, the same parsing of thinking, text and tool calls) turned into the
Responses API's output items (reasoning, message, function_call) and its stream events
(response.created ... response.completed, each with its sequence_number). The
non-streamed body is the response the last event carries, so the two cannot disagree.

Responses are kept (`store`, on by default) in a bounded in-memory store: at most
--max-stored-responses, each for --stored-response-ttl seconds, the oldest dropped
first, each visible only to the API key that made it. A server restart forgets them.
"""

from __future__ import annotations

import copy
import secrets
import time

from fastapi import APIRouter, Request

from tokenworks.engine.request import StructuredOutput
from tokenworks.serve import api_times, tools
from tokenworks.serve.chat_job import ChatJob, remote_chunks, start
from tokenworks.serve.common import (
    ServerState,
    answer,
    sse,
    stream_error,
    tenant_salt,
)
from tokenworks.serve.errors import APIError, bad_request
from tokenworks.serve.openai import chat_messages
from tokenworks.serve.openai_answer import chat_chunks
from tokenworks.serve.protocol import ResponsesRequest
from tokenworks.serve.reasoning import EFFORT_BUDGETS

router = APIRouter()


def _not_found(rid: str, field: str | None = None) -> APIError:
    return APIError(404, f"no stored response {rid!r} here (expired, deleted or never stored)",
                    param=field, code="response_not_found")  # fmt: skip


# ------------------------------------------------------------------ the request as a chat


def _input_text(content, where: str) -> str:
    """An input message's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(
                f"{where}.content[{j}] is of type {kind!r}; only text parts are supported",
                "input",
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(items) -> list[dict]:
    """The request's input as OpenAI chat messages: a string is one user message;
    function_call items join the assistant message before them as its tool calls, and
    function_call_output items become tool messages. Reasoning items are dropped (a
    template does not show a model its earlier thinking)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role must be user, system, developer or assistant; got {role!r}",
                    "input",
                )
            out.append({"role": role, "content": _input_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else _input_text(output, where),
            })  # fmt: skip
        elif kind != "reasoning":
            raise bad_request(
                f"{where}.type {kind!r} is not supported here (message, function_call, "
                "function_call_output, reasoning)",
                "input",
            )
    return chat_messages(out)


def _tools(body: ResponsesRequest) -> list[tools.Tool]:
    """Function tools, flat as the Responses API writes them."""
    wrapped = []
    for i, t in enumerate(body.tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"tools[{i}] is of type {kind!r}; only function tools are "
                              "supported here", "tools")  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        wrapped.append({"type": "function", "function": fn})
    return tools.openai_tools(wrapped)


def _choice(choice) -> str | dict | None:
    """tool_choice in the chat API's shape."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: dict | None) -> StructuredOutput | None:
    """text.format: text, json_object, or json_schema (its schema inline)."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return StructuredOutput.json()
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return StructuredOutput.json(fmt["schema"])
    raise bad_request(
        'text.format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "name": ..., "schema": {...}}',
        "text.format",
    )


# ------------------------------------------------------------------ the endpoints


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    api_times.handler_entered()
    state: ServerState = request.app.state.tokenworks
    state = state.for_model(body.model)
    state.limits.check_tools(body.tools)
    owner = tenant_salt(state, request, None)
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id, owner)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = copy.deepcopy(previous.conversation)
    conversation = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tool_list = _tools(body)
    mode, name = tools.openai_choice(_choice(body.tool_choice), tool_list)
    try:
        output = _format(body.text)
    except ValueError as e:
        raise bad_request(str(e), "text.format") from e
    job = ChatJob(
        system + conversation,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        tools=tool_list,
        tool_mode=mode,
        tool_name=name,
        parallel_tool_calls=body.parallel_tool_calls,
        output=output,
        reasoning_effort=_effort((body.reasoning or {}).get("effort")),
        timeout=body.deadline,
        names={"max_tokens": "max_output_tokens", "messages": "input",
               "reasoning_effort": "reasoning.effort"},
        tool_conflict="tool_choice required or a function cannot be combined with text.format",
        id_prefix="resp",
    )  # fmt: skip
    response = _response_shell(body, "resp_" + secrets.token_hex(12), mode, name)

    def keep(final: dict) -> None:
        if body.store:
            state.responses.put(final["id"], owner, conversation + [_as_message(final)], final)

    fold = lambda events: events[-1]["response"]  # noqa: E731
    if state.remote is not None:
        items = response_events(remote_chunks(state, job), response, keep)
        return await answer(state, request, [], items, body.stream, stream_body, fold)
    started = await start(state, request, job)
    chunks = chat_chunks(job, started.updates, lambda: started.parser(state))
    items = response_events(chunks, response, keep)
    return await answer(state, request, [started.request_id], items, body.stream, stream_body,
                        fold)  # fmt: skip


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    api_times.handler_entered()
    state: ServerState = request.app.state.tokenworks
    item = state.responses.get(response_id, tenant_salt(state, request, None))
    if item is None:
        raise _not_found(response_id)
    return item.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    api_times.handler_entered()
    state: ServerState = request.app.state.tokenworks
    if not state.responses.delete(response_id, tenant_salt(state, request, None)):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _effort(effort) -> str | None:
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise bad_request(
            f"reasoning.effort {effort!r} is not one of {', '.join(EFFORT_BUDGETS)}",
            "reasoning.effort",
        )
    return effort


# ------------------------------------------------------------------ the answer


def _response_shell(body: ResponsesRequest, rid: str, mode: str, name: str | None) -> dict:
    choice = {"type": "function", "name": name} if mode == "named" else mode
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": body.model,
        "output": [],
        "instructions": body.instructions,
        "tools": body.tools or [],
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "text": body.text or {"format": {"type": "text"}},
        "reasoning": body.reasoning,
        "store": body.store,
        "metadata": body.metadata or {},
        "incomplete_details": None,
        "error": None,
        "usage": None,
    }


def _as_message(response: dict) -> dict:
    """A response's output as the assistant message of the stored conversation."""
    text, calls = "", []
    for item in response["output"]:
        if item["type"] == "message":
            text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            fn = {"name": item["name"], "arguments": item["arguments"]}
            calls.append({"id": item["call_id"], "type": "function", "function": fn})
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


_PARTS = {"message": "output_text", "reasoning": "reasoning_text"}


async def response_events(chunks, response: dict, keep):
    """The Responses API's stream events from the chat assembler's chunks; the last,
    response.completed (or .incomplete), carries the whole response, handed to keep()."""
    seq = 0
    output = response["output"]
    current: dict | None = None  # the output item being written

    def event(kind: str, **data) -> dict:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **data}

    def snapshot() -> dict:
        return copy.deepcopy(response)

    def open_item(item: dict):
        nonlocal current
        current = item
        output.append(item)
        at = len(output) - 1
        yield event("response.output_item.added", output_index=at, item=copy.deepcopy(item))
        if item["type"] in _PARTS:
            part = {"type": _PARTS[item["type"]], "text": ""}
            if item["type"] == "message":
                part["annotations"] = []
            item["content"].append(part)
            yield event("response.content_part.added", item_id=item["id"], output_index=at,
                        content_index=0, part=copy.deepcopy(part))  # fmt: skip

    def close_item():
        nonlocal current
        if current is None:
            return
        item, at, current = current, len(output) - 1, None
        where = {"item_id": item["id"], "output_index": at}
        if item["type"] == "function_call":
            yield event("response.function_call_arguments.done", **where,
                        arguments=item["arguments"], name=item["name"])  # fmt: skip
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else (
                "response.reasoning_text.done")  # fmt: skip
            yield event(kind, **where, content_index=0, text=part["text"])
            yield event("response.content_part.done", **where, content_index=0,
                        part=copy.deepcopy(part))  # fmt: skip
        item["status"] = "completed"
        yield event("response.output_item.done", output_index=at, item=copy.deepcopy(item))

    def text_into(kind: str, text: str):
        if current is None or current["type"] != kind:
            yield from close_item()
            prefix = "msg_" if kind == "message" else "rs_"
            item = {"id": prefix + secrets.token_hex(12), "type": kind, "status": "in_progress",
                    "content": []}  # fmt: skip
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            yield from open_item(item)
        part = current["content"][0]
        part["text"] += text
        name = "response.output_text.delta" if kind == "message" else (
            "response.reasoning_text.delta")  # fmt: skip
        extra = {"logprobs": []} if kind == "message" else {}
        yield event(name, item_id=current["id"], output_index=len(output) - 1,
                    content_index=0, delta=text, **extra)  # fmt: skip

    yield event("response.created", response=snapshot())
    yield event("response.in_progress", response=snapshot())
    finish = None
    async for chunk in chunks:
        if chunk.get("usage"):
            u = chunk["usage"]
            response["usage"] = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": u.get("prompt_tokens_details") or {"cached_tokens": 0},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": u.get("completion_tokens_details",
                                               {"reasoning_tokens": 0}),
                "total_tokens": u["total_tokens"],
            }  # fmt: skip
        for c in chunk["choices"]:
            d = c["delta"]
            if d.get("reasoning_content"):
                for e in text_into("reasoning", d["reasoning_content"]):
                    yield e
            if d.get("content"):
                for e in text_into("message", d["content"]):
                    yield e
            for call in d.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id"):  # a new call: its id and name
                    for e in close_item():
                        yield e
                    item = {"id": "fc_" + secrets.token_hex(12), "type": "function_call",
                            "call_id": call["id"], "name": fn.get("name", ""),
                            "arguments": "", "status": "in_progress"}  # fmt: skip
                    for e in open_item(item):
                        yield e
                piece = fn.get("arguments") or ""
                if piece and current is not None and current["type"] == "function_call":
                    current["arguments"] += piece
                    yield event("response.function_call_arguments.delta", item_id=current["id"],
                                output_index=len(output) - 1, delta=piece)  # fmt: skip
            finish = c.get("finish_reason") or finish
    for e in close_item():
        yield e
    if finish == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    final = snapshot()
    keep(final)
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(kind, response=final)


def stream_body(events):
    """The events as server-sent events (each named by its type); an error event if the
    engine fails."""

    async def sse_events():
        try:
            async for e in events:
                yield sse(e, event=e["type"])
        except Exception as e:
            body = stream_error(e).openai_body()
            yield sse({"type": "error", **body["error"]}, event="error")

    return sse_events()
