"""The OpenAI API: /v1/completions, /v1/chat/completions and /v1/models, streamed and not.

Each body is parsed into serve/chat_job.py's job and goes through its one pipeline, one
engine request per prompt (n completions share its prompt's KV blocks); the answer is
assembled from the engine's updates once (serve/openai_answer.py): streamed as it comes,
or folded into one body.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request

from tokenworks.serve import api_times, structured, tools
from tokenworks.serve.chat_job import ChatJob, start
from tokenworks.serve.common import (
    CHAT_TEMPLATE_RESERVED,
    ServerState,
    answer,
    merge,
)
from tokenworks.serve.errors import bad_request
from tokenworks.serve.openai_answer import (
    chat_chunks,
    completion_chunks,
    fold_chat,
    fold_completion,
    head,
    stream_body,
)
from tokenworks.serve.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


def _state(request: Request) -> ServerState:
    api_times.handler_entered()
    return request.app.state.tokenworks


def _stop_list(body) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


# ------------------------------------------------------------------ /v1/models


@router.get("/v1/models")
async def list_models(request: Request):
    state = _state(request)
    cards = [_model_card(state.for_model(name), name) for name in state.served_names]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request):
    state = _state(request)
    return _model_card(state.for_model(name), name)


def _model_card(state: ServerState, name: str) -> dict:
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "tokenworks",
        "root": state.model_names[0],
        "max_model_len": state.max_model_len,
    }
    if state.lora is not None:  # an adapter: its file, over the base model (vLLM's shape)
        card |= {"root": state.lora_path, "parent": state.parent}
    return card


# ------------------------------------------------------------------ /v1/completions


def parse_completion(state: ServerState, body: CompletionRequest) -> ChatJob:
    """A completion's body as the job every protocol's requests become (its prompts are
    each submitted with it)."""
    if body.suffix:
        raise bad_request("suffix is not supported (no fill-in-the-middle here)", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n here (no server-side ranking)", "best_of")
    state.limits.check_logit_bias(body.logit_bias, state.engine.engine.admission.vocab_size)
    state.limits.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
    # echo with logprobs reports the prompt's tokens too, as OpenAI's legacy API did
    scored = [
        k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None
    ]
    fields = _shared_fields(body)
    fields["sampling"]["prompt_logprobs"] = max(scored) if scored else None
    return ChatJob(
        [],
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        names={"messages": "prompt"},
        id_prefix="cmpl",
        **fields,
    )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    state = state.for_model(body.model)
    if state.remote is not None:  # an OpenAI upstream takes the body as it came
        raw = await request.json()
        return await state.remote.relay(
            raw, "/completions", body.model, state.deadline(body.deadline)
        )
    job = parse_completion(state, body)
    prompts = prompt_token_lists(state, body.prompt)
    started = []
    try:
        for p in prompts:
            started.append(await start(state, request, job, p))
    except BaseException:
        for s in started:
            await s.updates.aclose()
        raise
    # the prompts as text (and each one's first token, which has no logprob), for echo only
    decode = state.tokenizer.decode
    echoed = [
        (decode(p, skip_special_tokens=False), p[0], decode(p[:1], False))
        for p in (prompts if body.echo else [])
    ]
    chunks = completion_chunks(body, merge([s.updates for s in started]), echoed)
    top = head("cmpl-" + secrets.token_hex(12), "text_completion", body.model)
    return await answer(
        state, request, [s.request_id for s in started], chunks, body.stream,
        lambda items: stream_body(items, top, _include_usage(body)),
        lambda items: fold_completion(items, top),
    )  # fmt: skip


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def prompt_token_lists(state: ServerState, prompt, field: str = "prompt") -> list[list[int]]:
    """A text, texts, token ids or lists of them (the OpenAI API's prompt, and input): each
    one's tokens."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request(f"{field} is empty", field)
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    state.limits.check_prompts(len(prompt), field)
    out = []
    for p in prompt:
        ids = state.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request(f"one {field} is empty: give at least one token", field)
        out.append(ids)
    return out


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


def parse_chat(state: ServerState, body: ChatCompletionRequest) -> ChatJob:
    """A chat completion's body as the job every protocol's requests become."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    state.limits.check_logit_bias(body.logit_bias, state.engine.engine.admission.vocab_size)
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
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    return ChatJob(
        chat_messages(body.messages),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        tools=tool_list,
        tool_mode=mode,
        tool_name=name,
        parallel_tool_calls=body.parallel_tool_calls,
        reasoning_budget=body.max_reasoning_tokens,
        reasoning_effort=body.reasoning_effort,
        template_kwargs=body.chat_template_kwargs or {},
        add_generation_prompt=body.add_generation_prompt,
        names={"logprobs": "top_logprobs", "max_tokens": max_tokens_field},
        tool_conflict="tool_choice required or named cannot be combined with response_format",
        **_shared_fields(body),
    )


def _shared_fields(body) -> dict:
    """The job's fields a completion and a chat completion name alike (their bodies share
    the sampling fields, and the response format)."""
    return dict(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=_stop_list(body),
        n=body.n,
        sampling=_extra_sampling(body),
        output=structured.from_openai(body),
        skip_special_tokens=body.skip_special_tokens,
        priority=body.priority,
        cache_salt=body.cache_salt,
        timeout=body.deadline,
    )


def _extra_sampling(body) -> dict:
    """OpenAI's (and vLLM's) sampling fields beyond those every protocol has."""
    return dict(
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    state = state.for_model(body.model)
    if state.remote is not None:  # an OpenAI upstream takes the body as it came
        raw, deadline = await request.json(), state.deadline(body.deadline)
        return await state.remote.relay(raw, "/chat/completions", body.model, deadline)
    job = parse_chat(state, body)
    started = await start(state, request, job)
    chunks = chat_chunks(job, started.updates, lambda: started.parser(state))
    top = head("chatcmpl-" + secrets.token_hex(12), "chat.completion.chunk", body.model)
    return await answer(
        state, request, [started.request_id], chunks, body.stream,
        lambda items: stream_body(items, top, _include_usage(body)),
        lambda items: fold_chat(items, top, bool(started.offered), job.logprobs is not None),
    )  # fmt: skip
