"""`tokenworks bench soak`: many mixed requests against a server, watching what it holds.

Requests, drawn from a seed: streamed completions, non-streamed chats, streams the client
leaves after a few chunks, and bodies the server must refuse. Meanwhile the server's RSS,
open files and KV usage are sampled; a server that keeps nothing a finished request held
ends with its block pool as it started and its open files as they were. Its RSS grows
only as the KV pool's pages are first written (they stay, holding the prefix cache, up to
the pool's size): for our server in this process each sample also says how many bytes of
the pool have been touched, and what grows beyond those is what the soak looks for. The
record holds every sample, and a plot shows them over time.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

KINDS = ("stream", "chat", "cancel", "invalid")
WEIGHTS = (0.4, 0.25, 0.2, 0.15)
# bodies a server must answer with a 4xx (each probe of one way to be wrong)
INVALID = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2**64}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 100_000}),
]


@dataclass
class SoakResult:
    requests: int
    by_kind: dict[str, int]
    by_status: dict[str, int]
    seconds: float
    # t, rss_bytes, open_files, kv_usage, and for our engine kv_touched_bytes (the pool's
    # bytes in blocks handed out at least once) and kv_cached_blocks
    samples: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        first, last = self.samples[0], self.samples[-1]
        out = {
            "rss_start_bytes": first["rss_bytes"],
            "rss_end_bytes": last["rss_bytes"],
            "rss_growth_bytes": last["rss_bytes"] - first["rss_bytes"],
            "rss_peak_bytes": max(s["rss_bytes"] for s in self.samples),
            "open_files_start": first["open_files"],
            "open_files_end": last["open_files"],
            "kv_usage_end": last["kv_usage"],
        }
        if "kv_touched_bytes" in last:
            kv = last["kv_touched_bytes"] - first["kv_touched_bytes"]
            out["kv_touched_growth_bytes"] = kv
            out["rss_growth_beyond_kv_bytes"] = out["rss_growth_bytes"] - kv
        return out


def process_sample(pid: int) -> dict:
    """RSS and open file descriptors of process pid (Linux /proc)."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"rss_bytes": rss, "open_files": len(os.listdir(f"/proc/{pid}/fd"))}


def engine_sample(engine) -> dict:
    """What our engine's KV pool holds: bytes of blocks ever handed out, cached blocks."""
    blocks = engine.blocks
    per_block = engine.pool.nbytes // blocks.num_blocks
    cached = len(blocks.prefix.evictable) if blocks.prefix is not None else 0
    return {"kv_touched_bytes": blocks.touched * per_block, "kv_cached_blocks": cached}


def _kv_usage(metrics_text: str) -> float | None:
    for line in metrics_text.splitlines():
        if line.startswith("tokenworks:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _plan(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choices(KINDS, WEIGHTS)[0], rng.randrange(1 << 30)) for _ in range(n)]


async def _one(http: httpx.AsyncClient, model: str, kind: str, seed: int) -> int:
    rng = random.Random(seed)
    max_tokens = rng.randint(1, 24)
    prompt = " ".join(rng.choice(["river", "mill", "stone", "light", "wind"]) for _ in range(8))
    if kind == "invalid":
        path, body = INVALID[seed % len(INVALID)]
        return (await http.post(path, json={"model": model, **body})).status_code
    if kind == "chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": seed,
        }
        return (await http.post("/v1/chat/completions", json=body)).status_code
    body = {"model": model, "prompt": prompt, "max_tokens": 64 if kind == "cancel" else max_tokens,
            "stream": True, "temperature": 0.8, "seed": seed}  # fmt: skip
    async with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = 0
        async for line in r.aiter_lines():
            chunks += line.startswith("data:")
            if kind == "cancel" and chunks >= 2:
                break  # the client leaves mid-stream
        return r.status_code


async def _soak(url, model, plan, concurrency, pid, sample_s, api_key, progress, engine):
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    by_status: dict[str, int] = {}
    samples: list[dict] = []
    t0 = time.monotonic()

    def record(kv_usage: float | None) -> None:
        here = {"t": time.monotonic() - t0, **process_sample(pid), "kv_usage": kv_usage}
        samples.append(here | (engine_sample(engine) if engine is not None else {}))

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as http:

        async def sample():
            metrics = await http.get("/metrics")
            record(_kv_usage(metrics.text) if metrics.status_code == 200 else None)

        async def sampler():
            while True:
                await sample()
                await asyncio.sleep(sample_s)

        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(plan), desc="soak", disable=not progress)

        async def run(kind, seed):
            async with gate:
                try:
                    status = str(await _one(http, model, kind, seed))
                except httpx.HTTPError as e:
                    status = type(e).__name__
                by_status[status] = by_status.get(status, 0) + 1
                bar.update()

        await sample()
        watch = asyncio.ensure_future(sampler())
        try:
            await asyncio.gather(*(run(k, s) for k, s in plan))
        finally:
            watch.cancel()
            bar.close()
    # the last: after the client has closed its connections (for a server in this process,
    # its sockets would count as the server's open files) and the engine's last aborts
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(base_url=url, headers={**headers, "connection": "close"}) as h:
        metrics = await h.get("/metrics")
    await asyncio.sleep(0.2)
    record(_kv_usage(metrics.text) if metrics.status_code == 200 else None)
    kinds = {k: sum(1 for x, _ in plan if x == k) for k in KINDS}
    return SoakResult(len(plan), kinds, by_status, time.monotonic() - t0, samples)


def soak(
    url: str,
    model: str,
    requests: int = 500,
    concurrency: int = 8,
    seed: int = 0,
    pid: int | None = None,
    sample_s: float = 0.5,
    api_key: str | None = None,
    progress: bool = True,
    engine=None,
) -> SoakResult:
    """Send `requests` mixed requests (at most `concurrency` at once) to the server at
    url, sampling process pid (default: this one, for a server in this process) and, given
    our LLMEngine behind it, its KV pool."""
    plan = _plan(requests, seed)
    pid = os.getpid() if pid is None else pid
    run = _soak(url, model, plan, concurrency, pid, sample_s, api_key, progress, engine)
    return asyncio.run(run)


def plot(result: SoakResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in result.samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].plot(t, [s["rss_bytes"] / 2**20 for s in result.samples], label="RSS")
    if "kv_touched_bytes" in result.samples[0]:
        beyond = [(s["rss_bytes"] - s["kv_touched_bytes"]) / 2**20 for s in result.samples]
        axes[0].plot(t, beyond, label="RSS less the KV pages touched")
        axes[0].legend()
    axes[0].set_ylabel("MiB")
    axes[1].plot(t, [s["open_files"] for s in result.samples])
    axes[1].set_ylabel("open files")
    axes[2].plot(t, [s["kv_usage"] or 0 for s in result.samples])
    axes[2].set_ylabel("KV pool in use (fraction)")
    axes[2].set_xlabel("seconds")
    fig.suptitle(f"soak: {result.requests} mixed requests")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_soak(args) -> Path:
    if args.base_url and args.pid is None:
        raise SystemExit("--base-url needs --pid: the process whose memory and files to watch")
    """The command: our server in this process (or --base-url and --pid), then a record
    and its plot."""
    from tokenworks.bench.record import make_record, model_record, write_record
    from tokenworks.config import engine_kwargs

    workload = {"requests": args.requests, "concurrency": args.concurrency, "seed": args.seed,
                "kinds": dict(zip(KINDS, WEIGHTS, strict=True))}  # fmt: skip
    if args.base_url:
        result = soak(args.base_url, args.served_model, args.requests, args.concurrency,
                      args.seed, args.pid, args.sample_s, args.api_key)  # fmt: skip
        engine, model = {"base_url": args.base_url}, {"id": args.served_model}
    else:
        from tokenworks import LLM
        from tokenworks.serve.app import build_app
        from tokenworks.serve.server import ServerThread, make_state

        llm = LLM(args.model, **engine_kwargs(args))
        with ServerThread(build_app(make_state(llm.engine, [args.model]))) as srv:
            result = soak(srv.url, args.model, args.requests, args.concurrency, args.seed,
                          None, args.sample_s, engine=llm.engine)  # fmt: skip
        engine, model = llm.config.to_dict(), model_record(llm)
    record = make_record(
        kind="soak", engine=engine, model=model, workload=workload, seeds=[args.seed],
        results={**asdict(result), "summary": result.summary()},
    )  # fmt: skip
    path = write_record(record, args.out)
    plot(result, path.with_suffix(".png"))
    s = result.summary()
    beyond = s.get("rss_growth_beyond_kv_bytes")
    print(
        f"{result.requests} requests in {result.seconds:.0f} s ({result.by_status}); RSS "
        f"{s['rss_start_bytes'] / 2**20:.0f} -> {s['rss_end_bytes'] / 2**20:.0f} MiB"
        + (
            f" ({beyond / 2**20:+.0f} MiB beyond the KV pages touched)"
            if beyond is not None
            else ""
        )
        + f", open files {s['open_files_start']} -> {s['open_files_end']}, KV in use at the "
        f"end {s['kv_usage_end']}"
    )
    print(path)
    return path
