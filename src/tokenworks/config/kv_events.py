"""KV-cache events' options: one JSON value on the command line, in vLLM's shape
(--kv-events-config), read by engine/kv_events.py."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass

from tokenworks.config.json_values import json_arg, json_object

PUBLISHERS = ("null", "zmq")
EXAMPLE = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}'


@dataclass(frozen=True)
class KVEventsConfig:
    """Every block the prefix cache stores or removes, published as vLLM publishes it:
    msgpack batches on a ZeroMQ PUB socket, (topic, 8-byte sequence number, payload), and
    the batches kept for a replay socket."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # zmq or null (default: zmq where events are enabled)
    endpoint: str = "tcp://127.0.0.1:5557"  # the PUB socket binds here
    replay_endpoint: str | None = None  # a ROUTER socket answering replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    # vLLM's queue of batches waiting to be sent, accepted as its configs give it: here a
    # batch goes out as its step ends
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value) -> KVEventsConfig:
        """From a JSON string (the command line), a dict (the Python API) or itself."""
        value = json_object(value, cls, "kv_events_config", EXAMPLE)
        return value if isinstance(value, cls) else cls(**value)

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config publisher {self.publisher!r}: expected zmq or null")
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config {name} {address!r}: expected a ZeroMQ address such "
                    "as tcp://127.0.0.1:5557"
                )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config {name} must be >= 1")

    def for_replica(self, i: int) -> KVEventsConfig:
        """Replica i's: its tcp ports past replica i - 1's, as many as they span, so that no
        two engines share an address (5557 and 5558 give 5559 and 5560 to the second)."""
        ports = [int(m.group(1)) for a in (self.endpoint, self.replay_endpoint)
                 if a and a.startswith("tcp://") and (m := re.search(r":(\d+)$", a))]  # fmt: skip
        stride = max(ports) - min(ports) + 1 if ports else 0

        def shifted(address: str | None) -> str | None:
            if address is None or not address.startswith("tcp://"):
                return address
            return re.sub(r":(\d+)$", lambda m: f":{int(m.group(1)) + i * stride}", address)

        return dataclasses.replace(
            self, endpoint=shifted(self.endpoint), replay_endpoint=shifted(self.replay_endpoint)
        )

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def __str__(self) -> str:
        return json.dumps(asdict(self))


kv_events_arg = json_arg(KVEventsConfig.parse)  # --kv-events-config's parser
