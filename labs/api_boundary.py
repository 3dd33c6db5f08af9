"""Lab: what an HTTP boundary in front of an engine has to decide, measured.

Three measurements, the last two against a real server (`tokenworks serve`) over a real
socket:

- a character limit is not a token budget: texts of one length in characters (English
  prose, Python, digits, hexadecimal, random Chinese characters, random emoji) cut to the
  same number of characters and counted in tokens by each cached catalogue model's
  tokenizer; how many characters a token budget holds for each, and what the largest
  character limit that never overflows it leaves of English;
- errors a client can act on: a set of bad requests sent as raw HTTP (broken JSON, wrong
  types, values out of range, an unknown model, limits passed, a prompt past the
  context), each with its status, its error type, the field it names and its message;
  and a request with a field the server does not know (the way a schema grows);
- a shared backend: one caller's streamed request timed alone and with 3 and 15 other
  callers streaming at the same time: its first token, its time per token, and the tokens
  per second all callers get together.

    python labs/api_boundary.py [--model smollm2-135m] [--callers 0,3,15]

Writes an evidence record and a PNG (tokens per character by kind; the caller's latency
by how many share the backend).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import httpx  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.peer_engines import running_server, tokenworks_server  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.models import catalogue, load  # noqa: E402
from tokenworks.tokenizer.tokenizer import TokenizerWrapper  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def texts(chars: int, seed: int) -> dict[str, str]:
    """Texts of `chars` characters each, one per kind."""
    rng = random.Random(seed)
    english = (ROOT / "docs" / "architecture.md").read_text()
    code = (ROOT / "src" / "tokenworks" / "engine" / "scheduler.py").read_text()
    kinds = {
        "english": english,
        "python": code,
        "digits": "".join(rng.choice("0123456789") for _ in range(chars)),
        "hexadecimal": "".join(rng.choice("0123456789abcdef") for _ in range(chars)),
        # random characters of the CJK block's commonest part: no Chinese text ships here
        "chinese_random": "".join(chr(rng.randrange(0x4E00, 0x6000)) for _ in range(chars)),
        "emoji_random": "".join(chr(rng.randrange(0x1F300, 0x1F600)) for _ in range(chars)),
    }
    return {k: v[:chars] for k, v in kinds.items()}


def tokens_per_char(chars: int, budget: int, seed: int) -> dict:
    by_model = {}
    kinds = texts(chars, seed)
    for name, entry in catalogue.CATALOGUE.items():
        if not catalogue.cached_path(entry).is_file():
            continue
        tok = TokenizerWrapper.from_loaded(load(name, weights=False))
        per = {k: len(tok.encode(t)) / len(t) for k, t in kinds.items()}
        fits = {k: int(budget / v) for k, v in per.items()}
        safe = min(fits.values())  # the largest character limit no kind overflows
        by_model[name] = {
            "tokens_per_char": per,
            "chars_in_budget": fits,
            "safe_char_limit": safe,
            "english_tokens_at_safe_limit": int(safe * per["english"]),
            "english_share_of_budget_at_safe_limit": safe * per["english"] / budget,
        }
    return by_model


def bad_requests(context: int) -> dict[str, dict | str]:
    """name -> the body sent to /v1/chat/completions (a str is sent as it is)."""
    ok = {"model": "lab", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return {
        "broken_json": '{"model": "lab", "messages": [',
        "max_tokens_a_string": ok | {"max_tokens": "ten"},
        "max_tokens_negative": ok | {"max_tokens": -1},
        "temperature_too_high": ok | {"temperature": 5},
        "unknown_model": ok | {"model": "gpt-9"},
        "no_messages": {"model": "lab", "max_tokens": 4},
        "unknown_role": ok | {"messages": [{"role": "wizard", "content": "Hi"}]},
        "n_past_its_limit": ok | {"n": 100},
        "too_many_stop_strings": ok | {"stop": [f"s{i}" for i in range(100)]},
        "max_tokens_past_the_context": ok | {"max_tokens": 10 * context},
        "prompt_past_the_context": ok
        | {"messages": [{"role": "user", "content": "word " * (2 * context)}]},
        "body_past_its_limit": ok | {"messages": [{"role": "user", "content": "x" * (9 << 20)}]},
        "an_unknown_field": ok | {"frobnicate": True},
    }


def ask(url: str, body) -> dict:
    content = body if isinstance(body, str) else json.dumps(body)
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", content=content, timeout=120,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    took = time.perf_counter() - t0
    try:
        error = r.json().get("error") or {}
    except ValueError:
        error = {"message": r.text[:300]}
    return {
        "status": r.status_code,
        "seconds": took,
        "type": error.get("type"),
        "param": error.get("param"),
        "message": error.get("message"),
        # a client can act on it: a 4xx that names the field, or says what to change
        "actionable": 400 <= r.status_code < 500
        and bool(error.get("param") or error.get("message")),
    }  # fmt: skip


def stream(url: str, tokens: int, out: list, start: threading.Event) -> None:
    """One caller's streamed chat request: its first content and its end, in seconds."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    start.wait()
    t0, first, n = time.perf_counter(), None, 0
    for chunk in client.chat.completions.create(
        model="lab", messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            n += 1
    end = time.perf_counter() - t0
    out.append({"first_s": first, "total_s": end, "chunks": n})


def shared(url: str, others: int, tokens: int, rounds: int) -> dict:
    """The probe caller's latency with `others` callers streaming beside it."""
    probes, rates = [], []
    for _ in range(rounds):
        start, probe, rest = threading.Event(), [], []
        threads = [threading.Thread(target=stream, args=(url, tokens, probe, start))]
        threads += [
            threading.Thread(target=stream, args=(url, tokens, rest, start)) for _ in range(others)
        ]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        start.set()
        for t in threads:
            t.join()
        rates.append((others + 1) * tokens / (time.perf_counter() - t0))
        probes += probe
    first = statistics.median(p["first_s"] for p in probes)
    total = statistics.median(p["total_s"] for p in probes)
    return {
        "others": others,
        "first_token_ms": 1000 * first,
        "ms_per_token": 1000 * (total - first) / (tokens - 1),
        "total_ms": 1000 * total,
        "all_callers_tokens_per_s": statistics.median(rates),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chars", type=int, default=4000, help="characters of each text")
    ap.add_argument("--budget", type=int, default=1024, help="the token budget (the context)")
    ap.add_argument("--callers", default="0,3,15", help="callers beside the one timed")
    ap.add_argument("--tokens", type=int, default=32, help="tokens each caller streams")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(chars=400, callers="0,3", tokens=4, rounds=1))
    per_char = tokens_per_char(args.chars, args.budget, args.seed)
    for m, r in per_char.items():
        print(f"{m}: tokens a character " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["tokens_per_char"].items()) + f"; a {args.budget}-token "
            f"budget never overflows below {r['safe_char_limit']} characters, where English "
            f"fills {r['english_share_of_budget_at_safe_limit']:.0%} of it")  # fmt: skip

    argv = tokenworks_server(["--model", args.model, "--threads", str(args.threads),
                              "--max-model-len", str(args.budget)], "lab")  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="api-boundary-"))
    with running_server(argv, {}, logs / "server.log") as url:
        errors = {}
        for name, body in tqdm(bad_requests(args.budget).items(), desc="bad requests"):
            errors[name] = e = ask(url, body)
            print(f"{name:28s} {e['status']} {e['type']} param={e['param']}: "
                  f"{(e['message'] or '')[:80]}")  # fmt: skip
        callers = [int(c) for c in args.callers.split(",")]
        shared(url, 0, args.tokens, 1)  # the first request's own costs are chapter 2's
        sharing = {}
        for others in tqdm(callers, desc="shared backend", unit="load"):
            sharing[str(others)] = s = shared(url, others, args.tokens, args.rounds)
            print(f"{others:3d} others: first token {s['first_token_ms']:.0f} ms, "
                  f"{s['ms_per_token']:.1f} ms a token, all callers "
                  f"{s['all_callers_tokens_per_s']:.0f} tok/s")  # fmt: skip
    refused = [e for n, e in errors.items() if n != "an_unknown_field"]
    summary = {
        "bad_requests": len(refused),
        "actionable": sum(e["actionable"] for e in refused),
        "server_errors": sum(e["status"] >= 500 for e in errors.values()),
        "unknown_field_status": errors["an_unknown_field"]["status"],
    }
    alone, most = sharing[str(callers[0])], sharing[str(callers[-1])]
    summary["first_token_growth"] = most["first_token_ms"] / alone["first_token_ms"]
    summary["per_token_growth"] = most["ms_per_token"] / alone["ms_per_token"]
    summary["throughput_growth"] = (
        most["all_callers_tokens_per_s"] / alone["all_callers_tokens_per_s"]
    )
    record = make_record(
        kind="lab.api_boundary",
        engine={
            "server": "tokenworks serve",
            "model": args.model,
            "threads": args.threads,
            "max_model_len": args.budget,
        },  # fmt: skip
        model={"id": args.model},
        workload={
            "chars": args.chars,
            "budget": args.budget,
            "callers": callers,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "prompt": PROMPT,
        },  # fmt: skip
        results={
            "tokens_per_char": per_char,
            "errors": errors,
            "sharing": sharing,
            "summary": summary,
        },  # fmt: skip
        seeds=[args.seed],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    kinds = list(next(iter(per_char.values()))["tokens_per_char"])
    width = 0.8 / len(per_char)
    for i, (m, r) in enumerate(per_char.items()):
        a.bar([x + i * width for x in range(len(kinds))],
              [r["tokens_per_char"][k] for k in kinds], width, label=m)  # fmt: skip
    a.set(xticks=[x + 0.4 - width / 2 for x in range(len(kinds))],
          xticklabels=[k.replace("_", " ") for k in kinds], ylabel="tokens per character",
          title=f"{args.chars} characters of each")  # fmt: skip
    a.tick_params(axis="x", labelsize=8)
    a.legend(fontsize=7)
    xs = [int(c) + 1 for c in sharing]
    b.plot(xs, [s["first_token_ms"] for s in sharing.values()], "o-", label="first token, ms")
    b.plot(xs, [s["ms_per_token"] for s in sharing.values()], "s-", label="ms a token after")
    b.set(xscale="log", xlabel="callers sharing the backend", ylabel="ms",
          title=f"one caller's {args.tokens}-token stream")  # fmt: skip
    b.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
