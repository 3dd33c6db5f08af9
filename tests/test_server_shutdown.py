"""`tokenworks serve` stopped as supervisors stop it: SIGTERM or SIGINT to its pid or to its
whole process group, idle, after requests, with streams in flight, with a core killed. It
refuses new requests (503, /health too), lets those in flight finish for up to
--shutdown-timeout, ends the rest with an error event, stops its core and exits 0; a
second signal exits at once. Real subprocesses, real sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import wait_for

from tokenworks.serve.server import _free_port

SLOW = "smollm2-135m"  # streams of 2000 tokens outlast a few seconds' --shutdown-timeout


class Served:
    """A `tokenworks serve` subprocess in a process group of its own (as a supervisor
    starts it), its output kept for the failure message."""

    def __init__(self, *flags: str, model: str = "toy"):
        self.port = _free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenworks.cli", "serve", "--model", model, "--port",
               str(self.port), "--threads", "1", "--log-level", "warning", *flags]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            wait_for(self._up, timeout=180)
        except BaseException:
            self.close()
            raise

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def _up(self) -> bool:
        assert self.proc.poll() is None, "".join(self.output)
        try:
            return httpx.get(self.url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def core_pids(self) -> list[int]:
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return [int(pid) for pid in f.read().split()]

    def signal(self, sig: int, group: bool) -> None:
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def exit_code(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"the server did not exit within {timeout} s:\n" + "".join(self.output)
            ) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie left for its reaper is gone too
        return f.read().split(") ")[1].startswith("Z")


def stream_ending(url: str, max_tokens: int, ends: list, model: str = "toy") -> None:
    """Stream a completion; append how it ended: "done" (a finish reason, then [DONE]),
    "error: ..." (an error event, then [DONE]) or "cut" (no ending event)."""
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    finished, error, done = False, None, False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                elif event["choices"] and event["choices"][0]["finish_reason"]:
                    finished = True
    except httpx.HTTPError:
        pass
    if done and error is not None:
        ends.append(f"error: {error}")
    elif done and finished:
        ends.append("done")
    else:
        ends.append("cut")


@pytest.mark.parametrize(
    "sig, group, served_first",
    [(signal.SIGTERM, False, False), (signal.SIGTERM, True, True), (signal.SIGINT, True, True)],
    ids=["sigterm-pid-idle", "sigterm-group-after-a-request", "sigint-group-after-a-request"],
)
def test_a_signal_stops_the_server_and_its_core_with_status_0(sig, group, served_first):
    srv = Served()
    try:
        core = srv.core_pids()
        if served_first:
            ends = []
            stream_ending(srv.url, 8, ends)
            assert ends == ["done"]
        srv.signal(sig, group)
        assert srv.exit_code(timeout=30) == 0, "".join(srv.output)
        assert all(_gone(pid) for pid in core)
    finally:
        srv.close()


def test_streams_in_flight_finish_or_end_with_an_error_event_and_new_requests_get_503():
    """SIGTERM to the group with 4 streams in flight: 2 short ones finish, 2 that would
    outlast --shutdown-timeout end with an error event saying why; meanwhile /health and
    new requests get 503; then the server exits 0."""
    srv = Served("--shutdown-timeout", "3", "--max-num-seqs", "4", model=SLOW)
    try:
        ends: list[str] = []
        lengths = [6, 6, 2000, 2000]
        threads = [
            threading.Thread(target=stream_ending, args=(srv.url, n, ends, SLOW)) for n in lengths
        ]
        for t in threads:
            t.start()
        # all four accepted before the signal (one still in its client would get a 503)
        wait_for(lambda: _accepted(srv) == 4 and _running(srv) >= 2, timeout=60)
        srv.signal(signal.SIGTERM, group=True)
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, timeout=10)
        refused = httpx.post(
            srv.url + "/v1/completions", json={"model": SLOW, "prompt": "Hi", "max_tokens": 2}
        )
        assert refused.status_code == 503 and "shutting down" in refused.text
        assert srv.exit_code(timeout=30) == 0, "".join(srv.output)
        for t in threads:
            t.join(timeout=30)
        assert "cut" not in ends, ends
        assert len(ends) == 4 and ends.count("done") >= 2, ends
        assert all("shutdown-timeout" in e for e in ends if e != "done"), ends
    finally:
        srv.close()


def _metric(srv: Served, *names: str) -> int:
    """The sum of the server's /metrics series whose names start with one of `names`."""
    lines = httpx.get(srv.url + "/metrics").text.splitlines()
    return int(sum(float(ln.split()[-1]) for ln in lines if ln.startswith(names)))


def _running(srv: Served) -> int:
    """Requests the server's engine is running."""
    return _metric(srv, "tokenworks:num_requests_running")


def _accepted(srv: Served) -> int:
    """Requests the server's engine holds or has finished."""
    return _metric(srv, "tokenworks:num_requests_running", "tokenworks:num_requests_waiting",
                   "tokenworks:request_success_total")  # fmt: skip


def test_a_second_signal_exits_at_once():
    srv = Served("--shutdown-timeout", "60", model=SLOW)
    try:
        ends: list[str] = []
        long = threading.Thread(target=stream_ending, args=(srv.url, 2000, ends, SLOW))
        long.start()
        wait_for(lambda: _running(srv) >= 1, timeout=60)
        srv.signal(signal.SIGTERM, group=True)
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, timeout=10)
        t0 = time.monotonic()
        srv.signal(signal.SIGTERM, group=True)
        assert srv.exit_code(timeout=10) == 0
        assert time.monotonic() - t0 < 5
        long.join(timeout=30)
    finally:
        srv.close()


def test_with_a_core_killed_a_signal_still_stops_the_server_with_status_0():
    """--restart-engine: the core is killed (SIGKILL, as the OOM killer does), the server
    starts another; a SIGTERM then stops both and exits 0."""
    srv = Served("--restart-engine")
    try:
        (core,) = srv.core_pids()
        os.kill(core, signal.SIGKILL)
        wait_for(lambda: srv.core_pids() not in ([], [core]), timeout=120)
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, timeout=120)
        (new_core,) = srv.core_pids()
        srv.signal(signal.SIGTERM, group=True)
        assert srv.exit_code(timeout=30) == 0, "".join(srv.output)
        assert _gone(new_core)
    finally:
        srv.close()
