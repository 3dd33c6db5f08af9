"""A reader that takes nothing, over a real socket to a `tokenworks serve` subprocess: with
the kernel's send buffer for each connection bounded (--max-stream-socket-kb), its unread
output backs up into the server, where --max-stream-backlog sees it and cancels the
request. (Left to itself, the kernel grows a connection's buffer to megabytes, a whole
answer, and the server sees a fast reader.)"""

from __future__ import annotations

import json
import socket

from conftest import wait_for
from test_server_shutdown import SLOW, Served


def _stalled_stream(port: int, max_tokens: int) -> socket.socket:
    """A streamed completion sent on a socket with a small receive buffer, never read."""
    body = json.dumps({"model": SLOW, "prompt": "Count:", "max_tokens": max_tokens,
                       "stream": True, "temperature": 0, "ignore_eos": True}).encode()  # fmt: skip
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    s.sendall(head + body)
    return s


def test_a_bounded_socket_lets_the_backlog_limit_cancel_a_reader_that_takes_nothing():
    srv = Served("--max-stream-socket-kb", "8", "--max-stream-backlog", "32", model=SLOW)
    try:
        reader = _stalled_stream(srv.port, 2000)  # about 400 KB of events
        try:
            wait_for(lambda: any("fell behind" in line for line in srv.output), timeout=120)
        finally:
            reader.close()
        said = next(line for line in srv.output if "fell behind" in line)
        assert "output tokens were waiting for it (at most 32)" in said
    finally:
        srv.close()
