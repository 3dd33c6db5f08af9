"""The web page in a real browser: headless Chromium (the system's package; `.ci/run`
installs it where missing) driven over the DevTools protocol, against a real server on the
default model, with every address but loopback cut off. Screenshots of each page go to
build/test-artefacts/."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from conftest import start_server

from tokenworks.bench.browser import Browser
from tokenworks.serve.lab_records import RecordsFolder

ROOT = Path(__file__).resolve().parents[1]
ARTEFACTS = ROOT / "build" / "test-artefacts"
PROMPT = "Tell me about the sea, the ships on it and the people who sail them."
MAX_TOKENS = 160
HOSTILE = (
    '<script>window.pwned = 1</script> <img src="x" onerror="window.pwned = 2"> '
    "[click me](javascript:window.pwned=3) <a href=\"javascript:window.pwned=4\">here</a>"
)
LAST_ANSWER = "[...document.querySelectorAll('li.message.assistant')].pop()"


@pytest.fixture(scope="module")
def browser():
    with Browser(offline=True) as b:
        yield b


@pytest.fixture(scope="module")
def server(smol_core_server):
    smol_core_server.state.records = RecordsFolder(ROOT / "benchmarks" / "results")
    return smol_core_server


def fresh_page(browser, url: str, **settings) -> None:
    """The chat page with nothing kept from before, and these settings."""
    browser.open(url)
    browser.evaluate("localStorage.clear()")
    browser.open(url)
    browser.wait("!!document.querySelector('#model option')")
    for field, value in settings.items():
        field, value = json.dumps(field), json.dumps(value)
        browser.evaluate(f"document.getElementById({field}).value = {value}")


def send(browser, text: str) -> None:
    browser.evaluate(
        f"document.getElementById('prompt').value = {json.dumps(text)};"
        "document.getElementById('composer').requestSubmit()"
    )


def watch_answer(browser, timeout: float = 120.0) -> list[tuple[str, int, str]]:
    """(state, characters shown, the panel's running requests) each time one changes,
    until the answer is done."""
    seen: list = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        now = browser.evaluate(
            f"(() => {{ const m = {LAST_ANSWER}; if (!m) return null;"
            " const r = document.querySelector('[data-figure$=\"/running\"] .value');"
            " return [m.dataset.state, m.querySelector('.content').textContent.length,"
            " r ? r.textContent : null]; })()"
        )
        if now and (not seen or seen[-1] != now):
            seen.append(now)
        if now and now[0] != "streaming":
            return seen
        time.sleep(0.01)
    raise AssertionError(f"the answer did not finish in {timeout} s: {seen[-3:]}")


def kept_answer(browser) -> dict:
    """The answer as the page keeps it in the browser's storage."""
    return browser.evaluate(
        "JSON.parse(localStorage.getItem('tokenworks.conversations'))[0].messages[1]"
    )


def only_loopback(browser) -> None:
    """Every request the browser made (these tests' servers, one origin each) stayed on
    this machine."""
    hosts = {urlsplit(u.removeprefix("blob:")).hostname for u in browser.requests()}
    assert hosts == {"127.0.0.1"}, f"the page asked {hosts}"
    assert not browser.failed_requests()
    # nothing refused by the page's own policy, no script error (a 401 is logged as a
    # failed load where the key is asked for)
    assert not [c for c in browser.complaints() if "401" not in c], browser.complaints()


def test_the_chat_page_streams_the_api_s_greedy_answer(browser, server):
    fresh_page(browser, server.url, temperature="0", max_tokens=str(MAX_TOKENS),
               extra='{"ignore_eos": true}')  # fmt: skip
    send(browser, PROMPT)
    seen = watch_answer(browser)
    assert seen[-1][0] == "done", seen[-1]
    streaming = [s for s in seen if s[0] == "streaming"]
    assert len({chars for _, chars, _ in streaming}) >= 3, "the answer did not arrive in pieces"
    assert any(running not in (None, "0") for _, _, running in streaming), (
        "the engine panel never showed the request running"
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    api = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}], temperature=0,
        top_p=1, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True},
    )  # fmt: skip
    kept = kept_answer(browser)
    assert kept["content"] == api.choices[0].message.content
    assert kept["stats"]["completion_tokens"] == api.usage.completion_tokens == MAX_TOKENS
    assert kept["stats"]["ttft_ms"] > 0
    shown = browser.evaluate(f"{LAST_ANSWER}.querySelector('.content').innerText")
    first_words = " ".join(api.choices[0].message.content.split()[:4]).strip("*#_`")
    assert first_words in " ".join(shown.split())
    stats = browser.evaluate(f"{LAST_ANSWER}.querySelector('.stats').textContent")
    assert f"{MAX_TOKENS} generated" in stats and "first token" in stats
    only_loopback(browser)
    browser.screenshot(ARTEFACTS / "web-chat.png")
    (engine,) = httpx.get(server.url + "/engine/state").json()["engines"]
    assert engine["generation_tokens"] >= 2 * MAX_TOKENS
    kv = engine["kv"]
    assert kv["blocks"] == kv["used"] + kv["free"] > 0 and kv["groups"] == []  # no windows
    assert sum(engine["prefix"]["misses"].values()) >= 2


def test_html_in_an_answer_is_shown_as_text(browser, server):
    # the grammar makes the real model write exactly this
    fresh_page(browser, server.url, temperature="0", max_tokens="200",
               extra=json.dumps({"guided_choice": [HOSTILE]}))  # fmt: skip
    send(browser, "Say something.")
    assert watch_answer(browser)[-1][0] == "done"
    assert kept_answer(browser)["content"] == HOSTILE
    content = f"{LAST_ANSWER}.querySelector('.content')"
    assert browser.evaluate("window.pwned === undefined")
    assert browser.evaluate(f"{content}.querySelectorAll('script, img, a, [onerror]').length") == 0
    shown = browser.evaluate(f"{content}.textContent")
    for piece in ("<script>window.pwned = 1</script>", 'onerror="window.pwned = 2"',
                  "javascript:window.pwned=3", '<a href="javascript:window.pwned=4">'):  # fmt: skip
        assert piece in shown
    browser.screenshot(ARTEFACTS / "web-chat-hostile.png")


def test_the_page_s_headers_carry_a_strict_content_security_policy(server):
    for path in ("/", "/lab", "/ui/chat.js", "/ui/style.css"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp, path
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(server.url + "/ui/../app.py").status_code == 404
    assert httpx.get(server.url + "/ui/nothing.js").status_code == 404


def test_the_lab_shows_the_records_with_their_chapters_and_plots(browser, server):
    browser.open(server.url + "/lab")
    browser.wait("document.querySelectorAll('#records tbody tr').length > 0")
    rows = browser.evaluate(
        "[...document.querySelectorAll('#records tbody tr')].map(r => r.innerText)"
    )
    records = list((ROOT / "benchmarks" / "results").glob("*.json"))
    assert len(rows) == len(records)
    assert any("17 Speculative Decoding" in r and "bench spec" in r for r in rows)
    browser.wait("[...document.querySelectorAll('img.plot')].some(i => i.src.startsWith('blob:') && i.complete && i.naturalWidth > 0)")  # noqa: E501
    only_loopback(browser)
    browser.screenshot(ARTEFACTS / "web-lab.png")
    listing = httpx.get(server.url + "/lab/records").json()
    assert httpx.get(server.url + "/lab/files/" + listing["records"][0]["name"]).status_code == 200
    for bad in ("..%2Fpyproject.toml", "%2Fetc%2Fpasswd", ".hidden.json", "notes.txt"):
        assert httpx.get(server.url + "/lab/files/" + bad).status_code == 404, bad


def test_with_an_api_key_the_page_asks_for_it_once(browser, smol_loaded):
    srv = start_server(smol_loaded, api_keys=("sesame",))
    try:
        assert httpx.get(srv.url + "/").status_code == 200
        assert httpx.get(srv.url + "/engine/state").status_code == 401
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        browser.open(srv.url)
        browser.wait("!!document.getElementById('key-dialog')?.open")
        responses = [e["params"]["response"] for e in browser.events
                     if e.get("method") == "Network.responseReceived"]  # fmt: skip
        statuses = [(r["url"], r["status"]) for r in responses]
        assert (srv.url + "/v1/models", 401) in statuses
        browser.evaluate(
            "document.getElementById('key-input').value = 'sesame';"
            "document.querySelector('#key-form button').click()"
        )
        browser.wait("!!document.querySelector('#model option')")
        send(browser, "Hello!")
        assert watch_answer(browser)[-1][0] == "done"
        browser.open(srv.url)  # the key is kept: not asked again
        browser.wait("!!document.querySelector('#model option')")
        assert not browser.evaluate("!!document.getElementById('key-dialog')?.open")
        browser.screenshot(ARTEFACTS / "web-key.png")
    finally:
        srv.stop()


def test_markdown_is_rendered_from_text_nodes(browser, server):
    browser.open(server.url)
    source = (
        "# Title\n\nSome **bold**, *italic* and `x < y` with [a link](https://example.org) "
        "and [a bad one](javascript:alert(1)).\n\n- one\n- two\n  - nested\n\n"
        "```python\nif a < b:\n    print('<b>')\n```\n\n| a | b |\n|---|---|\n| 1 | <i>2</i> |\n"
    )
    shape = browser.evaluate(
        "import('/ui/markdown.js').then(({render}) => {"
        f" const d = document.createElement('div'); d.append(render({json.dumps(source)}));"
        " const text = (q) => d.querySelector(q).textContent;"
        " return {h: text('h3'), strong: text('strong'), em: text('em'), code: text('p code'),"
        " links: [...d.querySelectorAll('a')].map(a => a.getAttribute('href')),"
        " items: d.querySelectorAll('li').length, nested: d.querySelectorAll('ul ul').length,"
        " pre: text('pre code'), lang: d.querySelector('pre code').dataset.lang,"
        " cells: [...d.querySelectorAll('td')].map(c => c.textContent),"
        " elements: d.querySelectorAll('i, b, script').length}; })",
        await_promise=True,
    )
    assert shape == {
        "h": "Title", "strong": "bold", "em": "italic", "code": "x < y",
        "links": ["https://example.org"], "items": 3, "nested": 1,
        "pre": "if a < b:\n    print('<b>')", "lang": "python", "cells": ["1", "<i>2</i>"],
        "elements": 0,
    }  # fmt: skip


def test_tool_calls_and_json_are_shown_as_such(browser, server):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]  # fmt: skip
    fresh_page(browser, server.url, temperature="0", tools=json.dumps(tools),
               extra='{"tool_choice": "required"}')  # fmt: skip
    send(browser, "What is the weather in Paris?")
    assert watch_answer(browser)[-1][0] == "done"
    call = kept_answer(browser)["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])
    shown = browser.evaluate(f"{LAST_ANSWER}.querySelector('.tool-call').innerText")
    assert shown.startswith("tool call: get_weather") and '"city"' in shown
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
              "required": ["name"], "additionalProperties": False}
    fresh_page(browser, server.url, temperature="0", format="json_schema",
               schema=json.dumps(schema), max_tokens="128")  # fmt: skip
    send(browser, "Invent a person.")
    assert watch_answer(browser)[-1][0] == "done"
    laid_out = browser.evaluate(f"{LAST_ANSWER}.querySelector('pre.json code').textContent")
    assert json.loads(laid_out) == json.loads(kept_answer(browser)["content"])
    assert "\n  " in laid_out  # indented, not as it came


def test_the_lab_renders_a_report_with_its_plots(browser, server, tmp_path):
    from tokenworks.bench.report import load_records, render

    serving = sorted((ROOT / "benchmarks" / "results").glob("serving-*.json"))[-1]
    shutil.copy(serving, tmp_path / serving.name)
    render(load_records([tmp_path / serving.name]), tmp_path)
    plots = sorted(p.name for p in tmp_path.glob("*.png"))
    kept = server.state.records
    server.state.records = RecordsFolder(tmp_path)
    try:
        browser.open(server.url + "/lab")
        browser.wait("!!document.querySelector('#reports button')")
        assert browser.evaluate("document.querySelector('#reports button').textContent") == (
            "report.md"
        )
        browser.evaluate("document.querySelector('#reports button').click()")
        browser.wait("!document.getElementById('report-view').hidden")
        view = "document.getElementById('report-view')"
        assert browser.evaluate(f"{view}.querySelectorAll('table').length") >= 1
        assert browser.evaluate(f"{view}.querySelector('h4').textContent").startswith("serving")
        shown = browser.wait(
            f"(() => {{ const imgs = [...{view}.querySelectorAll('img.plot')];"
            " return imgs.length && imgs.every(i => i.src.startsWith('blob:') && i.complete"
            " && i.naturalWidth > 0) && imgs.map(i => i.dataset.file); })()"
        )
        assert plots and sorted(shown) == plots
        only_loopback(browser)
    finally:
        server.state.records = kept
