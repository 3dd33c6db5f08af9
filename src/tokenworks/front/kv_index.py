"""Which blocks an engine holds, rebuilt from its KV events alone (engine/kv_events.py):
what a router outside the engine keeps to send a prompt where its prefix is cached.

It subscribes to the engine's PUB socket and applies each batch in sequence order. A gap
in the numbers (a batch the socket dropped, or sent before this subscriber joined) is
filled from the replay socket. A number that goes back is a new engine, which starts by
clearing everything; so is the socket connecting again after it lost the engine (a new
engine's first batches go out before a subscriber has joined it): the index is then
rebuilt from the replay socket, from the first batch it kept.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenworks.engine.kv_events import (
    DECODER,
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

log = logging.getLogger("tokenworks.front")

REPLAY_TIMEOUT_MS = 2000


class KVIndex:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.Context | None = None,
    ):
        """endpoint, replay_endpoint: the engine's (its --kv-events-config), to connect to."""
        self.context = context or zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay = None
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            self.sub.connect(endpoint)
            if replay_endpoint is not None:
                self.replay = self.context.socket(zmq.DEALER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.connect(replay_endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(
                f"cannot follow KV events at {endpoint} / {replay_endpoint} "
                f"({e}): give ZeroMQ addresses such as tcp://127.0.0.1:5557"
            ) from e
        self.disconnected = False
        self.blocks: dict[bytes, set[str]] = {}  # block hash -> the media holding it
        self.last_seq = -1
        self.restarts = 0  # new engines seen
        self.replayed = 0  # batches taken from the replay socket
        self.lost = 0  # batches neither received nor replayed

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch waiting, waiting up to timeout_ms for the first; how many."""
        self.watch_connection()
        n = 0
        while self.sub.poll(timeout_ms):
            _, seq, payload = self.sub.recv_multipart()
            self.receive(int.from_bytes(seq, "big"), payload)
            n, timeout_ms = n + 1, 0
        return n

    def watch_connection(self) -> None:
        """Connected again after losing the engine: rebuild from its replay socket."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnected = True
            elif event == zmq.EVENT_CONNECTED and self.disconnected:
                self.disconnected = False
                self.restarts += 1
                self.blocks.clear()
                self.last_seq = -1
                self.catch_up(None)

    def receive(self, seq: int, payload: bytes) -> None:
        """One batch as the PUB socket numbered it."""
        if seq <= self.last_seq:  # numbered from 0 again: a new engine
            self.restarts += 1
            self.last_seq = -1
        if seq > self.last_seq + 1:
            self.catch_up(seq)
        if seq > self.last_seq:
            self.apply(DECODER.decode(payload))
            self.last_seq = seq

    def catch_up(self, seq: int | None) -> None:
        """Batches last_seq + 1 .. seq - 1 (None: every one kept) from the replay socket."""
        first = self.last_seq + 1
        if self.replay is not None:
            self.replay.send_multipart((b"", first.to_bytes(8, "big")))
            while self.replay.poll(REPLAY_TIMEOUT_MS):
                _, s, payload = self.replay.recv_multipart()
                if s == END_SEQ:
                    break
                s = int.from_bytes(s, "big")
                if self.last_seq < s and (seq is None or s < seq):
                    self.apply(DECODER.decode(payload))
                    self.last_seq = s
                    self.replayed += 1
        if seq is not None and self.last_seq < seq - 1:
            self.lost += seq - 1 - self.last_seq
            log.warning("KV events %d to %d are lost: the index may be wrong until the engine "
                        "clears its cache", self.last_seq + 1, seq - 1)  # fmt: skip

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.blocks.setdefault(h, set()).add(event.medium)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    media = self.blocks.get(h)
                    if media is not None:
                        media.discard(event.medium)
                        if not media:
                            del self.blocks[h]
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()

    def held(self, hashes: list[bytes]) -> int:
        """How many of these chained block hashes, from the first, the engine holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close()
        self.sub.close()
        if self.replay is not None:
            self.replay.close()


def watch(options) -> int:
    """`tokenworks kv-index`: follow an engine's events, and every interval print how many
    blocks it holds in each medium (options: cli.py's KVIndexOptions)."""
    index = KVIndex(options.endpoint, options.replay_endpoint, options.topic)
    end = time.monotonic() + options.seconds if options.seconds else None
    try:
        while end is None or time.monotonic() < end:
            until = time.monotonic() + options.interval
            while time.monotonic() < until:
                index.poll(int(max(until - time.monotonic(), 0) * 1000))
            print(summary(index, options.json), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        index.close()
    return 0


def summary(index: KVIndex, as_json: bool) -> str:
    media = Counter(m for held in index.blocks.values() for m in held)
    figures = {
        "seq": index.last_seq, "blocks": len(index.blocks), "by_medium": dict(media),
        "restarts": index.restarts, "replayed": index.replayed, "lost": index.lost,
    }  # fmt: skip
    if as_json:
        return json.dumps(figures)
    by = ", ".join(f"{m} {n}" for m, n in sorted(media.items())) or "none"
    return (f"seq {index.last_seq}: {len(index.blocks)} blocks ({by}); restarts "
            f"{index.restarts}, replayed {index.replayed}, lost {index.lost}")  # fmt: skip
