"""Ray Serve's request router for engine replicas (front/ray_serve.py), routing by the
replicas' KV events: a prompt goes to the replica whose prefix cache holds the most of
its leading blocks now (evictions included), as front/replicas.py's kv_events policy
picks among a server's own replicas.

Each replica says where it publishes its events when it starts (its replica metadata);
the router, which Ray Serve runs in the process that holds the deployment handle (the
API replica), follows each with a KVIndex. Where no replica holds a block of the prompt,
or the one that holds most carries over twice the least loaded one's requests, Ray
Serve's power of two choices decides.
"""

from __future__ import annotations

import logging

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from tokenworks.front.kv_index import KVIndex

log = logging.getLogger("tokenworks.front")


class KVEventsRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self.indexes: dict[object, KVIndex] = {}  # replica id -> what its cache holds

    def _index(self, replica: RunningReplica) -> KVIndex | None:
        index = self.indexes.get(replica.replica_id)
        if index is None:
            meta = replica.replica_metadata
            if "kv_events" not in meta:
                return None
            index = KVIndex(meta["kv_events"], meta.get("kv_replay"), meta.get("kv_topic", ""))
            self.indexes[replica.replica_id] = index
        index.poll(0)
        return index

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for replica_id in [r for r in self.indexes if r not in live]:
            self.indexes.pop(replica_id).close()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        prefix = _prefix_of(pending_request)
        if prefix and candidate_replicas:
            held = {}
            for replica in candidate_replicas:
                index = self._index(replica)
                held[replica.replica_id] = index.held(prefix) if index is not None else 0
            best = max(candidate_replicas, key=lambda r: held[r.replica_id])
            if held[best.replica_id] and not self._overloaded(best, candidate_replicas):
                others = [r for r in candidate_replicas if r is not best]
                return [[best], others] if others else [[best]]  # the others, if it is full
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _overloaded(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        """Does it carry over twice the least loaded one's requests (as last known)?"""
        queued = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) or 0
                  for r in candidates}  # fmt: skip
        return queued[replica.replica_id] > 2 * min(queued.values()) + 1


def _prefix_of(pending_request: PendingRequest | None) -> list[bytes]:
    """The request's leading block hashes, as RayServeFront.submit passed them."""
    if pending_request is None or len(pending_request.args) < 2:
        return []
    prefix = pending_request.args[1]
    return prefix if isinstance(prefix, list) else []
