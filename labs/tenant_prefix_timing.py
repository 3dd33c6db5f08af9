"""Lab: can one tenant tell, from its time to first token, what another has sent?

A prefix cache shared by everyone answers a prompt it has seen faster than one it has not:
tenant A sends a long "secret" prompt; tenant B then sends guesses, and a guess that hits
A's cached blocks comes back sooner. With a salt per API key (the server's default when
keys are configured) B's guess never finds A's blocks, and the hit is as slow as a miss.

The lab runs our real server on 127.0.0.1 twice, with two API keys: with tenant salts and
with a shared cache (--shared-prefix-cache). Each round: A sends a fresh secret; B sends
the same text (the right guess) and an unrelated one of the same length (the wrong guess),
in alternating order, timing each first streamed token.

    python labs/tenant_prefix_timing.py [--rounds 12] [--prompt-tokens 1024]

Writes an evidence record and a PNG (B's TTFT for right and wrong guesses, both modes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.config import EngineConfig  # noqa: E402
from tokenworks.engine.engine import LLMEngine  # noqa: E402
from tokenworks.models import load  # noqa: E402
from tokenworks.serve.app import build_app  # noqa: E402
from tokenworks.serve.server import ServerThread, make_state  # noqa: E402

KEYS = ("tenant-a", "tenant-b")
WORDS = "river mill stone light wind field bread salt iron glass rope wheel".split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ttft(http: httpx.Client, key: str, prompt: str) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body, headers={"x-api-key": key}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token came back")


def run_mode(loaded, args, shared: bool) -> dict:
    config = EngineConfig(model=args.model, threads=args.threads, max_num_seqs=4)
    engine = LLMEngine(config, loaded)
    state = make_state(engine, ["m"], api_keys=KEYS, tenant_salts=not shared)
    rng = random.Random(args.seed)
    right, wrong = [], []
    with ServerThread(build_app(state)) as srv, httpx.Client(base_url=srv.url, timeout=300) as http:
        ttft(http, KEYS[0], text(rng, args.prompt_tokens))  # first-request costs, untimed
        for i in tqdm(range(args.rounds), desc="shared" if shared else "salted"):
            secret = text(rng, args.prompt_tokens)
            ttft(http, KEYS[0], secret)  # tenant A: now in the cache
            guesses = [("right", secret), ("wrong", text(rng, args.prompt_tokens))]
            for kind, guess in guesses if i % 2 == 0 else guesses[::-1]:
                (right if kind == "right" else wrong).append(ttft(http, KEYS[1], guess))
    return {"shared_cache": shared, "right_ttft_s": right, "wrong_ttft_s": wrong,
            "right_median_s": statistics.median(right),
            "wrong_median_s": statistics.median(wrong),
            "engine": config.to_dict()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="words of each prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(rounds=2, prompt_tokens=64))

    loaded = load(args.model)
    modes = [run_mode(loaded, args, shared) for shared in (True, False)]

    fig, ax = plt.subplots(figsize=(7, 4))
    for j, m in enumerate(modes):
        for k, (kind, color) in enumerate((("right", "tab:red"), ("wrong", "tab:blue"))):
            ys = [1000 * t for t in m[f"{kind}_ttft_s"]]
            x = 2 * j + k
            ax.scatter([x] * len(ys), ys, color=color, alpha=0.6)
            ax.plot([x - 0.3, x + 0.3], [statistics.median(ys)] * 2, color="black")
    ax.set_xticks(range(4), ["shared:\nright guess", "shared:\nwrong guess",
                             "salted:\nright guess", "salted:\nwrong guess"])  # fmt: skip
    ax.set_ylabel("tenant B's time to first token (ms)")
    ax.set_title(f"a {args.prompt_tokens}-word prompt tenant A sent first ({args.rounds} rounds)")
    fig.tight_layout()
    png = save_figure(fig, args.out, "lab-tenant-prefix-timing.png")
    record = make_record(
        kind="lab-tenant-prefix-timing",
        engine=modes[0]["engine"],
        model={"id": args.model, "sha256": loaded.file_sha256},
        workload={"rounds": args.rounds, "prompt_words": args.prompt_tokens, "seed": args.seed},
        results={"modes": modes, "plot": str(png)},
        seeds=[args.seed],
    )
    path = write_record(record, args.out)
    for m in modes:
        name = "shared cache" if m["shared_cache"] else "salt per key"
        print(f"{name}: B's TTFT right guess {1000 * m['right_median_s']:.0f} ms, wrong guess "
              f"{1000 * m['wrong_median_s']:.0f} ms (medians)")  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()
