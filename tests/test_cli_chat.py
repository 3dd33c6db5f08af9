"""`tokenworks chat` as a user runs it: Ctrl-C stops an answer, not the program."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def _read_until(proc, marker: str, timeout: float = 120.0) -> str:
    out, t0 = "", time.monotonic()
    fd = proc.stdout.fileno()
    while marker not in out:
        assert proc.poll() is None, out
        assert time.monotonic() - t0 < timeout, f"no {marker!r} in {out!r}"
        if select.select([fd], [], [], 0.1)[0]:
            out += os.read(fd, 4096).decode(errors="replace")
    return out


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(smol_loaded):
    cmd = [sys.executable, "-m", "tokenworks.cli", "chat", "--threads", "1", "--max-tokens",
           "4000", "--temperature", "0", "--no-warmup"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a pipe, not a terminal: no buffering
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    try:
        _read_until(proc, "> ")
        proc.stdin.write(b"Write a very long story about a river.\n")
        proc.stdin.flush()
        time.sleep(3)  # the answer is under way (4,000 tokens take far longer)
        proc.send_signal(signal.SIGINT)
        out = _read_until(proc, "[stopped]")
        _read_until(proc, "> ")
        proc.send_signal(signal.SIGINT)  # at the prompt: a hint, and the chat goes on
        _read_until(proc, "Ctrl-D ends the chat")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        assert len(out) > 20, out
    finally:
        if proc.poll() is None:
            proc.kill()
