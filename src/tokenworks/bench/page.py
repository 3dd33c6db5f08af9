"""`tokenworks bench page`: what the web page adds to a request, and what it weighs.

One server on the model; headless Chromium (bench/browser.py, the network cut off) opens
the chat page. Each request is sent twice, in turn: from the page (the time from pressing
send to the first token shown, as the page measures it) and straight to the API over HTTP
(the time from sending to the first content in the stream). Beside each, the server's own
TTFT for that request (arrival in the engine to the first token): what a client adds past
it, the page's less the bare client's, is the page's own work. On a small machine the
browser also takes CPU from the engine, which shows in the server's TTFT instead. The
prefix cache is off, so neither request helps the other. The page's weight is the bytes
it loads before it can be used; a screenshot of each page is written beside the record.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from tokenworks.bench.record import make_record, model_record, write_record
from tokenworks.config import engine_kwargs

PROMPTS = (
    "Name a colour.", "What is two plus two?", "Say hello in French.",
    "Name a planet.", "Write one word about rain.", "What is the opposite of hot?",
)  # fmt: skip
SHOWN = "Write a Python function that adds two numbers, and say in one line what it does."
LAST = "[...document.querySelectorAll('li.message.assistant')].pop()"


def api_ttft_ms(client: httpx.Client, body: dict) -> float:
    """Milliseconds from sending a streamed request to its first content chunk (on a kept
    connection, as the browser's)."""
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                if delta and delta[0]["delta"].get("content"):
                    first = (time.perf_counter() - t0) * 1000
    return first


def page_ttft_ms(browser, prompt: str) -> float:
    """The page's own time from pressing send to the first token shown."""
    browser.evaluate("document.getElementById('new-chat').click()")
    browser.evaluate(
        f"document.getElementById('prompt').value = {json.dumps(prompt)};"
        "document.getElementById('composer').requestSubmit()"
    )
    browser.wait(f"(() => {{ const m = {LAST}; return m && m.dataset.state === 'done'; }})()",
                 every=0.005)  # fmt: skip
    return float(browser.evaluate(f"{LAST}.dataset.firstTokenMs"))


def page_weight(browser, url: str, path: str) -> dict:
    """Bytes over the wire for everything the page loads from its own files (not the API)."""
    seen = len(browser.events)
    browser.open(url + path)
    time.sleep(1.0)
    browser.evaluate("1")  # takes in the events that arrived meanwhile
    events = browser.events[seen:]
    urls = {e["params"]["requestId"]: e["params"]["request"]["url"]
            for e in events if e.get("method") == "Network.requestWillBeSent"}  # fmt: skip
    sizes = {}
    for e in events:
        if e.get("method") == "Network.loadingFinished" and e["params"]["requestId"] in urls:
            name = urls[e["params"]["requestId"]].removeprefix(url)
            if name == path or name.startswith("/ui/"):
                sizes[name] = int(e["params"]["encodedDataLength"])
    return {"files": sizes, "bytes": sum(sizes.values())}


class ServerTTFT:
    """Each request's time to first token as the server measured it (arrival in the engine
    to the first token), read off its TTFT histogram's sum and count."""

    def __init__(self, state, model: str):
        self.registry = state.metrics.registry
        self.labels = {"model_name": model, "engine": "0"}
        self.seen = self._read()

    def _read(self) -> tuple[float, float]:
        name = "tokenworks:time_to_first_token_seconds"
        get = self.registry.get_sample_value
        return get(name + "_sum", self.labels) or 0.0, get(name + "_count", self.labels) or 0.0

    def next_ms(self, timeout: float = 10.0) -> float:
        """The TTFT of the one request finished since the last call."""
        deadline = time.monotonic() + timeout
        while (now := self._read())[1] < self.seen[1] + 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not count the request's first token")
            time.sleep(0.005)
        ms = (now[0] - self.seen[0]) * 1000
        self.seen = now
        return ms


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "p90": ordered[int(0.9 * (len(ordered) - 1))], "all": values}  # fmt: skip


def run_page(args) -> Path:
    from tokenworks import LLM
    from tokenworks.bench.browser import Browser, chromium_version
    from tokenworks.serve.app import build_app
    from tokenworks.serve.lab_records import RecordsFolder
    from tokenworks.serve.server import ServerThread, make_state

    kw = {**engine_kwargs(args), "enable_prefix_caching": False}
    llm = LLM(args.model, **kw)
    state = make_state(llm.engine, [args.model])
    state.records = RecordsFolder(args.records_dir)
    page, api, page_server, api_server, out = [], [], [], [], Path(args.out)
    scratch = Path(tempfile.mkdtemp(prefix="tokenworks-page-"))
    with (
        ServerThread(build_app(state)) as srv,
        Browser(offline=True) as browser,
        httpx.Client(base_url=srv.url, timeout=120) as client,
    ):
        browser.open(srv.url)
        browser.evaluate("localStorage.clear()")
        browser.open(srv.url)
        browser.wait("!!document.querySelector('#model option')")
        browser.evaluate(
            "document.getElementById('temperature').value = '0';"
            f"document.getElementById('max_tokens').value = '{args.max_tokens}'"
        )
        server = ServerTTFT(state, args.model)
        for i in tqdm(range(args.requests), desc="requests"):
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"model": args.model, "messages": [{"role": "user", "content": prompt}],
                    "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0, "top_p": 1, "max_tokens": args.max_tokens}  # fmt: skip
            # in turn, so that the machine's drift falls on both alike
            for side in ("api", "page") if i % 2 else ("page", "api"):
                if side == "page":
                    page.append(page_ttft_ms(browser, prompt))
                    page_server.append(server.next_ms())
                else:
                    api.append(api_ttft_ms(client, body))
                    api_server.append(server.next_ms())
        # the screenshot: one answer worth looking at, the panel watching it
        browser.evaluate("localStorage.clear()")
        browser.open(srv.url)
        browser.wait("!!document.querySelector('#model option')")
        browser.evaluate(
            "document.getElementById('temperature').value = '0';"
            "document.getElementById('max_tokens').value = '200'"
        )
        page_ttft_ms(browser, SHOWN)
        time.sleep(1.5)  # the sparklines take in the last polls
        shots = {"chat": browser.screenshot(scratch / "chat.png")}
        weights = {"chat": page_weight(browser, srv.url, "/"),
                   "lab": page_weight(browser, srv.url, "/lab")}  # fmt: skip
        browser.wait("document.querySelectorAll('#records tbody tr, #folder').length > 0")
        time.sleep(1.0)  # the first plots come in
        shots["lab"] = browser.screenshot(scratch / "lab.png")
        only_own = all(u.removeprefix("blob:").startswith(srv.url) for u in browser.requests())
        version = chromium_version()
    added = [p - a for p, a in zip(page, api, strict=True)]
    # what each client adds past the server's own TTFT; their difference is the page's work
    # (the engine's share, slowed where the browser takes the CPU from it, left out)
    own = [
        (p - ps) - (a - as_)
        for p, ps, a, as_ in zip(page, page_server, api, api_server, strict=True)
    ]
    results = {
        "page_ttft_ms": summary(page),
        "api_ttft_ms": summary(api),
        "page_minus_api_ms": summary(added),
        "server_ttft_ms": {"page": summary(page_server), "api": summary(api_server)},
        "page_own_ms": summary(own),
        "page_bytes": weights,
        "every_request_to_its_own_server": only_own,
    }
    record = make_record(
        kind="page",
        engine={**llm.config.to_dict(), "browser": version},
        model=model_record(llm),
        workload={
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "prompts": list(PROMPTS),
            "sampling": "greedy",
            "prefix_caching": False,
            "records_dir": args.records_dir,
        },  # fmt: skip
        results=results,
    )
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(record["created_unix"]))
    record["results"]["screenshots"] = {k: f"page-{stamp}-{k}.png" for k in shots}
    path = write_record(record, out)
    for k, shot in shots.items():  # beside the record, named after it
        shutil.move(shot, out / record["results"]["screenshots"][k])
    print(json.dumps({k: v for k, v in results.items() if k != "screenshots"}, indent=1,
                     default=str)[:2000])  # fmt: skip
    return path
