"""The engine front (CoreClient) over its core, on the toy model (no HTTP, no real weights):
the core in a thread of this process and in a process of its own run the same tests, with
tests/faults.py's seed-triggered faults in the engine wherever it runs."""

from __future__ import annotations

import asyncio
import time

import faults
import pytest

from tokenworks import SamplingParams
from tokenworks.config import EngineConfig
from tokenworks.engine.engine import LLMEngine
from tokenworks.engine.messages import (
    DeadlineExceededError,
    EngineNotRunningError,
    QueueFullError,
    ReaderTooSlowError,
    RequestFailedError,
)
from tokenworks.front.core_client import CoreClient
from tokenworks.front.interface import Submission


class Recorder:
    def __init__(self):
        self.steps, self.finished, self.gaps = 0, [], []

    def on_step(self, preemptions, gauges):
        self.steps += 1

    def on_inter_token(self, seconds):
        self.gaps.append(seconds)

    def on_request_finished(self, m):
        self.finished.append(m)


SMALL = EngineConfig(model="toy", dtype="float32", max_num_seqs=2, max_waiting=3)


def toy_front(toy_llm, backend: str, config: EngineConfig = SMALL, **kw) -> CoreClient:
    """A started front over a toy core: in a thread (on the shared weights) or a process
    (with tests/faults.py's faults installed; a thread core has them where a test asks)."""
    if backend == "thread":
        front = CoreClient(engine=LLMEngine(config, toy_llm.engine.loaded), **kw)
    else:
        kw = dict(startup_timeout_s=120, init="faults:install") | kw
        front = CoreClient(config, backend=backend, **kw)
    front.start()
    return front


@pytest.fixture(params=["thread", "mp"])
def backend(request, faults_here):
    """Where the core runs, and the faults in place there."""
    return request.param


@pytest.fixture
def front(toy_llm, backend):
    recorder = Recorder()
    front = toy_front(toy_llm, backend, observer=recorder)
    front.recorder = recorder
    yield front
    front.shutdown()


def wait_idle(front: CoreClient) -> None:
    t0 = time.monotonic()
    while not (front.gauges is not None and front.gauges.idle) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert front.gauges.idle


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_streams_equal_the_offline_result(front, toy_llm):
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3]]
    expected = [
        toy_llm.generate([p], greedy(12), use_tqdm=False)[0].outputs[0].token_ids for p in prompts
    ]

    async def one(p):
        ids, text, updates = [], "", 0
        async for u in front.generate(Submission(greedy(12), p)):
            updates += 1
            for d in u.deltas:
                ids += d.token_ids
                text += d.text
        return ids, updates

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    got = asyncio.run(main())
    assert [ids for ids, _ in got] == expected
    assert all(updates == 12 for _, updates in got)  # one update per step with a token
    rec = front.recorder
    assert len(rec.finished) == 3 and rec.steps > 0
    m = rec.finished[0]
    assert m.generation_tokens == 12 and 0 <= m.queue_time <= m.ttft <= m.e2e
    assert m.tpot is not None and m.tpot > 0


def test_cancel_frees_blocks_and_others_carry_on(front):
    async def main():
        long = await front.submit(Submission(greedy(10_000), [1, 2, 3]))
        short = front.generate(Submission(greedy(8), [4, 5]))
        async for _ in long:
            break  # leave after the first update: the request is cancelled
        await long.aclose()
        tokens = [t async for u in short for d in u.deltas for t in d.token_ids]
        return tokens

    assert len(asyncio.run(main())) == 8
    wait_idle(front)  # the abort freed its blocks, and the gauges say so
    if front.backend == "thread":
        front.engine.blocks.check()


def test_refusals_and_deadlines(front):
    async def main():
        with pytest.raises(ValueError, match="vocabulary"):
            await front.submit(Submission(greedy(4), [10**9]))
        # two running, three waiting, the sixth is refused
        streams = [await front.submit(Submission(greedy(10_000), [i + 1])) for i in range(2)]
        while front.gauges is None or front.gauges.running < 2:
            await asyncio.sleep(0.01)
        streams += [await front.submit(Submission(greedy(10_000), [i + 1])) for i in range(3)]
        with pytest.raises(QueueFullError):
            await front.submit(Submission(greedy(4), [1]))
        for s in streams:
            await s.aclose()
        with pytest.raises(DeadlineExceededError):
            late = Submission(greedy(10_000), [7], deadline=time.monotonic() + 0.2)
            async for _ in front.generate(late):
                pass
        return [
            t
            async for u in front.generate(Submission(greedy(3), [9]))
            for d in u.deltas
            for t in d.token_ids
        ]

    assert len(asyncio.run(main())) == 3
    wait_idle(front)


def test_shutdown_ends_the_streams_in_flight(front):
    """shutdown() with requests in flight: each stream ends with EngineNotRunningError, and
    later submits are refused the same way."""

    async def main():
        streams = [await front.submit(Submission(greedy(10_000), [i + 1])) for i in range(2)]
        await asyncio.to_thread(front.shutdown)
        for s in streams:
            with pytest.raises(EngineNotRunningError, match="shutting down"):
                async for _ in s:
                    pass
        with pytest.raises(EngineNotRunningError):
            await front.submit(Submission(greedy(4), [1]))

    asyncio.run(main())
    assert not front.is_running


@pytest.mark.parametrize("fault", ["forward", "scheduling"])
def test_a_step_that_raises_fails_its_requests_once_and_the_loop_goes_on(front, fault):
    """A forward pass that raises fails the requests it ran; scheduling that raises (before
    any request is touched) fails every request in flight; either way once, and the next
    request is served."""
    seed = faults.FORWARD_SEED if fault == "forward" else faults.SCHEDULE_SEED

    async def main():
        streams = [await front.submit(Submission(greedy(10_000), [3]))]
        streams.append(await front.submit(Submission(greedy(10_000, seed=seed), [8])))
        for stream in streams:
            with pytest.raises(RequestFailedError, match=f"injected {fault} fault"):
                async for _ in stream:
                    pass
        return [
            t
            async for u in front.generate(Submission(greedy(3), [9]))
            for d in u.deltas
            for t in d.token_ids
        ]

    assert len(asyncio.run(main())) == 3
    wait_idle(front)


def test_a_reader_that_falls_behind_is_cut_off_and_its_blocks_freed(toy_llm):
    """A stream nobody reads holds at most max_backlog undelivered tokens: then its
    request is cancelled (blocks back in the pool) and the stream ends with the reason,
    while a stream read as it comes finishes."""
    config = EngineConfig(model="toy", dtype="float32", max_num_seqs=4)
    front = toy_front(toy_llm, "thread", config, max_backlog=8)
    engine = front.engine

    async def main():
        ignored = await front.submit(Submission(greedy(400), [5, 6, 7]))
        read = [u async for u in front.generate(Submission(greedy(60), [8, 9]))]
        while engine.requests:
            await asyncio.sleep(0.01)
        got = 0
        with pytest.raises(ReaderTooSlowError, match="too slowly"):
            async for u in ignored:
                got += sum(len(d.token_ids) for d in u.deltas)
        return read, got

    try:
        read, got = asyncio.run(main())
    finally:
        front.shutdown()
    assert sum(len(d.token_ids) for u in read for d in u.deltas) == 60
    assert 8 < got < 400
    assert engine.blocks.usage == 0
    engine.blocks.check()


def test_a_request_whose_sampling_raises_fails_alone(toy_llm, backend):
    """Sampling that raises for one request (here: an injected fault for SAMPLING_SEED) fails
    that request only; the other requests of the same steps run to the end."""
    config = EngineConfig(model="toy", dtype="float32", max_num_seqs=9)
    front = toy_front(toy_llm, backend, config)

    async def one(seed, prompt):
        params = SamplingParams(max_tokens=20, temperature=0.8, seed=seed, ignore_eos=True)
        try:
            return sum(
                len(d.token_ids)
                for u in [u async for u in front.generate(Submission(params, prompt))]
                for d in u.deltas
            )
        except RequestFailedError as e:
            return str(e)

    async def main():
        return await asyncio.gather(
            *(one(faults.SAMPLING_SEED if i == 3 else i, [5 + i, 6]) for i in range(9))
        )

    try:
        got = asyncio.run(main())
        wait_idle(front)
    finally:
        front.shutdown()
    assert "injected sampling fault" in got[3]
    assert got[:3] + got[4:] == [20] * 8


def test_max_waiting_zero_takes_bursts_into_free_slots(toy_llm):
    """max_waiting bounds requests waiting for a running slot: with 0, an engine with its
    warm-up on starts, and a burst no bigger than the free slots is taken whole."""
    engine = LLMEngine(
        EngineConfig(model="toy", dtype="float32", max_num_seqs=8, max_waiting=0, warmup=True),
        toy_llm.engine.loaded,
    )
    for i in range(8):
        engine.add_request(prompt_token_ids=[5, i + 1], params=greedy(3))
    with pytest.raises(QueueFullError):
        engine.add_request(prompt_token_ids=[5, 6], params=greedy(3))
    while engine.has_unfinished():
        engine.step()
