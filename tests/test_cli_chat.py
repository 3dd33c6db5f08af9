"""`tokenworks chat` as a user runs it: Ctrl-C stops an answer, not the program."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


class _Output:
    """A subprocess's stdout, read as it comes; until() consumes up to a marker and keeps
    whatever came after it in the same read for the next call."""

    def __init__(self, proc):
        self.proc, self.buffer = proc, ""

    def until(self, marker: str, timeout: float = 120.0) -> str:
        t0, fd = time.monotonic(), self.proc.stdout.fileno()
        while marker not in self.buffer:
            assert self.proc.poll() is None, self.buffer
            assert time.monotonic() - t0 < timeout, f"no {marker!r} in {self.buffer!r}"
            if select.select([fd], [], [], 0.1)[0]:
                self.buffer += os.read(fd, 4096).decode(errors="replace")
        head, _, self.buffer = self.buffer.partition(marker)
        return head + marker


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(smol_loaded):
    cmd = [sys.executable, "-m", "tokenworks.cli", "chat", "--threads", "1", "--max-tokens",
           "4000", "--temperature", "0", "--no-warmup"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a pipe, not a terminal: no buffering
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    out = _Output(proc)
    try:
        out.until("> ")
        proc.stdin.write(b"Write a very long story about a river.\n")
        proc.stdin.flush()
        time.sleep(3)  # the answer is under way (4,000 tokens take far longer)
        proc.send_signal(signal.SIGINT)
        answer = out.until("[stopped]")
        out.until("> ")
        proc.send_signal(signal.SIGINT)  # at the prompt: a hint, and the chat goes on
        out.until("Ctrl-D ends the chat")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        assert len(answer) > 20, answer
    finally:
        if proc.poll() is None:
            proc.kill()
