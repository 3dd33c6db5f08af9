"""Lab: many streams on one batched engine over real sockets.

A real server (`tokenworks serve`) and real clients, each stream a chat request of its own
connection:

- overlap: one stream alone, then 32 at once: the tokens per second they get together and
  each gets, and how long each waits for its first token (it waits for its neighbours'
  prompts: the first to start and the last differ by the whole batch's prefill);
- one slow reader among them, under four server policies: buffer whatever it has not
  read (no bound); cancel it once 64 tokens wait for it in the server
  (`--max-stream-backlog`); the same with the kernel's send buffer for each connection
  bounded to 8 KiB (`--max-stream-socket-kb`); and with that bound, cancel it once it has
  taken nothing for 2 s (`--max-stream-stall`). The slow reader is a raw socket with a
  small receive buffer that takes 256 bytes every 0.25 s and hangs up after its time is
  out; the others read at full speed. For each: the others' time per token, what the slow
  reader got, the bytes the kernel held for it, and how long the engine ran it (a stream
  cancelled stops early; its error event waits behind the unread output);
- a client that has gone: a stream whose connection closes after its first few tokens,
  and the seconds the engine goes on running it (`/metrics`' running requests, polled).

    python labs/many_streams.py [--streams 32] [--tokens 128]

Writes an evidence record and a PNG (first tokens of the 32; the slow reader's policies).
"""

from __future__ import annotations

import argparse
import json
import socket
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

PROMPT = "Tell me, at length, the history of the lighthouse at the end of the harbour wall."
UNBOUNDED = ["--max-stream-backlog", "100000000", "--max-stream-stall", "100000"]
POLICIES = {  # name -> server flags
    "buffer_all": UNBOUNDED,
    "backlog_64": ["--max-stream-backlog", "64", "--max-stream-stall", "100000"],
    "socket_8k_backlog_64": ["--max-stream-socket-kb", "8", "--max-stream-backlog", "64",
                             "--max-stream-stall", "100000"],
    "socket_8k_stall_2s": ["--max-stream-socket-kb", "8", "--max-stream-backlog", "100000000",
                           "--max-stream-stall", "2"],
}  # fmt: skip


def body(tokens: int) -> dict:
    return {
        "model": "lab",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


def reader(url: str, tokens: int, out: list, start: threading.Event) -> None:
    """A client that reads as fast as it can: its first token and each gap after it."""
    start.wait()
    t0, times = time.perf_counter(), []
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", url + "/v1/chat/completions", json=body(tokens)) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    times.append(time.perf_counter() - t0)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    out.append(
        {
            "first_s": times[0] if times else None,
            "end_s": times[-1] if times else None,
            "chunks": len(times),
            "median_gap_s": statistics.median(gaps) if gaps else None,
        }
    )


def server_queue(server_port: int, client_port: int) -> int:
    """Bytes the kernel holds unsent in the server's socket of this connection
    (/proc/net/tcp's tx_queue): output the server has written that the reader has not
    taken."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, remote = int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16)
        if (local, remote) == (server_port, client_port):
            return int(f[4].split(":")[0], 16)
    return 0


def slow_reader(url: str, tokens: int, seconds: float, out: dict, start: threading.Event) -> None:
    """A raw socket with a small receive buffer, taking 256 bytes every 0.25 s, hanging up
    after `seconds`."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body(tokens)).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    start.wait()
    s.connect((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: "
        + host.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + payload
    )
    t0, got, held = time.perf_counter(), b"", 0
    s.settimeout(1.0)
    while time.perf_counter() - t0 < seconds:
        held = max(held, server_queue(int(port), s.getsockname()[1]))
        try:
            chunk = s.recv(256)
        except TimeoutError:
            continue
        if not chunk:
            break
        got += chunk
        time.sleep(0.25)
    s.close()
    out.update(
        {
            "chunks_read": got.count(b'"content"'),
            "hung_up_after_s": time.perf_counter() - t0,
            "kernel_held_bytes": held,  # the most the server's socket held unsent
            "bytes_read": len(got),
        }
    )


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("tokenworks:num_requests_running")
    )


def many(
    url: str,
    streams: int,
    tokens: int,
    slow: dict | None = None,
    slow_tokens: int = 0,
    slow_seconds: float = 0.0,
) -> tuple[list, float]:
    """`streams` fast readers (and a slow one), started together: their results and the
    seconds until the last fast one ended."""
    start, out = threading.Event(), []
    threads = [
        threading.Thread(target=reader, args=(url, tokens, out, start)) for _ in range(streams)
    ]
    if slow is not None:
        threads.append(
            threading.Thread(target=slow_reader, args=(url, slow_tokens, slow_seconds, slow, start))
        )
    samples: list[tuple[float, float]] = []  # (seconds, requests running in the engine)
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            samples.append((time.perf_counter() - t0, running(url)))
            time.sleep(0.05)

    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.set()
    poller = threading.Thread(target=sample)
    poller.start()
    for t in threads[:streams]:
        t.join()
    took = time.perf_counter() - t0
    if slow is not None:
        threads[-1].join()
        # the slow one runs while the engine runs more than the fast readers still reading
        ends = [r["end_s"] for r in out]
        slow["engine_ran_s"] = max(
            (t for t, n in samples if n > sum(e > t for e in ends) + 0.5), default=0.0
        )
    sampling.set()
    poller.join()
    return out, took


def overlapping(url: str, streams: int, tokens: int) -> dict:
    """One stream alone, then `streams` together."""
    alone, alone_s = many(url, 1, tokens)
    together, together_s = many(url, streams, tokens)
    firsts = sorted(1000 * r["first_s"] for r in together)
    out = {
        "alone_tokens_per_s": tokens / alone_s,
        "together_tokens_per_s": streams * tokens / together_s,
        "alone_gap_ms": 1000 * alone[0]["median_gap_s"],
        "together_gap_ms": 1000 * statistics.median(r["median_gap_s"] for r in together),
        "first_token_ms": {
            "first": firsts[0],
            "median": statistics.median(firsts),
            "last": firsts[-1],
        },
        "first_tokens_ms": firsts,
    }
    out["speedup"] = out["together_tokens_per_s"] / out["alone_tokens_per_s"]
    return out


def gone(url: str, tokens: int, after: int) -> dict:
    """A stream whose client hangs up after `after` tokens; seconds until the engine stops."""
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/chat/completions", json=body(tokens)) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:") and '"content"' in line
                if seen >= after:
                    break
        closed = time.perf_counter()  # leaving the block closes the connection
    while running(url) > 0 and time.perf_counter() - closed < 30:
        time.sleep(0.002)
    return {"tokens_read": seen, "engine_ran_after_close_s": time.perf_counter() - closed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128, help="tokens each fast reader streams")
    ap.add_argument("--slow-tokens", type=int, default=1024, help="tokens the slow reader asks")
    ap.add_argument("--slow-seconds", type=float, default=12.0, help="before it hangs up")
    ap.add_argument("--policies", default=",".join(POLICIES), help="the stream policies run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(streams=4, tokens=8, slow_tokens=64, slow_seconds=2.0,
                                        policies="buffer_all,socket_8k_stall_2s"))  # fmt: skip
    if unknown := set(args.policies.split(",")) - set(POLICIES):
        ap.error(f"--policies: {', '.join(sorted(unknown))} unknown; known: {', '.join(POLICIES)}")
    chosen = {name: POLICIES[name] for name in args.policies.split(",")}
    logs = Path(tempfile.mkdtemp(prefix="many-streams-"))
    base = [
        "--model",
        args.model,
        "--threads",
        str(args.threads),
        "--max-num-seqs",
        str(args.streams + 1),
    ]
    policies = {}
    overlap = gone_client = None
    for name, flags in tqdm(chosen.items(), desc="policies", unit="policy"):
        with running_server(
            tokenworks_server(base + flags, "lab"), {}, logs / f"{name}.log"
        ) as url:
            many(url, 1, args.tokens)  # the first request's own costs are chapter 2's
            if overlap is None:
                overlap = overlapping(url, args.streams, args.tokens)
                gone_client = gone(url, args.slow_tokens, 4)
            slow: dict = {}
            others, _ = many(
                url, args.streams - 1, args.tokens, slow, args.slow_tokens, args.slow_seconds
            )
            slow["others_gap_ms"] = 1000 * statistics.median(r["median_gap_s"] for r in others)
        # the server says when it cancels a reader that fell behind; the reader cannot
        # tell, its error event being behind the output it has not read
        said = [x for x in (logs / f"{name}.log").read_text().splitlines() if "fell behind" in x]
        slow["cancelled_by_server"] = bool(said)
        slow["server_said"] = said[0].split(": ", 1)[-1] if said else None
        policies[name] = slow
        print(
            f"{name:20s} slow reader read {slow['chunks_read']} tokens, cancelled "
            f"{slow['cancelled_by_server']}, the engine ran it {slow['engine_ran_s']:.1f} s, "
            f"the kernel held {slow['kernel_held_bytes']:,} bytes; the others "
            f"{slow['others_gap_ms']:.1f} ms a token"
        )
    print(
        f"{args.streams} together: {overlap['speedup']:.1f}x the tokens/s of one alone; first "
        f"tokens from {overlap['first_token_ms']['first']:.0f} to "
        f"{overlap['first_token_ms']['last']:.0f} ms"
    )
    print(
        f"a client gone after {gone_client['tokens_read']} tokens: the engine ran on "
        f"{1000 * gone_client['engine_ran_after_close_s']:.0f} ms"
    )

    record = make_record(
        kind="lab.many_streams",
        engine={
            "server": "tokenworks serve",
            "model": args.model,
            "threads": args.threads,
            "max_num_seqs": args.streams + 1,
            "policies": chosen,
        },
        model={"id": args.model},
        workload={
            "streams": args.streams,
            "tokens": args.tokens,
            "slow_tokens": args.slow_tokens,
            "slow_seconds": args.slow_seconds,
            "slow_reader": "SO_RCVBUF 4096, 256 B / 0.25 s",
            "prompt": PROMPT,
        },
        results={"overlap": overlap, "slow_reader": policies, "gone_client": gone_client},
        seeds=[],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.bar(range(len(overlap["first_tokens_ms"])), overlap["first_tokens_ms"], color="#4477aa")
    a.set(
        xlabel="stream (by when its first token came)",
        ylabel="ms to first token",
        title=f"{args.streams} streams started together",
    )
    names = list(policies)
    xs = range(len(names))
    b.bar(
        [x - 0.2 for x in xs],
        [policies[n]["engine_ran_s"] for n in names],
        0.4,
        label="engine ran the slow stream (s)",
    )
    b.bar(
        [x + 0.2 for x in xs],
        [policies[n]["chunks_read"] / 10 for n in names],
        0.4,
        label="tokens it read / 10",
    )
    b.set(
        xticks=list(xs),
        xticklabels=[n.replace("_", " ") for n in names],
        title="one slow reader, by policy",
    )
    b.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
