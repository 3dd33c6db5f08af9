"""The OpenAI API: /v1/completions, /v1/chat/completions and /v1/models, streamed and not.

Every request becomes one engine request per prompt (n completions share its prompt's KV
blocks); the answer is assembled from the engine's updates, so the streamed text is the
non-streamed text cut into pieces.
"""

from __future__ import annotations

import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tokenworks.engine.request import TokenLogprob
from tokenworks.serve import api_times, structured, tools
from tokenworks.serve.common import (
    CHAT_TEMPLATE_RESERVED,
    ServerState,
    abort_on_disconnect,
    clamp_max_tokens,
    collect,
    merge,
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
from tokenworks.serve.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


def _state(request: Request) -> ServerState:
    api_times.handler_entered()
    return request.app.state.tokenworks


def _stop_list(body) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def _check_limits(state: ServerState, body, logprobs: int | None, logprobs_field: str) -> None:
    """The server's bounds on what the request asks (serve/limits.py)."""
    limits = state.limits
    limits.check_stop(_stop_list(body))
    limits.check_n(body.n)
    limits.check_logprobs(logprobs, logprobs_field)


def _common_params(body, max_tokens: int, logprobs: int | None, constraint) -> dict:
    return dict(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=_stop_list(body),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        n=body.n,
        structured=constraint,
    )


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ------------------------------------------------------------------ /v1/models


@router.get("/v1/models")
async def list_models(request: Request):
    state = _state(request)
    return {"object": "list", "data": [_model_card(state, name) for name in state.model_names]}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request):
    state = _state(request)
    return _model_card(state, state.check_model(name))


def _model_card(state: ServerState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "tokenworks",
        "root": state.model_names[0],
        "max_model_len": state.max_model_len,
    }


# ------------------------------------------------------------------ /v1/completions


def _completion_logprobs(lps: list[TokenLogprob], offset: int, as_ids: bool = False) -> dict:
    """as_ids: tokens named "token_id:N" (return_tokens_as_token_ids), offsets still in text."""
    tokens, offsets, pos = [], [], offset
    for lp in lps:
        tokens.append(f"token_id:{lp.token_id}" if as_ids else lp.token)
        offsets.append(pos)
        pos += len(lp.token)
    tops = [{f"token_id:{i}" if as_ids else t: v for i, t, v in lp.top} for lp in lps]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    state.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported (no fill-in-the-middle here)", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n here (no server-side ranking)", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, not supported", "echo")
    _check_limits(state, body, body.logprobs, "logprobs")
    prompts = _prompts(state, body.prompt)
    constraint = structured.from_openai(body)
    deadline = state.deadline(body.deadline)
    streams, ids = [], []
    try:
        for p in prompts:
            max_tokens = clamp_max_tokens(state, body.max_tokens, len(p), prompt_field="prompt")
            params = sampling_params(**_common_params(body, max_tokens, body.logprobs, constraint))
            rid = state.engine.new_request_id("cmpl")
            streams.append(
                await submit(
                    state,
                    params,
                    p,
                    request_id=rid,
                    deadline=deadline,
                    priority=body.priority,
                    cache_salt=tenant_salt(state, request, body.cache_salt),
                )
            )
            ids.append(rid)
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    response_id = "cmpl-" + secrets.token_hex(12)
    # the prompts as text, for echo only
    texts = (
        [state.tokenizer.decode(p, skip_special_tokens=False) for p in prompts] if body.echo else []
    )
    if body.stream:
        return StreamingResponse(
            _completion_stream(state, request, body, streams, ids, response_id, texts),
            media_type="text/event-stream",
        )
    updates = await collect(request, merge(streams))
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for i in range(len(prompts)):
        mine = [u for j, u in updates if j == i]
        prompt_tokens += mine[-1].prompt_tokens
        cached += mine[-1].cached_tokens
        for k, out in enumerate(merged_text(mine, body.n)):
            completion_tokens += len(out["token_ids"])
            prefix = texts[i] if body.echo else ""
            choices.append(
                {
                    "index": i * body.n + k,
                    "text": prefix + out["text"],
                    "logprobs": _completion_logprobs(
                        out["logprobs"], len(prefix), body.return_tokens_as_token_ids
                    )
                    if body.logprobs is not None
                    else None,
                    "finish_reason": out["finish_reason"],
                    "stop_reason": out["stop_reason"],
                }
            )
    return respond(
        {
            "id": response_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens, cached),
        }
    )


def _prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    state.limits.check_prompts(len(prompt))
    out = []
    for p in prompt:
        ids = state.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request("a prompt is empty: give at least one token", "prompt")
        out.append(ids)
    return out


def _chunker(body, response_id: str, kind: str, include_usage: bool):
    """chunk(choices, usage) -> one server-sent event of a streamed OpenAI response."""
    created = int(time.time())

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        c = {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": body.model,
            "choices": choices,
        }
        if include_usage:  # every chunk says usage (null until the last), as OpenAI does
            c["usage"] = usage
        return sse(c)

    return chunk


async def _completion_stream(state, request, body, streams, ids, response_id, texts):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = _chunker(body, response_id, "text_completion", include_usage)

    prompt_tokens = {}
    cached = {}
    completion_tokens = 0
    offsets = {}
    async with abort_on_disconnect(state, request, ids):
        try:
            if body.echo:
                for i, text in enumerate(texts):
                    for k in range(body.n):
                        yield chunk(
                            [
                                {
                                    "index": i * body.n + k,
                                    "text": text,
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
            async for i, u in merge(streams):
                prompt_tokens[i], cached[i] = u.prompt_tokens, u.cached_tokens
                choices = []
                for d in u.deltas:
                    index = i * body.n + d.index
                    completion_tokens += len(d.token_ids)
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = _completion_logprobs(
                            d.logprobs or [], offsets.get(index, 0), body.return_tokens_as_token_ids
                        )
                    offsets[index] = offsets.get(index, 0) + len(d.text)
                    if d.text or d.finish_reason or logprobs:
                        choices.append(
                            {
                                "index": index,
                                "text": d.text,
                                "logprobs": logprobs,
                                "finish_reason": d.finish_reason,
                                "stop_reason": d.stop_reason,
                            }
                        )
                if choices:
                    yield chunk(choices)
            if include_usage:
                p, c = sum(prompt_tokens.values()), sum(cached.values())
                yield chunk([], _usage(p, completion_tokens, c))
        except Exception as e:
            yield sse(stream_error(e).openai_body())
        yield sse("[DONE]")


# ------------------------------------------------------------------ /v1/chat/completions


def _text_of(content, where: str) -> str:
    """Message content: a string, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"{where}.content[{j}] is of type {kind!r}; only text parts are supported",
                    "messages",
                )
            texts.append(part.get("text", ""))
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", "messages")


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls: a list of {"function": {"name", "arguments"}}."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list of tool calls", "messages")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f'{where}.tool_calls[{j}] must be {{"type": "function", "function": '
                '{"name": ..., "arguments": ...}}',
                "messages",
            )
        if not isinstance(fn.get("arguments", "{}"), str | dict):
            raise bad_request(
                f"{where}.tool_calls[{j}].function.arguments must be a JSON string", "messages"
            )
    return calls


def chat_messages(raw: list) -> list[dict]:
    """OpenAI chat messages, checked, in the shape the chat template is fed."""
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with a role", "messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(
                f"messages[{i}].role must be system, developer, user, assistant or tool; "
                f"got {role!r}",
                "messages",
            )
        msg = {"role": "system" if role == "developer" else role}
        msg["content"] = _text_of(m.get("content"), f"messages[{i}]")
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}]")
        if role == "tool":
            call_id = m.get("tool_call_id")
            msg["tool_call_id"] = call_id if isinstance(call_id, str) else None
        out.append(msg)
    return out


def _chat_logprobs(lps: list[TokenLogprob], top: int) -> dict:
    def entry(token, logprob):
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for lp in lps:
        e = entry(lp.token, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for _, t, v in lp.top[:top]]
        content.append(e)
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    _check_limits(state, body, body.top_logprobs, "top_logprobs")
    state.limits.check_tools(body.tools)
    reserved = sorted(set(body.chat_template_kwargs or {}) & set(CHAT_TEMPLATE_RESERVED))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own "
            "fields (messages, tools, add_generation_prompt) do",
            "chat_template_kwargs",
        )
    tool_list = tools.openai_tools(body.tools)
    mode, name = tools.openai_choice(body.tool_choice, tool_list)
    offered, constraint = tools.resolve(
        tool_list,
        mode,
        name,
        structured.from_openai(body),
        "tool_choice required or named cannot be combined with response_format",
    )
    prompt = render_chat(
        state,
        chat_messages(body.messages),
        offered,
        add_generation_prompt=body.add_generation_prompt,
        **(body.chat_template_kwargs or {}),
    )
    prompt_ids = state.encode(prompt)
    requested = body.max_completion_tokens or body.max_tokens
    field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = clamp_max_tokens(state, requested, len(prompt_ids), field_name)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        {"logprobs": "top_logprobs"},
        **_common_params(body, max_tokens, logprobs, constraint),
    )
    rid = state.engine.new_request_id("chatcmpl")
    updates = await submit(
        state,
        params,
        prompt_ids,
        request_id=rid,
        deadline=state.deadline(body.deadline),
        priority=body.priority,
        cache_salt=tenant_salt(state, request, body.cache_salt),
    )
    response_id = "chatcmpl-" + secrets.token_hex(12)
    parse = bool(offered)
    if body.stream:
        return StreamingResponse(
            _chat_stream(state, request, body, updates, rid, response_id, parse),
            media_type="text/event-stream",
        )
    got = await collect(request, updates)
    choices, completion_tokens = [], 0
    for k, out in enumerate(merged_text(got, body.n)):
        completion_tokens += len(out["token_ids"])
        message = {"role": "assistant", "content": out["text"]}
        finish = out["finish_reason"]
        if parse:
            parser = tools.ToolCallParser()
            events = parser.feed(out["text"]) + parser.finish()
            text = "".join(e[1] for e in events if e[0] == "text")
            message["content"] = text or None
            if parser.calls:
                message["tool_calls"] = [_openai_call(c) for c in parser.calls]
                finish = "tool_calls" if finish == "stop" else finish
        choices.append(
            {
                "index": k,
                "message": message,
                "logprobs": _chat_logprobs(out["logprobs"], body.top_logprobs or 0)
                if body.logprobs
                else None,
                "finish_reason": finish,
                "stop_reason": out["stop_reason"],
            }
        )
    last = got[-1]
    return respond(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": _usage(last.prompt_tokens, completion_tokens, last.cached_tokens),
        }
    )


def _openai_call(c: tools.ToolCall, index: int | None = None) -> dict:
    """A tool call as OpenAI writes it; with an index, the opening delta of a streamed one
    (its arguments follow in pieces)."""
    arguments = "" if index is not None else c.arguments
    call = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}}
    if index is not None:
        call["index"] = index
    return call


async def _chat_stream(state, request, body, updates, rid, response_id, parse):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = _chunker(body, response_id, "chat.completion.chunk", include_usage)

    def choice(index, delta, finish=None, logprobs=None):
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    parsers = {k: tools.ToolCallParser() for k in range(body.n)}
    ncalls = dict.fromkeys(range(body.n), 0)
    completion_tokens, last = 0, None

    def deltas_of(k, events):
        out = []
        for kind, value in events:
            if kind == "text":
                out.append({"content": value})
            elif kind == "call_start":  # id, name and empty arguments, then the pieces
                out.append({"tool_calls": [_openai_call(value, ncalls[k])]})
            elif kind == "call_args":
                out.append({"tool_calls": [{"index": ncalls[k], "function": {"arguments": value}}]})
            else:  # call_end
                ncalls[k] += 1
        return out

    async with abort_on_disconnect(state, request, [rid]):
        try:
            yield chunk([choice(k, {"role": "assistant", "content": ""}) for k in range(body.n)])
            async for u in updates:
                last = u
                for d in u.deltas:
                    completion_tokens += len(d.token_ids)
                    logprobs = None
                    if body.logprobs:
                        logprobs = _chat_logprobs(d.logprobs or [], body.top_logprobs or 0)
                    if parse:
                        events = parsers[d.index].feed(d.text)
                        if d.finish_reason is not None:
                            events += parsers[d.index].finish()
                        pieces = deltas_of(d.index, events)
                    else:
                        pieces = [{"content": d.text}] if d.text else []
                    if logprobs and not pieces:
                        pieces = [{"content": ""}]
                    for j, delta in enumerate(pieces):
                        yield chunk([choice(d.index, delta, logprobs=logprobs if j == 0 else None)])
                    if d.finish_reason is not None:
                        finish = d.finish_reason
                        if parse and parsers[d.index].calls and finish == "stop":
                            finish = "tool_calls"
                        yield chunk([choice(d.index, {}, finish)])
            if include_usage and last is not None:
                usage = _usage(last.prompt_tokens, completion_tokens, last.cached_tokens)
                yield chunk([], usage)
        except Exception as e:
            yield sse(stream_error(e).openai_body())
        yield sse("[DONE]")
