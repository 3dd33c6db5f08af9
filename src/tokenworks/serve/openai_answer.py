"""OpenAI answers, assembled once: the chunks of a streamed answer are made here from the
engine's updates, and the non-streamed answer is those same chunks folded together, so
the two cannot disagree (text, logprobs, tool calls, finish and stop reasons, usage).

A chunk is {"choices": [...]} with, last of all, {"choices": [], "usage": {...}}.
"""

from __future__ import annotations

import time

from tokenworks.engine.request import TokenLogprob
from tokenworks.serve import tools
from tokenworks.serve.common import sse, stream_error


def usage(
    prompt_tokens: int, completion_tokens: int, cached: int, reasoning: int | None = None
) -> dict:
    """reasoning: of the completion tokens, the thinking's (chat answers say it)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def completion_logprobs(lps: list[TokenLogprob], offset: int, as_ids: bool = False) -> dict:
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


def chat_logprobs(lps: list[TokenLogprob], top: int) -> dict:
    def entry(token, logprob):
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for lp in lps:
        e = entry(lp.token, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for _, t, v in lp.top[:top]]
        content.append(e)
    return {"content": content}


# ------------------------------------------------------------------ the chunks


def prompt_logprobs_of(lps: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first), the token and its top
    alternatives by id, each {"logprob", "rank", "decoded_token"}."""

    def entry(lp: TokenLogprob) -> dict:
        out = {str(i): {"logprob": v, "rank": r, "decoded_token": t}
               for r, (i, t, v) in enumerate(lp.top, 1)}  # fmt: skip
        out.setdefault(
            str(lp.token_id), {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}
        )
        return out

    return [None if lp is None else entry(lp) for lp in lps]


def _echo(index: int, echoed: tuple, lps: list | None, as_ids: bool) -> dict:
    """The choice that echoes a prompt, with its tokens' logprobs where asked (the first
    token's logprob and alternatives are null, as in OpenAI's legacy API)."""
    text, first_id, first_text = echoed
    logprobs = None
    if lps is not None:
        logprobs = completion_logprobs(
            [TokenLogprob(first_id, first_text, None, []), *lps[1:]], 0, as_ids
        )
        logprobs["top_logprobs"][0] = None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}


async def completion_chunks(body, updates, echoed: list[tuple]):
    """/v1/completions: `updates` yields (prompt number, RequestUpdate) of every prompt's
    request; `echoed`, each prompt's (text, first token id, first token's text) where the
    request asks for echo. With logprobs the echo waits for the prompt's logprobs, which
    come in its request's first update."""
    n, as_ids = body.n, body.return_tokens_as_token_ids
    scored = body.logprobs is not None
    prompt_tokens, cached, completion_tokens, offsets = {}, {}, 0, {}
    for i, e in enumerate(echoed):
        for k in range(n):
            offsets[i * n + k] = len(e[0])
            if not scored:
                yield {"choices": [_echo(i * n + k, e, None, as_ids)]}
    async for i, u in updates:
        prompt_tokens[i], cached[i] = u.prompt_tokens, u.cached_tokens
        lps, vllm_style = u.prompt_logprobs, body.prompt_logprobs is not None
        if lps is not None and (echoed and scored or vllm_style):
            firsts = []
            for index in range(i * n, i * n + n):
                if echoed and scored:
                    c = _echo(index, echoed[i], lps, as_ids)
                else:
                    c = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
                if vllm_style:
                    c["prompt_logprobs"] = prompt_logprobs_of(lps)
                firsts.append(c)
            yield {"choices": firsts}
        choices = []
        for d in u.deltas:
            index = i * n + d.index
            completion_tokens += len(d.token_ids)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(d.logprobs or [], offsets.get(index, 0), as_ids)
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
            yield {"choices": choices}
    yield {
        "choices": [],
        "usage": usage(sum(prompt_tokens.values()), completion_tokens, sum(cached.values())),
    }


def _tool_call(c: tools.ToolCall, index: int) -> dict:
    """The opening delta of a streamed tool call (its arguments follow in pieces)."""
    function = {"name": c.name, "arguments": ""}
    return {"index": index, "id": c.id, "type": "function", "function": function}


async def chat_chunks(job, updates, new_parser):
    """A chat job's answer (serve/chat_job.py) as chat completion chunks: new_parser()
    makes each completion's AnswerParser (thinking, text and tool calls)."""
    n = job.n
    parsers = {k: new_parser() for k in range(n)}
    reasoning = dict.fromkeys(range(n), 0)  # each completion's thinking tokens
    calls = dict.fromkeys(range(n), 0)  # tool calls each completion has finished
    single = job.parallel_tool_calls is False  # then calls after the first are dropped
    completion_tokens, last = 0, None

    def choice(index, delta, finish=None, logprobs=None, stop_reason=None):
        out = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = stop_reason
        return out

    def deltas_of(k, events) -> list[dict]:
        out = []
        for kind, value in events:
            if single and calls[k] and kind != "text":
                continue
            if kind == "text":
                out.append({"content": value})
            elif kind == "reasoning":
                out.append({"reasoning_content": value})
            elif kind == "call_start":  # id, name and empty arguments, then the pieces
                out.append({"tool_calls": [_tool_call(value, calls[k])]})
            elif kind == "call_args":
                out.append({"tool_calls": [{"index": calls[k], "function": {"arguments": value}}]})
            else:  # call_end
                calls[k] += 1
        return out

    try:
        yield {"choices": [choice(k, {"role": "assistant", "content": ""}) for k in range(n)]}
        async for u in updates:
            last = u
            for d in u.deltas:
                completion_tokens += len(d.token_ids)
                reasoning[d.index] = d.reasoning_tokens
                logprobs = None
                if job.logprobs is not None:
                    logprobs = chat_logprobs(d.logprobs or [], job.logprobs)
                finished = d.finish_reason is not None
                pieces = deltas_of(d.index, parsers[d.index].feed(d.text, finished))
                if logprobs and not pieces:
                    pieces = [{"content": ""}]
                for j, delta in enumerate(pieces):
                    yield {
                        "choices": [choice(d.index, delta, logprobs=logprobs if j == 0 else None)]
                    }
                if finished:
                    finish = d.finish_reason
                    if calls[d.index] and finish == "stop":
                        finish = "tool_calls"
                    yield {"choices": [choice(d.index, {}, finish, stop_reason=d.stop_reason)]}
        if last is not None:
            yield {
                "choices": [],
                "usage": usage(
                    last.prompt_tokens,
                    completion_tokens,
                    last.cached_tokens,
                    sum(reasoning.values()),
                ),  # fmt: skip
            }
    finally:
        await updates.aclose()  # the request ends with its answer, however that ends


# ------------------------------------------------------------------ streamed, or folded


def stream_body(chunks, head: dict, include_usage: bool):
    """The server-sent events of a streamed answer: each chunk under `head` (id, object,
    created, model), the usage chunk where asked for, an error event if the engine fails,
    then [DONE]."""

    async def events():
        try:
            async for c in chunks:
                if "usage" in c and not include_usage:
                    continue
                event = {**head, "choices": c["choices"]}
                if include_usage:  # every chunk says usage (null until the last), as OpenAI
                    event["usage"] = c.get("usage")
                yield sse(event)
        except Exception as e:
            yield sse(stream_error(e).openai_body())
        yield sse("[DONE]")

    return events()


def head(response_id: str, kind: str, model: str) -> dict:
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model}


def fold_completion(chunks: list[dict], head: dict) -> dict:
    """The non-streamed /v1/completions answer: the chunks' choices joined by index."""
    choices: dict[int, dict] = {}
    for c in chunks:
        for piece in c["choices"]:
            index = piece["index"]
            out = choices.setdefault(
                index,
                {"index": index, "text": "", "logprobs": None, "finish_reason": None,
                 "stop_reason": None},
            )  # fmt: skip
            out["text"] += piece["text"]
            if "prompt_logprobs" in piece:
                out["prompt_logprobs"] = piece["prompt_logprobs"]
            if piece["logprobs"] is not None:
                if out["logprobs"] is None:
                    out["logprobs"] = {key: [] for key in piece["logprobs"]}
                for key, values in piece["logprobs"].items():
                    out["logprobs"][key] += values
            if piece["finish_reason"] is not None:
                out["finish_reason"] = piece["finish_reason"]
                out["stop_reason"] = piece.get("stop_reason")
    return {
        **head,
        "object": "text_completion",
        "choices": [choices[i] for i in sorted(choices)],
        "usage": chunks[-1]["usage"],
    }


def fold_chat(chunks: list[dict], head: dict, parse: bool, logprobs: bool) -> dict:
    """The non-streamed /v1/chat/completions answer: each completion's deltas joined into
    its message (tool calls whole, by their index), logprobs and finish."""
    choices: dict[int, dict] = {}
    for c in chunks:
        for piece in c["choices"]:
            index, delta = piece["index"], piece["delta"]
            out = choices.setdefault(
                index,
                {"index": index, "message": {"role": "assistant", "content": ""},
                 "logprobs": {"content": []} if logprobs else None, "finish_reason": None,
                 "stop_reason": None},
            )  # fmt: skip
            message = out["message"]
            message["content"] += delta.get("content") or ""
            if "reasoning_content" in delta:
                message["reasoning_content"] = (
                    message.get("reasoning_content", "") + delta["reasoning_content"]
                )
            for call in delta.get("tool_calls", ()):
                made = message.setdefault("tool_calls", [])
                if call["index"] == len(made):  # the opening delta: id, type, name
                    made.append({k: v for k, v in call.items() if k != "index"})
                    made[-1]["function"] = dict(call["function"])
                else:
                    made[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            if piece["logprobs"] is not None:
                out["logprobs"]["content"] += piece["logprobs"]["content"]
            if piece["finish_reason"] is not None:
                out["finish_reason"] = piece["finish_reason"]
                out["stop_reason"] = piece.get("stop_reason")
    if parse:  # with tools offered, a message of calls alone has no content
        for out in choices.values():
            out["message"]["content"] = out["message"]["content"] or None
    return {
        **head,
        "object": "chat.completion",
        "choices": [choices[i] for i in sorted(choices)],
        "usage": chunks[-1]["usage"],
    }
