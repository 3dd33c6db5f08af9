"""Lab: where one request's time goes, from the client's call to its last byte.

Inference is a forward pass, generation is a loop of them, and serving wraps the loop in
a protocol; this lab puts a number on each. A real server (`tokenworks serve`, its engine
core in a process of its own, as by default) gets N chat requests one after another
through the official `openai` client, streamed, each a prompt of about 60 tokens answered
with G tokens. The client times each call; the server's own counters (`/metrics`, read
before and after) say how the same requests spent it:

- before the engine, in the API process: reading the body (`parse`), the chat template,
  tokenising;
- in the engine: waiting to be scheduled (queue), the prompt's forward pass and the first
  token (prefill: first token out, less the queue), and the other G - 1 tokens (decode);
- beside the decode, in the API process: detokenising and encoding each streamed event;
- the rest: HTTP, the hop between the API process and the engine core, and the client.

Each figure is the mean per request.

    python labs/request_anatomy.py [--model smollm2-135m] [--requests 16] [--generate 32]

Writes an evidence record and a PNG (one request's milliseconds, part by part).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import httpx  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.peer_engines import running_server, tokenworks_server  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402

PROMPT = (
    "Explain in two sentences why a kettle whistles when the water boils, for a child "
    "who has just heard one for the first time and wants to know where the sound comes "
    "from and why it stops when the kettle is taken off the stove."
)
API_PHASES = ("parse", "template", "tokenize", "detokenize", "respond")
ENGINE = {  # what /metrics sums, by the name this lab gives it
    "queue": "tokenworks:request_queue_time_seconds",
    "first_token": "tokenworks:time_to_first_token_seconds",
    "e2e": "tokenworks:e2e_request_latency_seconds",
}


def scrape(url: str) -> dict:
    """The sums this lab reads from /metrics (seconds), and the request count."""
    text = httpx.get(url + "/metrics", timeout=10).text
    got = {f"api_{p}": 0.0 for p in API_PHASES} | dict.fromkeys(ENGINE, 0.0) | {"count": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tokenworks:api_process_seconds_sum":
                got[f"api_{s.labels['phase']}"] += s.value
            for key, name in ENGINE.items():
                if s.name == name + "_sum":
                    got[key] += s.value
            if s.name == ENGINE["e2e"] + "_count":
                got["count"] += s.value
    return got


def call(client, generate: int) -> dict:
    """One streamed chat request: the client's seconds to its first content and to its end."""
    t = time.perf_counter()
    first = None
    stream = client.chat.completions.create(
        model="lab", messages=[{"role": "user", "content": PROMPT}], max_tokens=generate,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t
    return {"first_content_s": first, "total_s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--generate", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(requests=2, generate=8))
    import openai

    argv = tokenworks_server(["--model", args.model, "--threads", str(args.threads)], "lab")
    logs = Path(tempfile.mkdtemp(prefix="request-anatomy-"))
    with running_server(argv, {}, logs / "server.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        call(client, args.generate)  # the first request's own costs are chapter 2's
        before = scrape(url)
        calls = [call(client, args.generate) for _ in range(args.requests)]
        after = scrape(url)
    n = after["count"] - before["count"]
    mean = {k: 1000 * (after[k] - before[k]) / n for k in after if k != "count"}
    total = 1000 * statistics.mean(c["total_s"] for c in calls)
    first = 1000 * statistics.mean(c["first_content_s"] for c in calls)
    before_engine = mean["api_parse"] + mean["api_template"] + mean["api_tokenize"]
    parts = {  # one request's milliseconds, in the order they happen
        "parse": mean["api_parse"],
        "template": mean["api_template"],
        "tokenize": mean["api_tokenize"],
        "queue": mean["queue"],
        "prefill": mean["first_token"] - mean["queue"],
        "decode": mean["e2e"] - mean["first_token"],
        "http_ipc_client": total - before_engine - mean["e2e"],
    }
    beside = {"detokenize": mean["api_detokenize"], "respond": mean["api_respond"]}
    summary = {
        "requests": int(n),
        "client_total_ms": total,
        "client_first_content_ms": first,
        "forward_pass_share": parts["prefill"] / total,
        "generation_share": (parts["prefill"] + parts["decode"]) / total,
        "decode_ms_per_token": parts["decode"] / max(args.generate - 1, 1),
    }
    for k, v in parts.items():
        print(f"{k:16s} {v:9.3f} ms")
    for k, v in beside.items():
        print(f"{k:16s} {v:9.3f} ms (beside the decode)")
    print(f"the client waited {total:.1f} ms a request ({first:.1f} ms to its first text); "
          f"the forward pass over the prompt is {summary['forward_pass_share']:.0%} of it, "
          f"generation {summary['generation_share']:.0%}")  # fmt: skip
    record = make_record(
        kind="lab.request_anatomy",
        engine={
            "server": "tokenworks serve",
            "model": args.model,
            "threads": args.threads,
            "engine_core": "its own process (the default)",
        },  # fmt: skip
        model={"id": args.model},
        workload={
            "prompt": PROMPT,
            "requests": args.requests,
            "generate": args.generate,
            "stream": True,
            "one_at_a_time": True,
        },  # fmt: skip
        results={
            "parts_ms": parts,
            "beside_decode_ms": beside,
            "summary": summary,
            "calls": calls,
        },  # fmt: skip
        seeds=[],
    )
    path = write_record(record, args.out)

    fig, ax = plt.subplots(figsize=(10, 2.6))
    left = 0.0
    colours = ("#bbbbbb", "#999999", "#777777", "#ddcc77", "#cc6677", "#4477aa", "#88ccee")
    for (name, ms), colour in zip(parts.items(), colours, strict=True):
        ax.barh(["one request"], [ms], left=left, color=colour, label=name.replace("_", ", "))
        left += ms
    ax.set(xlabel="milliseconds (mean of the requests)",
           title=f"{args.model}: a streamed chat request of {args.generate} tokens")  # fmt: skip
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
