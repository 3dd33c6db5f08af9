"""A load generator for any OpenAI-compatible server (ours, vLLM, llama.cpp's server,
SGLang): streamed /v1/completions requests sent on an arrival schedule, each timed chunk by
chunk into a RequestResult (bench/metrics.py scores them).

Prompts go as token ids when the workload has them, so every engine sees the same tokens.
Token counts come from the server's usage chunk (`stream_options.include_usage`), else
from `count_tokens` (re-tokenising the text), else from the number of content chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
from tqdm import tqdm

from tokenworks.bench.metrics import RequestResult
from tokenworks.bench.workload import BenchRequest, arrival_offsets
from tokenworks.front.interface import Submission


async def send(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    req: BenchRequest,
    headers: dict | None = None,
    count_tokens: Callable[[str], int] | None = None,
    messages: list[dict] | None = None,
    chat: bool = False,
) -> RequestResult:
    """One streamed request: /v1/completions, or /v1/chat/completions given messages (or
    with chat=True, the prompt text as one user message)."""
    if chat and messages is None:
        if req.prompt is None:
            raise ValueError(
                "the chat endpoint takes text: use a text, jsonl or multi_turn workload "
                "(random and shared_prefix prompts are token ids), or --endpoint completions"
            )
        messages = [{"role": "user", "content": req.prompt}]
    body = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": req.ignore_eos,
    }
    if messages is not None:
        body["messages"] = messages
        url = url.replace("/v1/completions", "/v1/chat/completions")
    else:
        body["prompt"] = req.prompt_ids if req.prompt_ids is not None else req.prompt
    result = RequestResult(start=time.perf_counter(), input_tokens=req.input_len or 0)
    text, usage = [], None
    try:
        async with http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                result.ok, result.error = False, f"HTTP {resp.status_code}: {detail}"
                result.end = time.perf_counter()
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.ok, result.error = False, str(chunk["error"])[:300]
                    break
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        result.chunk_times.append(now)
                        text.append(piece)
    except httpx.HTTPError as e:
        result.ok, result.error = False, f"{type(e).__name__}: {e}"
    result.end = time.perf_counter()
    if usage:
        result.output_tokens = usage.get("completion_tokens", 0)
        result.input_tokens = usage.get("prompt_tokens", result.input_tokens)
    elif count_tokens is not None:
        result.output_tokens = count_tokens("".join(text))
    else:
        result.output_tokens = len(result.chunk_times)
    result.text = "".join(text)
    return result


async def send_conversation(http, url, model, req, headers=None, count_tokens=None):
    """A multi-turn chat: each user turn goes with the conversation so far (the answers
    included), so a prefix cache can reuse the earlier turns. One result per turn."""
    messages: list[dict] = []
    results = []
    for turn in req.turns:
        messages.append({"role": "user", "content": turn})
        r = await send(http, url, model, req, headers, count_tokens, messages=list(messages))
        results.append(r)
        if not r.ok:
            break
        messages.append({"role": "assistant", "content": r.text})
    return results


async def run_load(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    rate: float | None = None,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    count_tokens: Callable[[str], int] | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
    ramp_to: float | None = None,
    endpoint: str = "completions",
) -> tuple[list[RequestResult], float]:
    """Send the requests on a Poisson/gamma schedule (rate per second, ramping to ramp_to;
    None: all at once), at most max_concurrency in flight, to /v1/completions or (endpoint
    "chat") /v1/chat/completions; return their results and the run's wall time."""
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint {endpoint!r}: expected completions or chat")
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:

        async def run(req: BenchRequest) -> list[RequestResult]:
            if req.turns:
                return await send_conversation(http, url, model, req, headers, count_tokens)
            chat = endpoint == "chat"
            return [await send(http, url, model, req, headers, count_tokens, chat=chat)]

        offsets = arrival_offsets(len(requests), rate, burstiness, seed, ramp_to)
        return await schedule(requests, offsets, max_concurrency, run, progress)


async def schedule(requests, offsets, max_concurrency, run, progress: bool):
    """Start run(request) at each offset (seconds from now), at most max_concurrency at
    once; return all their results (run returns a list) and the wall time."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", disable=not progress)
    t0 = time.perf_counter()

    async def one(offset: float, req: BenchRequest) -> list[RequestResult]:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        if limit is None:
            r = await run(req)
        else:
            async with limit:
                r = await run(req)
        bar.update(1)
        return r

    results = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests, strict=True)))
    duration = time.perf_counter() - t0
    bar.close()
    return [r for rs in results for r in rs], duration


async def run_in_process(
    front,
    requests: list[BenchRequest],
    rate: float | None = None,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
    ramp_to: float | None = None,
) -> tuple[list[RequestResult], float]:
    """The same load, timed the same way, straight into an engine front (no HTTP): what the
    server's transport costs is the difference between this and run_load."""
    from tokenworks import SamplingParams

    if any(r.turns for r in requests):
        raise ValueError("multi_turn workloads run over HTTP (the chat endpoint), not in-process")
    tokenizer = front.engine.tokenizer

    async def send_one(req: BenchRequest) -> RequestResult:
        ids = req.prompt_ids if req.prompt_ids is not None else tokenizer.encode(req.prompt)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=req.ignore_eos)
        result = RequestResult(start=time.perf_counter(), input_tokens=len(ids))
        try:
            async for update in front.generate(Submission(params, ids)):
                now = time.perf_counter()
                for d in update.deltas:
                    result.output_tokens += len(d.token_ids)
                    if d.text:
                        result.chunk_times.append(now)
        except Exception as e:
            result.ok, result.error = False, f"{type(e).__name__}: {e}"
        result.end = time.perf_counter()
        return result

    async def run(req: BenchRequest) -> list[RequestResult]:
        return [await send_one(req)]

    offsets = arrival_offsets(len(requests), rate, burstiness, seed, ramp_to)
    return await schedule(requests, offsets, max_concurrency, run, progress)
