"""KV-cache events: every block the prefix cache stores or removes, published as vLLM
publishes them, so that a router outside the engine (llm-d, Dynamo, tokenworks' own
`kv-index`) knows which engine holds which prefix without asking it.

Each batch is a msgpack `KVEventBatch` (a timestamp and its events) sent on a ZeroMQ PUB
socket as three frames: the topic, an 8-byte big-endian sequence number, the payload. The
last `buffer_steps` batches are kept; a ROUTER socket at the replay endpoint answers a
request holding a sequence number with every kept batch from it on, each as (sequence,
payload), and then an end marker (sequence -1, an empty payload). A new engine's first
batch starts with AllBlocksCleared at sequence 0.

A block's hash is its prefix-cache key (engine/prefix_cache.py: 32 bytes of sha256 over
its parent's hash, its tokens and the cache salt; two more bytes name a layer group past
the first). Its medium is where it sits: "GPU" or "CPU" for the KV pool on that device,
"HOST" for the host tier (engine/kv_offload.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

log = logging.getLogger("tokenworks.engine")

HOST = "HOST"  # the medium of the host tier's blocks
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One thing a cache did (vLLM's shape: a tagged array)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class KVEventLog:
    """What the caches did since the last take(), as events. A block's parent and tokens
    are remembered while any medium holds it, so that the host tier's copy, or the pool's
    copy restored from it, is stored with them too."""

    def __init__(self, block_size: int, medium: str):
        self.block_size, self.medium = block_size, medium
        self.events: list[KVCacheEvent] = []
        self.meta: dict[bytes, tuple[bytes | None, list[int]]] = {}
        self.held: dict[bytes, set[str]] = {}  # key -> the media holding it
        # keys no medium holds: their meta goes at take(), so that a block moving between
        # media within a step (out of the host tier, into the pool) keeps it
        self.gone: set[bytes] = set()

    def stored(
        self,
        key: bytes,
        parent: bytes | None = None,
        tokens: list[int] | None = None,
        medium: str | None = None,
    ) -> None:
        medium = medium or self.medium
        if tokens is not None:
            self.meta[key] = (parent, list(tokens))
        parent, tokens = self.meta.get(key, (parent, []))
        self.held.setdefault(key, set()).add(medium)
        self.gone.discard(key)
        self.events.append(BlockStored([key], parent, tokens, self.block_size, None, medium))

    def removed(self, key: bytes, medium: str | None = None) -> None:
        medium = medium or self.medium
        media = self.held.get(key)
        if media is not None:
            media.discard(medium)
            if not media:
                del self.held[key]
                self.gone.add(key)
        self.events.append(BlockRemoved([key], medium))

    def cleared(self) -> None:
        """Every medium is empty (a new engine, before its first request)."""
        self.events.clear()
        self.meta.clear()
        self.held.clear()
        self.gone.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        for key in self.gone:
            self.meta.pop(key, None)
        self.gone.clear()
        events, self.events = self.events, []
        return events


def _bind(sock: zmq.Socket, address: str, wait_s: float = 2.0) -> None:
    """Bind, waiting a little for an address an engine that just stopped still holds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                sock.close()
                raise ValueError(
                    f"kv_events_config: cannot bind {address} ({e}); give each engine "
                    "addresses of its own"
                ) from e
            time.sleep(0.05)


class ZmqEventPublisher:
    """Batches out on a PUB socket, numbered without gaps; the last ones kept for replay."""

    def __init__(self, config, context: zmq.Context | None = None):
        """config: a config/kv_events.py KVEventsConfig."""
        self.context = context or zmq.Context.instance()
        self.topic = config.topic.encode()
        self.seq = 0
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.lock = threading.Lock()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        _bind(self.pub, config.endpoint)
        self.replay = None
        self.stopping = threading.Event()
        if config.replay_endpoint is not None:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            try:
                _bind(self.replay, config.replay_endpoint)
            except ValueError:
                self.pub.close()
                raise
            self.thread = threading.Thread(target=self._answer, name="kv-events-replay",
                                           daemon=True)  # fmt: skip
            self.thread.start()
        # the addresses bound (a tcp port given as * is one the system picked)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self.replay.getsockopt_string(zmq.LAST_ENDPOINT) if self.replay else None
        )
        log.info("publishing KV events on %s%s", self.endpoint,
                 f" (replay on {self.replay_endpoint})" if self.replay else "")  # fmt: skip

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        payload = ENCODER.encode(KVEventBatch(time.time(), events))
        seq = self.seq
        self.seq += 1
        with self.lock:
            self.kept.append((seq, payload))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _answer(self) -> None:
        """The replay socket's thread: each request's kept batches, then the end marker."""
        while not self.stopping.is_set():
            if not self.replay.poll(100):
                continue
            frames = self.replay.recv_multipart()
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            with self.lock:
                batches = [(s, p) for s, p in self.kept if s >= start]
            for s, payload in batches:
                self.replay.send_multipart((identity, b"", s.to_bytes(8, "big"), payload))
            self.replay.send_multipart((identity, b"", END_SEQ, b""))

    def close(self) -> None:
        self.stopping.set()
        if self.replay is not None:
            self.thread.join()
            self.replay.close()
        self.pub.close()


class KVEvents:
    """An engine's events: the log its prefix cache and host tier write, and the publisher
    its loop flushes it to after each step (engine/loop.py)."""

    def __init__(self, config, blocks, device: str):
        """config: the KVEventsConfig; blocks: the engine's BlockManager, empty."""
        medium = "GPU" if device.startswith("cuda") else "CPU"
        self.log = KVEventLog(blocks.block_size, medium)
        blocks.prefix.events = self.log
        if blocks.host is not None:
            blocks.host.events = self.log
        self.publisher = ZmqEventPublisher(config)
        self.log.cleared()  # a new engine: whatever a subscriber held of another is gone

    def flush(self) -> None:
        self.publisher.publish(self.log.take())

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def open_kv_events(config, blocks) -> KVEvents | None:
    """The engine's events where its config publishes them (config: its EngineConfig)."""
    events = config.kv_events_config
    if events is None or not events.publishes:
        return None
    return KVEvents(events, blocks, config.device)
