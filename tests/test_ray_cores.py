"""Engine cores as Ray actors (engine/ray_cores.py) on a local Ray cluster: two replicas
behind one router give a single engine's tokens, an actor that dies fails its requests
at once, and without Ray the option says how to install it."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from conftest import tokens_through

from tokenworks.config import EngineConfig
from tokenworks.engine.messages import RayNotInstalledError, RequestFailedError
from tokenworks.engine.request import SamplingParams
from tokenworks.front.core_client import CoreClient
from tokenworks.front.interface import Submission
from tokenworks.front.replicas import ReplicaRouter

CONFIG = EngineConfig(model="toy", warmup=False, max_num_seqs=8, threads=1)
PROMPTS = [[5, 6, 7], [9] * 20, list(range(3, 40)), [40, 41] * 9]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_without_ray_the_backend_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails
    with pytest.raises(RayNotInstalledError, match="pip install"):
        CoreClient(CONFIG, backend="ray").start()


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_ray_replicas_give_one_engines_tokens_and_a_dead_actor_fails_fast(ray_cluster):
    router = ReplicaRouter(
        [CoreClient(CONFIG, startup_timeout_s=180, backend="ray") for _ in range(2)],
        "round_robin",
    )
    router.start()
    try:
        got, expected = tokens_through(router, PROMPTS, GREEDY)
        assert got == expected
        assert router.routed == [2, 2]
        pids = {r.ready.pid for r in router.replicas}
        assert len(pids) == 2 and os.getpid() not in pids  # each in an actor of its own

        doomed = router.replicas[0]

        async def killed():
            long = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
            stream = await doomed.submit(Submission(long, PROMPTS[0]))
            await stream.__anext__()
            ray_cluster.kill(doomed.process.actor)
            t0 = time.monotonic()
            with pytest.raises(RequestFailedError):
                async for _ in stream:
                    pass
            return time.monotonic() - t0

        assert asyncio.run(killed()) < 2.0
        assert not doomed.is_running and router.replicas[1].is_running
    finally:
        router.shutdown()
