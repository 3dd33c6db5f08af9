"""Engine replicas as a Ray Serve deployment, and the front the API replica holds of them.

EngineReplica is one replica: an engine core in a thread of its Ray actor, behind the
CoreClient every front uses (detokenising and stop strings there, as in any server). Ray
Serve places, scales and health-checks replicas; a request reaches one through a
deployment handle as core_messages bytes (an AddRequest), and its updates come back as a
stream of the same messages (Accepted or Refused, then Outputs, or Failed), so nothing of
tokenworks travels pickled.

RayServeFront is what the API replica's ServerState holds: an EngineFront whose submit
goes through the handle. It hands each request's leading block hashes to the handle
beside the request, which front/ray_router.py's router reads to send a prompt to the
replica whose prefix cache holds the most of it, as that replica's KV events tell.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import msgspec

from tokenworks.config import EngineConfig
from tokenworks.config.kv_events import KVEventsConfig
from tokenworks.engine import core_messages as m
from tokenworks.engine import ray_cores
from tokenworks.engine.messages import EngineNotRunningError, RequestFailedError
from tokenworks.engine.prefix_cache import adapter_salt, prefix_hashes
from tokenworks.front.core_client import CoreClient
from tokenworks.front.engine_view import REFUSALS, EngineView
from tokenworks.front.interface import EngineFront, Submission
from tokenworks.front.streams import RequestStream, Stream, once_accepted

log = logging.getLogger("tokenworks.front")


def own_kv_events(config: EngineConfig, host: str) -> EngineConfig:
    """The replica's config with KV events on ports the system picks (replicas come and go
    with autoscaling, so none can be given an address ahead); its kv_events_config's other
    settings where one was given."""
    given = config.kv_events_config or KVEventsConfig()
    anywhere = f"tcp://{host}:*"
    events = dataclasses.replace(given, enable_kv_cache_events=True, publisher="zmq",
                                 endpoint=anywhere, replay_endpoint=anywhere)  # fmt: skip
    return dataclasses.replace(config, kv_events_config=events)


class _Finished:
    """The replica's CoreClient observer: each finished request's metrics, until its last
    update carries them to the API replica's /metrics."""

    def __init__(self):
        self.metrics: dict[str, m.RequestMetrics] = {}

    def on_inter_token(self, seconds: float) -> None:
        pass

    def on_step(self, preemptions: int, gauges) -> None:
        pass

    def on_request_finished(self, finished) -> None:
        self.metrics[finished.request_id] = finished


class EngineReplica:
    """One Ray Serve replica of the engine (serve/ray_serve.py deploys it)."""

    def __init__(self, config_json: str, kv_events: bool):
        config = msgspec.json.decode(config_json, type=EngineConfig)
        if kv_events:  # on this node's address where the cluster has several
            config = own_kv_events(config, ray_cores.connect())
        self.config = config
        self.finished = _Finished()
        self.core = CoreClient(config, backend="thread", observer=self.finished)
        self.core.start()

    def record_replica_metadata(self) -> dict:
        """What Ray Serve's router knows of this replica from its start: where its KV
        events are published."""
        events = self.core.engine.kv_events  # (the engine runs in this process)
        if events is None:
            return {}
        publisher = events.publisher
        return {"kv_events": publisher.endpoint, "kv_replay": publisher.replay_endpoint,
                "kv_topic": publisher.topic.decode()}  # fmt: skip

    def ready(self) -> bytes:
        """The core's Ready: what the API replica needs of the model."""
        return m.encode(self.core.ready)

    def check_health(self) -> None:
        if not self.core.is_running:
            raise RuntimeError(f"the engine core is not running ({self.core.died})")

    async def generate(self, add: bytes, prefix: list[bytes] | None = None):
        """One request (an encoded AddRequest; `prefix`, its leading block hashes, is the
        router's): Accepted or Refused, then each update as Outputs, or Failed."""
        job = msgspec.msgpack.decode(add, type=m.AddRequest)
        rid = job.request_id
        try:
            stream = await self.core.submit(Submission(
                job.params, job.prompt_token_ids, rid, job.priority, job.cache_salt,
                lora=job.lora,
            ))  # fmt: skip
        except Exception as e:  # a refusal (bad input, a full queue): the API maps it
            yield m.encode(m.Refused(rid, type(e).__name__, str(e)))
            return
        yield m.encode(m.Accepted(rid))
        try:
            async for update in stream:
                done = self.finished.metrics.pop(rid, None) if update.finished else None
                finished = [done] if done is not None else []
                yield m.encode(m.Outputs([update], self.core.gauges, finished=finished))
        except Exception as e:
            yield m.encode(m.Failed(rid, str(e)))
        finally:
            await stream.aclose()

    def __del__(self):
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()


class RayServeFront(EngineFront):
    """The engine replicas of a Ray Serve deployment, through its handle, as one front."""

    def __init__(self, handle, config: EngineConfig):
        self.handle, self.config = handle, config
        self.engine: EngineView | None = None
        self.observer = None
        self.max_backlog = self.max_stall_s = None
        self._running: dict[str, tuple[asyncio.Task, object, Stream]] = {}

    async def connect(self) -> None:
        """Read what the API needs of the model from one replica's Ready."""
        ready = m.decode_from_core(await self.handle.ready.remote())
        self.engine = EngineView.build(self.config, ready)

    def start(self) -> None:  # Ray Serve starts and stops the replicas
        pass

    def shutdown(self) -> None:
        self.fail_all("the server is shutting down")

    def configure(self, observer=None, max_backlog=None, max_stall_s=None) -> None:
        self.observer, self.max_backlog, self.max_stall_s = observer, max_backlog, max_stall_s

    @property
    def is_running(self) -> bool:
        return self.engine is not None

    def in_flight(self) -> int:
        return len(self._running)

    def fail_all(self, why: str) -> None:
        for request_id, (_, _, stream) in list(self._running.items()):
            self.abort(request_id)
            stream.queue.put_nowait(EngineNotRunningError(why))  # its reader ends with it

    async def submit(self, job: Submission) -> RequestStream:
        if job.kv_export or job.kv_import is not None:
            raise ValueError("kv_export and kv_import need a core client's own process")
        if self.engine is None:
            raise EngineNotRunningError("the engine replicas are not connected yet")
        rid = job.request_id or self.new_request_id()
        block = self.engine.admission.block_size
        prompt = job.prompt_token_ids
        prefix = prefix_hashes(prompt[: (len(prompt) - 1) // block * block], block,
                               adapter_salt(job.cache_salt, job.lora))  # fmt: skip
        add = m.AddRequest(rid, list(prompt), job.params, job.priority, job.cache_salt,
                           lora=job.lora)  # fmt: skip
        replies = self.handle.options(stream=True).generate.remote(m.encode(add), prefix)
        stream = Stream(rid, asyncio.get_running_loop(), asyncio.Queue(), None)
        task = asyncio.create_task(self._pump(replies, stream))
        self._running[rid] = (task, replies, stream)
        return await once_accepted(stream, self.abort, job.deadline)

    async def _pump(self, replies, stream: Stream) -> None:
        """The replica's replies onto the request's stream."""
        rid = stream.request_id
        try:
            async for data in replies:
                reply = m.decode_from_core(data)
                if isinstance(reply, m.Accepted):
                    stream.queue.put_nowait(None)
                elif isinstance(reply, m.Refused):
                    stream.queue.put_nowait(REFUSALS.get(reply.error, ValueError)(reply.message))
                elif isinstance(reply, m.Failed):
                    stream.queue.put_nowait(RequestFailedError(reply.message))
                else:
                    for finished in reply.finished:
                        if self.observer is not None:
                            self.observer.on_request_finished(finished)
                    for update in reply.updates:
                        stream.queue.put_nowait(update)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the replica died, or Ray could not reach it
            log.error("request %s: the engine replica failed: %s", rid, e)
            stream.queue.put_nowait(RequestFailedError(f"the engine replica failed: {e}"))
        finally:
            self._running.pop(rid, None)

    def abort(self, request_id: str) -> None:
        task, replies, _ = self._running.pop(request_id, (None, None, None))
        if task is not None:
            replies.cancel()  # the replica's generator is cancelled, its request aborted
            task.cancel()
