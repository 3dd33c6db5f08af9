"""Data-parallel replicas: several engine cores behind one front, a router picking one per
request (vLLM's data parallelism; SGLang's cache-aware router for the prefix policy).

Each replica is an engine core in its own process (front/core_client.py) with its own
threads and KV pool. The router sees each request before it goes anywhere:

- `round_robin`: the next replica in turn;
- `least_loaded`: the replica with the fewest outstanding tokens (prompt + max_tokens of
  its requests in flight);
- `prefix` (the default): the replica that last took a prompt starting with the same
  blocks, so a shared system prompt or an earlier turn is found in that replica's prefix
  cache; the least loaded one when the prompt is new or that replica carries more than
  twice the least loaded one's load;
- `kv_events`: the replica whose prefix cache holds the most of the prompt's leading
  blocks, as its KV events say (engine/kv_events.py, front/kv_index.py: what it holds
  now, evictions included, not what it was last sent), with the same load guard.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from tokenworks.engine.messages import QueueFullError
from tokenworks.engine.prefix_cache import adapter_salt, prefix_hashes
from tokenworks.engine.request import SamplingParams
from tokenworks.front.core_client import CoreClient
from tokenworks.front.interface import EngineFront, Submission
from tokenworks.front.kv_index import KVIndex

POLICIES = ("prefix", "kv_events", "least_loaded", "round_robin")
PREFIX_BLOCKS = 4  # the leading blocks a prompt is known by
REMEMBERED_PREFIXES = 65536


class ReplicaRouter(EngineFront):
    def __init__(self, replicas: list[CoreClient], policy: str = "prefix"):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas, self.policy = replicas, policy
        self._turn = itertools.cycle(range(len(replicas)))
        self._load: dict[str, tuple[int, int]] = {}  # request id -> (replica, tokens)
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()  # leading blocks -> replica
        self.indexes: list[KVIndex] = []  # kv_events: what each replica's cache holds
        self.routed = [0] * len(replicas)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        first, *rest = self.replicas
        first.start()
        for r in rest:  # the same model: the server process reads it once
            r.engine = r.engine or first.engine
            r.start()
        if self.policy == "kv_events":
            self.indexes = [_index_of(r) for r in self.replicas]

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()
        for index in self.indexes:
            index.close()
        self.indexes = []

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    def in_flight(self) -> int:
        return sum(r.in_flight() for r in self.replicas)

    def fail_all(self, why: str) -> None:
        for r in self.replicas:
            r.fail_all(why)

    @property
    def engine(self):
        """What the server needs of the model (every replica serves the same one)."""
        return self.replicas[0].engine

    @property
    def observer(self):
        return self.replicas[0].observer

    def configure(self, observer=None, max_backlog=None, max_stall_s=None) -> None:
        """The server's stream limits for every replica, and its metrics observer: each
        replica reports as its own engine (serve/metrics.py's for_engine) where it can."""
        for i, r in enumerate(self.replicas):
            own = observer.for_engine(i) if hasattr(observer, "for_engine") else observer
            r.configure(own, max_backlog, max_stall_s)

    # ------------------------------------------------------------------ routing

    def loads(self) -> list[int]:
        """Outstanding tokens per replica (requests its core still holds)."""
        out = [0] * len(self.replicas)
        for request_id, (i, tokens) in list(self._load.items()):
            if self.replicas[i].holds(request_id):
                out[i] += tokens
            else:
                del self._load[request_id]
        return out

    def least_loaded(self, indices: range, loads: list[int] | None = None) -> int:
        """Of these replicas, the one with the fewest outstanding tokens."""
        loads = self.loads() if loads is None else loads
        return min(indices, key=loads.__getitem__)

    def pick(self, prompt: list[int], params: SamplingParams, cache_salt: str | None) -> int:
        if self.policy == "round_robin":
            return next(self._turn)
        loads = self.loads()
        least = self.least_loaded(range(len(loads)), loads)
        if self.policy == "least_loaded":
            return least
        block_size = self.engine.admission.block_size
        if self.policy == "kv_events":
            return self._by_events(prompt, cache_salt, loads, least)
        n = min(PREFIX_BLOCKS, (len(prompt) - 1) // block_size)
        if n < 1:
            return least
        key = prefix_hashes(prompt[: n * block_size], block_size, cache_salt)[-1]
        known = self._prefixes.get(key)
        choice = known if known is not None and loads[known] <= 2 * loads[least] + 1 else least
        self._prefixes[key] = choice
        self._prefixes.move_to_end(key)
        if len(self._prefixes) > REMEMBERED_PREFIXES:
            self._prefixes.popitem(last=False)
        return choice

    def _by_events(self, prompt: list[int], salt: str | None, loads, least: int) -> int:
        """The replica holding the most leading blocks of the prompt (the least loaded
        where none holds any, or where that one carries over twice its load)."""
        block_size = self.engine.admission.block_size
        hashes = prefix_hashes(prompt[: (len(prompt) - 1) // block_size * block_size],
                               block_size, salt)  # fmt: skip
        held = []
        for index in self.indexes:
            index.poll(0)
            held.append(index.held(hashes))
        best = max(range(len(held)), key=lambda i: (held[i], -loads[i]))
        return best if held[best] and loads[best] <= 2 * loads[least] + 1 else least

    async def lora(self, action: str, name: str, path: str | None = None) -> None:
        """EngineFront.lora on every replica (each holds its own copy of the adapter)."""
        for replica in self.replicas:
            await replica.lora(action, name, path)

    async def submit(self, job: Submission):
        """As EngineFront.submit, on the replica the policy picks; where that one's queue
        is full, on the others from the least loaded (QueueFullError once all are)."""
        salt = adapter_salt(job.cache_salt, job.lora)  # as the engine will key its blocks
        first = self.pick(job.prompt_token_ids, job.params, salt)
        job = job.named(job.request_id or self.new_request_id())
        loads = self.loads()
        others = sorted((i for i in range(len(self.replicas)) if i != first), key=loads.__getitem__)
        tokens = len(job.prompt_token_ids) + job.params.max_tokens * job.params.n
        order = [first, *others]
        for k, i in enumerate(order):
            self._load[job.request_id] = (i, tokens)
            try:
                stream = await self.replicas[i].submit(job)
            except QueueFullError:
                if k == len(order) - 1:
                    raise
                continue
            self.routed[i] += 1
            return stream
        raise AssertionError("unreachable")

    def abort(self, request_id: str) -> None:
        for r in self.replicas:  # a replica that does not hold it ignores it
            r.abort(request_id)


def _index_of(replica: CoreClient) -> KVIndex:
    """An index of what one replica's prefix cache holds, from its KV events."""
    events = replica.config.kv_events_config if replica.config is not None else None
    if events is None or not events.publishes:
        raise ValueError(
            "the kv_events router follows each replica's KV events: start the server with "
            '--kv-events-config \'{"enable_kv_cache_events": true, "replay_endpoint": ...}\''
        )
    return KVIndex(events.endpoint, events.replay_endpoint, events.topic)
