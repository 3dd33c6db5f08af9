"""The Responses API's store: responses by id for previous_response_id and GET
/v1/responses/{id}, bounded in count and age, each visible only to its owner (tenant)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Stored:
    owner: str | None  # the tenant (API key) that made it
    expires: float
    conversation: list[dict]  # chat messages, its own output last (no instructions)
    response: dict


class ResponseStore:
    """Responses by id, at most `capacity`, each kept `ttl_s` seconds."""

    def __init__(self, capacity: int, ttl_s: float):
        self.capacity, self.ttl_s = capacity, ttl_s
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, owner, conversation: list[dict], response: dict) -> None:
        self._expire()
        if self.capacity <= 0:
            return
        self._items[rid] = Stored(owner, time.monotonic() + self.ttl_s, conversation, response)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, owner) -> Stored | None:
        self._expire()
        item = self._items.get(rid)
        return item if item is not None and item.owner == owner else None

    def delete(self, rid: str, owner) -> bool:
        if self.get(rid, owner) is None:
            return False
        del self._items[rid]
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            rid, item = next(iter(self._items.items()))
            if item.expires > now:
                break
            del self._items[rid]
