"""Prefill / decode disaggregation: prefill engines and decode engines apart, behind one
front (`tokenworks serve --disaggregate prefill=P,decode=D`).

A long prompt's prefill is one big step; run beside decoding streams, it stalls every one
of them for its length. Apart, the prefill engines take the prompts and the decode engines
take the streams, and only the prompts' KV blocks move between them.

For each request the router
1. sends the prompt to the least-loaded prefill engine as a prefill-only request (one
   greedy token, which is dropped), asking for its KV blocks;
2. when it ends, has those blocks written to a file in shared memory
   (engine/kv_transfer.py);
3. sends the request itself to the least-loaded decode engine with that file. The decode
   engine reads the blocks into its prefix cache before it adds the request, so the
   request runs only the prompt's tail and then decodes: its first token, and all its
   sampling, happen there, as on a colocated engine;
4. deletes the file once the decode engine has taken it.

A prompt shorter than a block plus one token, a request for prompt logprobs (the whole
prompt must run where they are read) and an embedding go to a decode engine alone. Each
engine is an engine core of its own (front/core_client.py), prefill engines first in
`replicas`: the metrics label them 0 .. P-1 and the decode engines P .. P+D-1, and each
request counts on both.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass

from tokenworks.engine.messages import QueueFullError
from tokenworks.engine.prefix_cache import movable_blocks
from tokenworks.engine.request import SamplingParams
from tokenworks.front.core_client import CoreClient
from tokenworks.front.interface import Submission
from tokenworks.front.replicas import ReplicaRouter

PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@dataclass
class Transfer:
    """One request's handoff from a prefill engine to a decode engine."""

    request_id: str
    blocks: int
    nbytes: int
    write_s: float  # the prefill engine writing the blocks out
    handoff_s: float  # its last update arriving -> the decode engine having read them in


class DisaggregatedRouter(ReplicaRouter):
    def __init__(self, prefill: list[CoreClient], decode: list[CoreClient]):
        if not prefill or not decode:
            raise ValueError("disaggregation needs at least one prefill and one decode engine")
        super().__init__([*prefill, *decode], "least_loaded")
        self.n_prefill = len(prefill)
        self.transfers: deque[Transfer] = deque(maxlen=10000)

    def prefills(self, params: SamplingParams, prompt: list[int]) -> bool:
        """Does this request go through a prefill engine (a full block to move)?"""
        full = movable_blocks(len(prompt), self.engine.admission.block_size)
        return full > 0 and params.prompt_logprobs is None and params.pooling is None

    async def submit(self, job: Submission):
        """As EngineFront.submit: prefilled on a prefill engine (where it pays), then
        accepted by a decode engine, whose stream this is."""
        if job.kv_export or job.kv_import is not None:
            raise ValueError("the disaggregated router moves KV blocks itself: submit without them")
        job = job.named(job.request_id or self.new_request_id())
        request_id, params, prompt = job.request_id, job.params, job.prompt_token_ids
        kv, t0 = None, 0.0
        if self.prefills(params, prompt):
            kv = await self._prefill(job)
            t0 = time.perf_counter()
        try:
            d = self.least_loaded(range(self.n_prefill, len(self.replicas)))
            self._load[request_id] = (d, len(prompt) + params.max_tokens * params.n)
            stream = await self.replicas[d].submit(dataclasses.replace(job, kv_import=kv))
        finally:
            if kv is not None:
                os.unlink(kv.path)
        self.routed[d] += 1
        if kv is not None:
            self.transfers.append(Transfer(request_id, len(kv.hashes), kv.nbytes, kv.seconds,
                                           time.perf_counter() - t0))  # fmt: skip
        return stream

    async def _prefill(self, job: Submission):
        """Run the prompt on the least-loaded prefill engine; its KV blocks (None where
        that engine's queue is full: the decode engine then runs the prompt itself)."""
        p = self.least_loaded(range(self.n_prefill))
        self._load[job.request_id] = (p, len(job.prompt_token_ids))
        try:
            stream = await self.replicas[p].submit(
                dataclasses.replace(job, params=PREFILL_ONLY, kv_export=True)
            )
        except QueueFullError:
            return None
        self.routed[p] += 1
        kv = None
        try:
            async for update in stream:
                kv = update.kv_blocks or kv
        finally:
            await stream.aclose()
        return kv
