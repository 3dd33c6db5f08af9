"""Our server at two commits, interleaved in one run: `bench serve` at batch 1 and at
concurrency 16 against each in turn, and each API process's idle RSS.

    python benchmarks/serve_ab.py --before ddc069e [--rounds 2] [--out benchmarks/results]

The other commit runs from a git worktree (its src/ first on PYTHONPATH, in this venv);
"after" is the checkout this script is in. Each `bench serve` run writes its own record;
this script writes one more (kind serve-ab) holding every run's output throughput and RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tokenworks.bench.record import make_record, write_record  # noqa: E402
from tokenworks.serve.server import _free_port  # noqa: E402


def serve(src: Path, model: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "tokenworks.cli", "serve", "--model", model, "--port",
           str(port), "--threads", str(threads), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        assert proc.poll() is None, f"the server from {src} exited"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server from {src} did not start")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the commit to set beside this checkout")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="tokenworks-ab-") as tmp:
        worktree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree),
                        args.before], check=True, capture_output=True)  # fmt: skip
        try:
            sources = {"before": worktree / "src", "after": ROOT / "src"}
            for round_ in range(args.rounds):
                for label, src in sources.items():
                    proc, url = serve(src, args.model, args.threads)
                    try:
                        time.sleep(2)  # idle: what the API process holds at rest
                        idle = rss_bytes(proc.pid)
                        out = Path(args.out)
                        before = set(out.glob("serving-*.json"))
                        subprocess.run(
                            [sys.executable, "-m", "tokenworks.cli", "bench", "serve",
                             "--base-url", url, "--served-model", args.model, "--label",
                             f"{label} ({args.before if label == 'before' else 'this'})",
                             "--max-concurrency", "1,16", "--num-prompts",
                             str(args.num_prompts), "--out", str(out)],
                            check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                        )  # fmt: skip
                        (record,) = set(out.glob("serving-*.json")) - before
                        points = json.loads(record.read_text())["results"]["runs"]
                        tok_s = [pt["figures"]["output_throughput"] for pt in points]
                        runs.append({"round": round_, "version": label, "idle_api_rss": idle,
                                     "output_tok_s": tok_s, "record": record.name})  # fmt: skip
                        print(f"round {round_} {label}: idle API RSS {idle / 2**20:.0f} MiB, "
                              f"output tok/s (batch 1, conc 16) {tok_s}")  # fmt: skip
                    finally:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(worktree)], check=False)  # fmt: skip
    record = make_record(
        kind="serve-ab",
        engine={"model": args.model, "threads": args.threads},
        model={"id": args.model},
        workload={
            "before": args.before,
            "rounds": args.rounds,
            "concurrency": [1, 16],
            "num_prompts": args.num_prompts,
        },  # fmt: skip
        results={"runs": runs},
    )
    print(write_record(record, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
