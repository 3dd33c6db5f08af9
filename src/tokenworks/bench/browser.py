"""Headless Chromium driven over the DevTools protocol: open a page, run JavaScript in it,
wait for what it shows, take screenshots, and hear every network request it makes. The
system's own Chromium is used (Debian's `chromium` package); nothing is downloaded.

`bench page` times the web page with it, and the web page's tests drive it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# quiet, and nothing sent anywhere of Chromium's own accord
FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--mute-audio",
)  # fmt: skip
# the network cut off: names resolve to nothing but loopback, and anything not on loopback
# (which Chromium never sends through a proxy) goes to a proxy that is not there
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
           "--proxy-server=http://127.0.0.1:9")  # fmt: skip


class BrowserError(RuntimeError):
    pass


def find_chromium() -> str:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    raise BrowserError(
        "no Chromium found (looked for " + ", ".join(CANDIDATES) + "): install the system's "
        "package, e.g. `apt-get install chromium` on Debian or Ubuntu"
    )


class Browser:
    """One headless Chromium with one page. events: the DevTools events heard so far."""

    def __init__(self, offline: bool = False, width: int = 1400, height: int = 900,
                 timeout: float = 30.0):  # fmt: skip
        from websockets.sync.client import connect

        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="tokenworks-chromium-")
        args = [find_chromium(), *FLAGS, *(OFFLINE if offline else ()),
                f"--window-size={width},{height}", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._stack = contextlib.ExitStack()
        try:
            socket = connect(self._page_socket(self._port()), max_size=None, open_timeout=timeout)
            self.ws = self._stack.enter_context(socket)
        except BaseException:
            self.close()
            raise
        self.events: list[dict] = []
        self._id = 0
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable")

    def _port(self) -> int:
        """The DevTools port Chromium chose, from the file it writes in its profile."""
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"Chromium exited at start (status {self.proc.returncode})")
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.05)
        raise BrowserError(f"Chromium did not open its DevTools port in {self.timeout} s")

    def _page_socket(self, port: int) -> str:
        import httpx

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.05)
        raise BrowserError("Chromium opened no page")

    def call(self, method: str, **params) -> dict:
        """One DevTools command and its result; events that arrive meanwhile are kept."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"{method}: no answer in {self.timeout} s")
            message = json.loads(self.ws.recv(timeout=left))
            if message.get("id") == self._id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error'].get('message')}")
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str, await_promise: bool = False):
        """The value of a JavaScript expression in the page (JSON-able values)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=await_promise)  # fmt: skip
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = (details.get("exception") or {}).get("description") or details.get("text")
            raise BrowserError(f"the page raised: {text}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Navigate and wait for the page's load event."""
        seen = len(self.events)
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired", after=seen)

    def wait_event(self, method: str, after: int = 0) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for event in self.events[after:]:
                if event.get("method") == method:
                    return event
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"no {method} in {self.timeout} s")
            try:
                self.events.append(json.loads(self.ws.recv(timeout=min(left, 0.5))))
            except TimeoutError:
                pass

    def wait(self, expression: str, timeout: float | None = None, every: float = 0.01):
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout or self.timeout} s: {expression}")
            time.sleep(every)

    def requests(self) -> list[str]:
        """The URL of every request the page has made."""
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]  # fmt: skip

    def failed_requests(self) -> list[str]:
        failed = {e["params"]["requestId"] for e in self.events
                  if e.get("method") == "Network.loadingFailed"}  # fmt: skip
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"
                and e["params"]["requestId"] in failed]  # fmt: skip

    def complaints(self) -> list[str]:
        """What the browser logged as errors or warnings (a refused script, a policy
        violation, a failed load), and exceptions the page's scripts threw."""
        out = []
        for e in self.events:
            if e.get("method") == "Log.entryAdded":
                entry = e["params"]["entry"]
                if entry.get("level") in ("error", "warning"):
                    out.append(f"{entry.get('source')}: {entry.get('text')}")
            elif e.get("method") == "Runtime.exceptionThrown":
                details = e["params"]["exceptionDetails"]
                out.append((details.get("exception") or {}).get("description") or details["text"])
        return out

    def screenshot(self, path: str | Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        self._stack.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def chromium_version() -> str:
    out = subprocess.run([find_chromium(), "--version"], capture_output=True, text=True)
    return out.stdout.strip() or os.path.basename(find_chromium())
