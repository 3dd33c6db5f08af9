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
  twice the least loaded one's load.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from tokenworks.engine.messages import QueueFullError
from tokenworks.engine.prefix_cache import prefix_hashes
from tokenworks.engine.request import SamplingParams
from tokenworks.front.core_client import CoreClient
from tokenworks.front.interface import EngineFront, Submission

POLICIES = ("prefix", "least_loaded", "round_robin")
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
        self.routed = [0] * len(replicas)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        first, *rest = self.replicas
        first.start()
        for r in rest:  # the same model: the server process reads it once
            r.engine = r.engine or first.engine
            r.start()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()

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

    async def submit(self, job: Submission):
        """As EngineFront.submit, on the replica the policy picks; where that one's queue
        is full, on the others from the least loaded (QueueFullError once all are)."""
        first = self.pick(job.prompt_token_ids, job.params, job.cache_salt)
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
