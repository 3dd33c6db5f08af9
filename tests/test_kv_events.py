"""KV-cache events (--kv-events-config, engine/kv_events.py) in vLLM's format, and the
index rebuilt from them alone (front/kv_index.py): after random traffic with evictions,
the host tier and a restart, it holds exactly the blocks the engine holds; a batch the
subscriber never got comes back through the replay socket."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from tokenworks import LLM, SamplingParams
from tokenworks.bench.peer_engines import free_port
from tokenworks.engine.kv_budget import GiB
from tokenworks.engine.kv_events import DECODER, HOST, AllBlocksCleared, BlockStored
from tokenworks.front.kv_index import KVIndex

ONE = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def events_config() -> dict:
    return {"enable_kv_cache_events": True, "endpoint": free_address(),
            "replay_endpoint": free_address()}  # fmt: skip


def small_llm(toy_llm, config: dict, blocks: int = 12, offload_gib: float = 0.0001) -> LLM:
    return LLM("toy", dtype="float32", loaded=toy_llm.engine.loaded, warmup=False,
               kv_cache_memory=blocks * toy_llm.engine.block_bytes / GiB,
               kv_offload_gib=offload_gib, kv_events_config=config)  # fmt: skip


def engine_holds(engine) -> dict[bytes, set[str]]:
    """What the engine's prefix cache and host tier hold, by block hash and medium."""
    held = {h: {"CPU"} for h in engine.blocks.prefix.by_hash}
    for key in engine.blocks.host.store if engine.blocks.host is not None else ():
        held.setdefault(key, set()).add(HOST)
    return held


def catch_up(index: KVIndex, engine) -> None:
    """Until the index has applied the engine's last batch."""
    last = engine.kv_events.publisher.seq - 1
    deadline = time.monotonic() + 20
    while index.last_seq != last and time.monotonic() < deadline:
        index.poll(50)
    assert index.last_seq == last


def joined(index: KVIndex) -> None:
    """Until the index's subscription has reached the engine: a PUB socket drops what it
    sends before then, and a first batch lost so has no later one to reveal the gap."""
    deadline = time.monotonic() + 20
    while not index.monitor.poll(50):
        assert time.monotonic() < deadline, "the index never connected"
    assert recv_monitor_message(index.monitor)["event"] == zmq.EVENT_CONNECTED
    time.sleep(0.3)  # the handshake and the subscription, after the connection


@pytest.fixture(scope="module")
def index_and_llm(toy_llm):
    config = events_config()
    llm = small_llm(toy_llm, config)
    index = KVIndex(config["endpoint"], config["replay_endpoint"])
    yield index, llm, config
    index.close()


prompts = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 70), st.integers(0, 4)), min_size=1, max_size=6
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=prompts)
def test_the_index_holds_exactly_the_engines_blocks_after_any_traffic(index_and_llm, batch):
    """Prompts share one of four prefixes and differ after it; the pool holds 12 blocks, so
    blocks are evicted to the host tier, dropped from it and copied back."""
    index, llm, _ = index_and_llm
    ids = [[10 + 7 * p + i % 5 for i in range(48)] + [100 + n] * tail + [3] * n
           for p, n, tail in batch]  # fmt: skip
    llm.generate(ids, ONE, use_tqdm=False)
    catch_up(index, llm.engine)
    assert index.blocks == engine_holds(llm.engine)


def test_evictions_the_host_tier_and_copies_back_are_all_seen(toy_llm):
    """One run through every move: pool blocks evicted to the host tier, dropped from it
    past its budget, and copied back to the pool on a hit."""
    config = events_config()
    llm = small_llm(toy_llm, config)
    index = KVIndex(config["endpoint"], config["replay_endpoint"])
    try:
        first = [30 + i % 11 for i in range(64)]
        for i in range(3):  # 8 full blocks each, in a pool of 12 and a tier of 13
            llm.generate([[60 + i] * 130], ONE, use_tqdm=False)
        llm.generate([first + [1]], ONE, use_tqdm=False)
        llm.generate([[70] * 130], ONE, use_tqdm=False)  # first's oldest block to the tier
        [again] = llm.generate([first + [2]], ONE, use_tqdm=False)
        catch_up(index, llm.engine)
        blocks = llm.engine.blocks
        assert blocks.prefix.evictions and blocks.host.dropped and blocks.host.restored
        assert again.num_cached_tokens == 64
        assert index.blocks == engine_holds(llm.engine)
        assert {m for media in index.blocks.values() for m in media} == {"CPU", HOST}
    finally:
        index.close()
        llm.engine.close()


def test_a_dropped_batch_comes_back_through_replay_and_a_restart_clears(toy_llm):
    config = events_config()
    llm = small_llm(toy_llm, config)
    index = KVIndex(config["endpoint"], config["replay_endpoint"])
    joined(index)
    try:
        base = [20 + i % 9 for i in range(40)]
        llm.generate([base + [1]], ONE, use_tqdm=False)
        catch_up(index, llm.engine)
        # the next batch is received and thrown away, as a socket past its high-water mark
        # drops it: the one after it shows the gap, and the replay socket fills it
        llm.generate([base + [2] * 20], ONE, use_tqdm=False)
        deadline = time.monotonic() + 20
        while not index.sub.poll(50) and time.monotonic() < deadline:
            pass
        _, seq, payload = index.sub.recv_multipart()
        assert int.from_bytes(seq, "big") == index.last_seq + 1
        assert any(isinstance(e, BlockStored) for e in DECODER.decode(payload).events)
        llm.generate([base + [3] * 20], ONE, use_tqdm=False)
        catch_up(index, llm.engine)
        assert index.replayed >= 1 and index.lost == 0
        assert index.blocks == engine_holds(llm.engine)

        llm.engine.close()  # a new engine on the same sockets: it starts by clearing
        again = small_llm(toy_llm, config)
        again.generate([[7] * 33], ONE, use_tqdm=False)
        catch_up(index, again.engine)
        assert index.restarts == 1 and index.blocks == engine_holds(again.engine)
        assert not any(h in index.blocks for h in engine_holds(llm.engine))
        again.engine.close()
    finally:
        index.close()


def test_the_wire_format_is_vllms(toy_llm):
    """Tagged arrays, as vLLM's own example subscriber decodes them; the first batch of an
    engine clears; a stored block names its parent, tokens, size and medium."""
    config = events_config()
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    llm = small_llm(toy_llm, config, offload_gib=0)
    sub.connect(config["endpoint"])
    time.sleep(0.3)  # (a PUB socket drops what it sends before a subscriber has joined)
    try:
        llm.generate([list(range(5, 45))], ONE, use_tqdm=False)
        frames = []
        while sub.poll(2000):
            frames.append(sub.recv_multipart())
            if len(frames) >= 2 or not sub.poll(200):
                break
        raw = [msgspec.msgpack.decode(f[2]) for f in frames]
        events = [e for batch in raw for e in batch[1]]
        assert ["AllBlocksCleared"] == events[0]
        stored = [e for e in events if e[0] == "BlockStored"]
        assert len(stored) == 2  # 40 tokens: two full blocks of 16
        first, second = stored
        assert first[2] is None and second[2] == first[1][0]  # chained by parent hash
        assert first[3] == list(range(5, 21)) and first[4] == 16 and first[6] == "CPU"
        assert isinstance(DECODER.decode(frames[0][2]).events[0], AllBlocksCleared)
    finally:
        sub.close()
        llm.engine.close()


def test_bad_kv_events_configs_say_what_to_fix():
    from tokenworks.config import EngineConfig

    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(kv_events_config={"enable": True})
    with pytest.raises(ValueError, match="ZeroMQ address"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "endpoint": "5557"})
    with pytest.raises(ValueError, match="give ZeroMQ addresses"):
        KVIndex("5557")
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True},
                     enable_prefix_caching=False)  # fmt: skip


def test_the_kv_index_command_follows_an_engine(toy_llm):
    """`tokenworks kv-index` joins late: what was published before it comes through the
    replay socket once the next batch shows the gap."""
    config = events_config()
    llm = small_llm(toy_llm, config)
    llm.generate([[40 + i] * 50 for i in range(3)], ONE, use_tqdm=False)
    command = [sys.executable, "-m", "tokenworks.cli", "kv-index", "--endpoint",
               config["endpoint"], "--replay-endpoint", config["replay_endpoint"],
               "--interval", "0.5", "--seconds", "10", "--json"]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        try:
            first = json.loads(proc.stdout.readline())  # it runs, and has seen nothing yet
            llm.generate([[50] * 40], ONE, use_tqdm=False)
            last = json.loads(proc.stdout.read().strip().splitlines()[-1])
        finally:
            proc.kill()
            llm.engine.close()
    assert first["blocks"] == 0
    held = engine_holds(llm.engine)
    assert last["blocks"] == len(held) and last["by_medium"]["CPU"] == len(held)
    assert last["replayed"] >= 1 and last["lost"] == 0


def test_replicas_publish_on_addresses_of_their_own():
    from tokenworks.config import EngineConfig
    from tokenworks.serve.server import replica_config

    config = EngineConfig(kv_events_config={
        "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5559",
    })  # fmt: skip
    events = [replica_config(config, i).kv_events_config for i in range(3)]
    addresses = [(e.endpoint, e.replay_endpoint) for e in events]
    assert addresses[0] == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559")
    assert len({a for pair in addresses for a in pair}) == 6


def test_the_kv_events_router_sends_a_prefix_to_the_replica_that_holds_it():
    """Two core processes, each publishing its events: a prompt whose prefix one replica
    computed (sent to it directly) goes there; a new prompt goes to the least loaded."""
    import asyncio

    from conftest import wait_for

    from tokenworks.config import EngineConfig
    from tokenworks.engine.prefix_cache import prefix_hashes
    from tokenworks.front.core_client import CoreClient
    from tokenworks.front.interface import Submission
    from tokenworks.front.replicas import ReplicaRouter
    from tokenworks.serve.server import replica_config

    config = EngineConfig(model="toy", dtype="float32", threads=1, kv_cache_memory=0.01,
                          warmup=False, kv_events_config=events_config())  # fmt: skip
    cores = [CoreClient(replica_config(config, i), startup_timeout_s=120) for i in range(2)]
    router = ReplicaRouter(cores, "kv_events")
    router.start()

    def run(front, ids: list[int]) -> None:
        async def go():
            async for _ in front.generate(Submission(ONE, ids)):
                pass

        asyncio.run(go())

    try:
        prefix = [10 + i % 7 for i in range(64)]
        run(cores[1], prefix + [1])
        hashes = prefix_hashes(prefix, 16)
        wait_for(lambda: router.indexes[1].poll(0) >= 0 and router.indexes[1].held(hashes) == 4)
        run(router, prefix + [2])
        assert router.routed == [0, 1]
        run(router, [50] * 64)  # held nowhere: the least loaded, the first
        assert router.routed == [1, 1]
    finally:
        router.shutdown()
