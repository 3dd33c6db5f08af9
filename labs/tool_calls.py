"""Lab: how often a model's tool calls parse, fit their schema and pick the right tool.

A real server (`tokenworks serve`, one per model and call format) gets a set of requests,
each of which one of three tools answers, through the official `openai` client. Each is
sent twice: with tool_choice "auto", where the model decides and writes the call as its
chat template taught it, and "required", where a grammar forces exactly one call in the
format's syntax with arguments that fit the tool's schema (serve/tools.py). Each format
the server knows (`--tool-call-parser`) is tried on each model: a model's own format
(auto picks it from the chat template) against formats it was never taught, where only
the grammar can make it write them. For each (model, format, choice):

- called: the reply holds a tool call the server parsed;
- valid: the call's arguments are JSON that validates against the tool's schema;
- right: the call names the tool the request needs;
- seconds: the request's wall time.

    python labs/tool_calls.py [--models qwen2.5-coder-0.5b] [--formats auto,hermes,...]

Writes an evidence record and a PNG (valid calls of the right tool, per format and choice).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import jsonschema  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.peer_engines import running_server, tokenworks_server  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        }, "required": ["city", "unit"]},
    }},
    {"type": "function", "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money from one currency to another.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "description": "ISO code, e.g. EUR"},
            "to_currency": {"type": "string", "description": "ISO code, e.g. USD"},
        }, "required": ["amount", "from_currency", "to_currency"]},
    }},
    {"type": "function", "function": {
        "name": "add_calendar_event",
        "description": "Put an event in the user's calendar.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD"},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        }, "required": ["title", "date", "hour"]},
    }},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

REQUESTS = [  # (what the user asks, the tool that answers it)
    ("What is the weather like in Lisbon right now, in celsius?", "get_weather"),
    ("How many US dollars do I get for 250 euros?", "convert_currency"),
    ("Add a dentist appointment on 2027-03-14 at 9 in the morning to my calendar.",
     "add_calendar_event"),
    ("Is it cold in Oslo today? Give me fahrenheit.", "get_weather"),
    ("Convert 1200 Japanese yen to British pounds.", "convert_currency"),
    ("Put 'team lunch' in my calendar for 2027-01-08 at 12.", "add_calendar_event"),
    ("Tell me the temperature in Nairobi in celsius.", "get_weather"),
    ("I have 80 Swiss francs. What is that in euros?", "convert_currency"),
    ("Schedule 'call mum' on 2026-12-24 at 18:00.", "add_calendar_event"),
    ("Weather in Buenos Aires, fahrenheit please.", "get_weather"),
    ("How much is 45.5 Canadian dollars in US dollars?", "convert_currency"),
    ("Remind me of the 'book club' meeting on 2027-02-02 at 19.", "add_calendar_event"),
]  # fmt: skip
CHOICES = ("auto", "required")


def judge(message, want: str) -> dict:
    """What one reply did: called, valid (arguments fit the schema), right (the tool)."""
    calls = message.tool_calls or []
    out = {"called": bool(calls), "valid": False, "right": False, "names": []}
    for call in calls:
        name = call.function.name
        out["names"].append(name)
        try:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
            valid = True
        except (ValueError, KeyError, jsonschema.ValidationError):
            valid = False
        out["valid"] = out["valid"] or valid
        out["right"] = out["right"] or (valid and name == want)
    return out


def run_format(model: str, fmt: str, requests, max_tokens: int, threads: int, logs: Path):
    """Every request, both choices, against one server: {choice: [judged replies]}."""
    import openai

    argv = tokenworks_server(
        ["--model", model, "--tool-call-parser", fmt, "--threads", str(threads)], "lab"
    )
    got = {c: [] for c in CHOICES}
    with running_server(argv, {}, logs / f"{model}-{fmt}.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for text, want in requests:
            for choice in CHOICES:
                t = time.perf_counter()
                reply = client.chat.completions.create(
                    model="lab", messages=[{"role": "user", "content": text}], tools=TOOLS,
                    tool_choice=choice, max_tokens=max_tokens, temperature=0,
                )  # fmt: skip
                seconds = time.perf_counter() - t
                judged = judge(reply.choices[0].message, want)
                judged |= {"seconds": seconds, "tokens": reply.usage.completion_tokens}
                got[choice].append(judged)
    return got


def summarise(replies: list[dict]) -> dict:
    n = len(replies)
    return {
        "requests": n,
        "called": sum(r["called"] for r in replies) / n,
        "valid": sum(r["valid"] for r in replies) / n,
        "right": sum(r["right"] for r in replies) / n,
        "median_seconds": statistics.median(r["seconds"] for r in replies),
        "median_tokens": statistics.median(r["tokens"] for r in replies),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,smollm2-135m")
    ap.add_argument("--formats", default="auto,hermes,llama3_json,mistral,qwen3_coder")
    ap.add_argument("--requests", type=int, default=len(REQUESTS))
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(models="smollm2-135m", formats="auto", requests=2, max_tokens=128)
    )
    requests = REQUESTS[: args.requests]
    models, formats = args.models.split(","), args.formats.split(",")

    rows: dict = {}
    logs = Path(tempfile.mkdtemp(prefix="tool-calls-"))
    jobs = [(m, f) for m in models for f in formats]
    for model, fmt in tqdm(jobs, desc="servers", unit="server"):
        got = run_format(model, fmt, requests, args.max_tokens, args.threads, logs)
        rows.setdefault(model, {})[fmt] = {c: summarise(got[c]) | {"replies": got[c]}
                                           for c in CHOICES}  # fmt: skip
        for c in CHOICES:
            s = rows[model][fmt][c]
            print(f"{model:20s} {fmt:12s} {c:9s}: called {s['called']:.0%}, valid "
                  f"{s['valid']:.0%}, right tool {s['right']:.0%}, "
                  f"{s['median_seconds']:.2f} s")  # fmt: skip
    record = make_record(
        kind="lab.tool_calls",
        engine={
            "server": "tokenworks serve",
            "threads": args.threads,
            "formats": formats,
            "temperature": 0,
            "max_tokens": args.max_tokens,
        },  # fmt: skip
        model={"ids": models},
        workload={"tools": TOOLS, "requests": requests, "choices": list(CHOICES)},
        results={"rows": rows},
        seeds=[],
    )
    path = write_record(record, args.out)

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        xs = range(len(formats))
        for i, c in enumerate(CHOICES):
            ax.bar([x + (i - 0.5) * 0.4 for x in xs],
                   [100 * rows[model][f][c]["right"] for f in formats], 0.4,
                   label=f"tool_choice {c}")  # fmt: skip
        ax.set(xticks=list(xs), xticklabels=formats, ylim=(0, 105), title=model,
               ylabel="% valid calls of the right tool")  # fmt: skip
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
