"""The worker ranks under one engine: tensor and pipeline parallelism.

Rank 0 is the engine's own process: it schedules, samples and holds the first part of the
model. Ranks 1 .. world-1 run elsewhere: processes rank 0 spawns (mp), Ray actors (ray),
or, with --nnodes, processes on other machines that `run_node` starts there. Each
connects to rank 0's step channel (a ZeroMQ ROUTER; the worker's DEALER is named by its
rank), says hello, and gets the engine's config and the rendezvous; it joins the process
group, reads the model, keeps its part (its pipeline stage's layers, its tensor-parallel
shard of them: models/pipeline.py, models/tensor_parallel.py), makes its own KV pool of
the same blocks, and then runs every step it is sent. A step travels as the runner's
TorchStep (msgpack, no pickle); every rank runs the same forward on the same batch, and
the collectives and sends inside it (torch.distributed: gloo on the CPU, NCCL on CUDA)
join them. The block tables are rank 0's alone: every pool is laid out the same, so a
block number means the same slots on every rank.

A worker waits for its next step on the channel, not in a collective, so an idle engine
never times out. A worker that dies is seen at the next step (its process or actor has
exited, or its end of the channel is gone) or inside one (the collective fails, within
--distributed-timeout): the step fails its requests, and every later step fails at once
with the same reason. A worker whose rank 0 is gone (its end of the channel closed, or
silent past the heartbeat) exits.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import multiprocessing
import os
import signal
import socket
import time

import msgspec
import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenworks.engine.kv_groups import KVLayout
from tokenworks.engine.runner import ModelRunner, TorchStep
from tokenworks.models import tensor_parallel as tp
from tokenworks.models.build import build_model
from tokenworks.models.pipeline import PipelineStage, Topology, stage_layers, stage_weights

log = logging.getLogger("tokenworks.engine")

STEP, DISCARD, STOP = b"s", b"d", b"q"  # rank 0 to a worker (and the pool's size, once)
HELLO, READY, ERROR = b"h", b"r", b"e"  # a worker to rank 0
STARTUP_S = 3600.0  # how long rank 0 waits for a worker to come and to build its part
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 10000  # a rank 0 silent this long is gone


class WorkerFailed(RuntimeError):
    """A worker rank died or failed; the engine cannot run another step."""


class HeadGone(RuntimeError):
    """Rank 0 went away: a worker has nothing left to serve."""


def rank_device(config, rank: int) -> str:
    """Rank r's device: the config's on the CPU; on CUDA one GPU a rank, numbered within
    its node (a Ray actor sees only the GPU Ray gave it)."""
    if config.device == "cpu":
        return config.device
    if config.distributed_executor_backend == "ray" and rank > 0:
        return "cuda:0"
    return f"cuda:{rank % ranks_per_node(config)}"


def world_size(config) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def ranks_per_node(config) -> int:
    return world_size(config) // config.nnodes


def rank_threads(config) -> int | None:
    """CPU threads each rank takes: the config's, or the cores shared out between ranks."""
    if config.threads is not None or world_size(config) == 1:
        return config.threads
    return max(1, (os.cpu_count() or 1) // world_size(config))


def own_layers(spec, config, rank: int) -> range | None:
    """The layers rank `rank` holds, and keeps KV for: its pipeline stage's (None: all)."""
    pp = config.pipeline_parallel_size
    return stage_layers(spec.n_layers, pp)[rank // config.tensor_parallel_size] if pp > 1 else None


def block_bytes_of(spec, config, layout: KVLayout, kv_bytes_per_token: int) -> int:
    """Bytes of one block on the rank that holds the most of them: every rank's pool has
    the same blocks, over its own stage's layers."""
    stages = range(0, world_size(config), config.tensor_parallel_size)
    return max(layout.bytes_per_block(kv_bytes_per_token, config.block_size,
                                      own_layers(spec, config, r)) for r in stages)  # fmt: skip


def check_split(spec, config) -> None:
    """Raise, saying what to change, where the model cannot be split as configured (before
    any worker is started)."""
    if config.tensor_parallel_size > 1:
        tp.check_divisible(spec, config.tensor_parallel_size)
    if config.pipeline_parallel_size > 1:
        if spec.arch == "gpt2" or spec.mla is not None:
            raise ValueError(
                f"pipeline parallelism runs Llama-shaped models; {spec.arch} is not one"
            )
        stage_layers(spec.n_layers, config.pipeline_parallel_size)


def join(config, rank: int, address: str) -> Topology:
    """Join the ranks' process group (and each pipeline stage's tensor-parallel group:
    every rank makes every group, in the same order, as torch.distributed asks)."""
    tensor, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    dist.init_process_group(
        "gloo" if config.device == "cpu" else "nccl",
        init_method=address,
        rank=rank,
        world_size=tensor * stages,
        timeout=datetime.timedelta(seconds=config.distributed_timeout),
    )
    groups = [dist.new_group(list(range(s * tensor, (s + 1) * tensor))) if tensor > 1 else None
              for s in range(stages)]  # fmt: skip
    return Topology(rank, tensor, stages, groups[rank // tensor])


def build_rank_model(config, loaded, quantization, topology: Topology | None = None):
    """(the model this rank runs, its spec): the whole model; or its pipeline stage's
    layers, split over the stage's tensor-parallel ranks and wrapped with the collectives
    (models/tensor_parallel.py, models/pipeline.py)."""
    top = topology or Topology(0)
    spec, weights = loaded.spec, loaded.weights
    layers = own_layers(spec, config, top.rank)
    if layers is not None:
        weights = stage_weights(weights, layers)
    shard = tp.Shard(top.tp_rank, top.tp, top.tp_group)
    if top.tp > 1:
        spec = tp.shard_spec(loaded.spec, top.tp, top.tp_rank)
        weights = tp.shard_weights(weights, loaded.spec, shard)
    model = build_model(
        spec,
        weights,
        config.torch_dtype,
        rank_device(config, top.rank),
        quantization,
        False,  # torch's invariant tiles only where the C kernels cannot: engine._open_kernels
        config.dense_from_rows,
        config.moe_strategy,
        config.moe_capacity_factor,
        config.attention_tile,
        layers,
        config.repack,
    )
    if top.tp > 1:
        tp.parallelize_(model, loaded.spec, shard)
    if top.pp > 1:
        model = PipelineStage(model, top, loaded.spec.vocab_size)
    return model, spec


def comms_of(model) -> list:
    """The message counters of this rank's part of the model (models.tensor_parallel
    Comms): its tensor-parallel group's, and its pipeline stage's."""
    found = {id(m.shard.comms): m.shard.comms for m in model.modules() if hasattr(m, "shard")}
    if isinstance(model, PipelineStage):
        found[id(model.comms)] = model.comms
    return list(found.values())


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: torch.distributed's TCP store, and rank 0's step channel."""

    host: str
    store_port: int
    channel_port: int

    @classmethod
    def of(cls, config, host: str = "127.0.0.1") -> Rendezvous:
        """--master-addr and --master-port (and the port after) across nodes; on one
        node, two free ports on `host`."""
        if config.nnodes > 1:
            return cls(config.master_addr, config.master_port, config.master_port + 1)
        return cls(host, _free_port(host), _free_port(host))

    @property
    def store(self) -> str:
        return f"tcp://{self.host}:{self.store_port}"

    @property
    def channel(self) -> str:
        return f"tcp://{self.host}:{self.channel_port}"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HeadLink:
    """A worker's end of the step channel: a DEALER named by its rank, with heartbeats,
    and a monitor that sees rank 0's end go (closed, or silent past the heartbeat)."""

    def __init__(self, channel: str, rank: int):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, str(rank).encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(channel)
        self.connected = False
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def recv(self) -> bytes:
        """The next message from rank 0, waiting as long as it takes (before rank 0 has
        come, too); HeadGone once its end has gone."""
        while True:
            ready = dict(self.poller.poll())
            if self.sock in ready:  # (what rank 0 sent before it went comes first)
                return self.sock.recv()
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                raise HeadGone("rank 0 is gone")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.context.term()


def _worker_main(rank: int, channel: str) -> None:
    """A worker rank: say hello on rank 0's channel, take the config and the rendezvous,
    join the group, build its part of the model, take the pool's size, say ready, then
    run steps until told to stop; exit 1 if rank 0 goes away instead."""
    from tokenworks.config import EngineConfig
    from tokenworks.engine.kv_cache import KVPool
    from tokenworks.models.loader import load

    link = HeadLink(channel, rank)
    try:
        link.send(HELLO)
        setup = json.loads(link.recv())
        try:
            config = EngineConfig.build(**setup["config"])
            if rank_threads(config):
                torch.set_num_threads(rank_threads(config))
            topology = join(config, rank, setup["store"])
            loaded = load(config.model, keep_index=False)
            quantization = config.resolved_quantization(loaded.gguf_index is not None)
            model, spec = build_rank_model(config, loaded, quantization, topology)
            del loaded
            num_blocks = int(link.recv())
            layout = KVLayout.for_spec(spec, config.sliding_window_kv == "free")
            device, bs = rank_device(config, rank), config.block_size
            pool = KVPool.for_spec(spec, num_blocks, bs, config.torch_dtype, device, layout,
                                   own_layers(spec, config, rank),
                                   config.kv_cache_dtype)  # fmt: skip
            runner = ModelRunner(model, pool, bs, device)  # (rank 0 cuts the micro-batches)
        except HeadGone:
            raise
        except Exception as e:  # said to rank 0, which refuses to start with it
            link.send(ERROR + f"{type(e).__name__}: {e}".encode())
            raise
        link.send(READY)
        while True:
            data = link.recv()
            kind, body = data[:1], data[1:]
            if kind == STOP:
                break
            if kind == DISCARD:
                pool.discard()
                continue
            runner.execute(msgspec.msgpack.decode(body, type=TorchStep))
    except HeadGone:
        log.error("rank %d: rank 0 is gone (%s); exiting", rank, channel)
        raise SystemExit(1) from None
    finally:
        link.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(procs: list, ranks: range, channel: str, daemon: bool) -> None:
    """Start a process for each of these worker ranks, reaching rank 0 at `channel`, each
    added to `procs` as it starts (so a failure midway leaves none unaccounted for)."""
    ctx = multiprocessing.get_context("spawn")
    for rank in ranks:
        p = ctx.Process(target=_worker_main, args=(rank, channel), name=f"tokenworks-rank{rank}",
                        daemon=daemon)  # fmt: skip
        p.start()
        procs.append(p)


@dataclasses.dataclass
class WorkerRanks:
    """Rank 0's side: the step channel, and the workers it started (the rest come from
    other nodes)."""

    sock: zmq.Socket
    ranks: list[int]  # 1 .. world-1
    procs: list = dataclasses.field(default_factory=list)  # local processes (mp)
    actors: list = dataclasses.field(default_factory=list)  # (Ray actor, its run's ref)
    remote: dict = dataclasses.field(default_factory=dict)  # node -> its ranks (--nnodes)
    failed: str | None = None
    stopped: bool = False

    @classmethod
    def start(cls, config) -> tuple[WorkerRanks, Topology]:
        """Open the step channel, start this node's workers (processes or Ray actors),
        give each that comes (other nodes' too) the config, and join the process group
        with them as rank 0; each worker goes on to read the model and build its part
        (ready() waits for that)."""
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed group is already open in this process (another engine "
                "with worker ranks: close() it first)"
            )
        ray = config.distributed_executor_backend == "ray"
        if ray:
            from tokenworks.engine import ray_cores

            rendezvous = Rendezvous.of(config, ray_cores.connect())
        else:
            rendezvous = Rendezvous.of(config)
        context = zmq.Context.instance()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank that is gone raises
        sock.setsockopt(zmq.LINGER, 0)
        # across nodes, every interface (the TCP store listens on them all too)
        where = rendezvous.host if config.nnodes == 1 else "*"
        try:
            sock.bind(f"tcp://{where}:{rendezvous.channel_port}")
        except zmq.ZMQError as e:
            sock.close()
            raise RuntimeError(
                f"the step channel cannot listen on port {rendezvous.channel_port} ({e}): "
                "give --master-port a port whose next one is free"
            ) from None
        workers = cls(sock, list(range(1, world_size(config))))
        per = ranks_per_node(config)
        try:
            if ray:
                threads, gpu = rank_threads(config), config.device != "cpu"
                for rank in workers.ranks:
                    workers.actors.append(
                        ray_cores.start_rank(rank, rendezvous.channel, threads, gpu)
                    )
            else:
                _spawn(workers.procs, range(1, per), rendezvous.channel, daemon=True)
                for node in range(1, config.nnodes):
                    workers.remote[node] = list(range(node * per, (node + 1) * per))
            workers._greet(config, rendezvous)
            topology = join(config, 0, rendezvous.store)
        except BaseException:
            workers.stop()
            raise
        log.info("%d ranks (tensor %d x pipeline %d) over %s", world_size(config),
                 config.tensor_parallel_size, config.pipeline_parallel_size,
                 rendezvous.store)  # fmt: skip
        return workers, topology

    def _greet(self, config, rendezvous: Rendezvous, timeout: float = STARTUP_S) -> None:
        """Wait for every rank's hello, answering each with the config and the store."""
        setup = json.dumps({
            # (a speculative drafter runs on rank 0 alone: the workers never see one)
            "config": config.to_dict() | {"speculative_config": None},
            "store": rendezvous.store,
        }).encode()  # fmt: skip
        waiting = set(self.ranks)

        def say_who():
            for node, ranks in self.remote.items():
                if waiting & set(ranks):
                    log.info(
                        "waiting for node %d (ranks %s): run the same command there with "
                        "--node-rank %d (it reaches this one at %s)",
                        node, ranks, node, rendezvous.channel,
                    )  # fmt: skip

        for rank, data in self._replies(waiting, timeout, "come", every=say_who):
            if data == HELLO:
                self._to(rank, setup)
                waiting.discard(rank)

    def _replies(self, waiting: set, timeout: float, what: str, every=None):
        """(rank, message) as the workers send them, until `waiting` is empty; raises if
        a worker exits or the time runs out first."""
        t0 = last = time.monotonic()
        if every is not None:
            every()
        while waiting:
            self.check()
            now = time.monotonic()
            if now - t0 > timeout:
                raise WorkerFailed(f"ranks {sorted(waiting)} did not {what} in {timeout:.0f} s")
            if every is not None and now - last > 30:
                every()
                last = now
            if self.sock.poll(500):
                ident, data = self.sock.recv_multipart()
                yield int(ident), data

    def ready(self, num_blocks: int, timeout: float = STARTUP_S) -> None:
        """Give every worker the pool's size, and wait until each has built its part; a
        worker that fails to start stops them all, with its error."""
        try:
            self._say(str(num_blocks).encode())
            waiting = set(self.ranks)
            for rank, data in self._replies(waiting, timeout, "start"):
                if data[:1] == ERROR:
                    raise WorkerFailed(f"rank {rank} failed to start: {data[1:].decode()}")
                waiting.discard(rank)
        except BaseException:
            self.stop()
            raise

    def check(self) -> None:
        """Raise if a worker has failed or exited (one on another node shows in its
        collective, or when a step cannot be sent to it)."""
        if self.failed is None:
            for rank, p in enumerate(self.procs, 1):
                if not p.is_alive():
                    self.failed = f"worker rank {rank} exited (code {p.exitcode})"
            if self.actors:
                from tokenworks.engine import ray_cores

                rank = ray_cores.first_done(self.actors)
                if rank is not None:
                    self.failed = f"worker rank {rank + 1}'s Ray actor exited"
        if self.failed is not None:
            raise WorkerFailed(self.failed)

    def send(self, step: TorchStep) -> None:
        self._say(STEP + msgspec.msgpack.encode(step))

    def discard(self) -> None:
        self._say(DISCARD)

    def _to(self, rank: int, data: bytes, flags: int = 0) -> None:
        """Send to one worker (its DEALER is named by its rank)."""
        self.sock.send_multipart([str(rank).encode(), data], flags)

    def _say(self, data: bytes) -> None:
        self.check()
        for rank in self.ranks:
            try:
                self._to(rank, data)
            except zmq.ZMQError as e:
                self.failed = f"worker rank {rank} is gone ({e})"
                raise WorkerFailed(self.failed) from e

    def fail(self, error: BaseException) -> WorkerFailed:
        """A step raised while the ranks ran it: the group is broken from here on (the
        others wait in a collective this rank left); the error to raise for it."""
        if self.failed is None:
            self.failed = f"a step across the worker ranks failed: {error}"
        return WorkerFailed(self.failed)

    def stop(self, timeout: float = 10.0) -> None:
        """Tell every worker to stop, wait for this node's, and leave the group (once: a
        later call, such as the engine's finaliser after close(), does nothing)."""
        if self.stopped:
            return
        self.stopped = True
        for rank in self.ranks:
            try:
                self._to(rank, STOP, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        if self.actors:
            from tokenworks.engine import ray_cores

            ray_cores.stop_ranks(self.actors, timeout)
        self.sock.close(0)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_node(config) -> int:
    """Node k > 0 of --nnodes: run its ranks, which take their config and steps from
    node 0 (started before or after this one), until node 0 stops them; 0 when every
    rank exited cleanly. SIGTERM or SIGINT stops them at once."""
    per = ranks_per_node(config)
    first = config.node_rank * per
    channel = Rendezvous.of(config).channel
    log.info("node %d of %d: ranks %d..%d, taking their steps from %s", config.node_rank,
             config.nnodes, first, first + per - 1, channel)  # fmt: skip

    def stop(sig, frame):
        raise SystemExit(128 + sig)

    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs = []
    try:
        _spawn(procs, range(first, first + per), channel, daemon=False)
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0 if all(p.exitcode == 0 for p in procs) else 1
