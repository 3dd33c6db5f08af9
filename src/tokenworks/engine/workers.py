"""Rank 0's side of tensor and pipeline parallelism: the worker ranks under one engine.

Rank 0 is the engine's own process: it schedules, samples and holds the first part of the
model. Ranks 1 .. world-1 run elsewhere: processes rank 0 spawns (mp), Ray actors (ray),
or, with --nnodes, processes on other machines that `run_node` starts there. Each runs
engine/rank.py's worker_main: it connects to rank 0's step channel, gets the config and
the rendezvous, builds its part of the model and runs every step it is sent. A step
travels as the runner's TorchStep (msgpack, no pickle); every rank runs the same forward on
the same batch, and the collectives and sends inside it (torch.distributed: gloo on the
CPU, NCCL on CUDA) join them. The block tables are rank 0's alone: every pool is laid out
the same, so a block number means the same slots on every rank. How many ranks, and what
each holds, is engine/topology.py's arithmetic.

A worker that dies is seen at the next step (its process or actor has exited, or its end
of the channel is gone) or inside one (the collective fails, within
--distributed-timeout): the step fails its requests, and every later step fails at once
with the same reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import signal
import socket
import time

import msgspec
import torch.distributed as dist
import zmq

from tokenworks.engine import ray_cores
from tokenworks.engine.rank import (
    DISCARD,
    ENTRY,
    ERROR,
    HELLO,
    STEP,
    STOP,
    join,
    worker_main,
)
from tokenworks.engine.runner import TorchStep
from tokenworks.engine.topology import rank_threads, ranks_per_node, world_size
from tokenworks.models.pipeline import Topology

log = logging.getLogger("tokenworks.engine")

STARTUP_S = 3600.0  # how long rank 0 waits for a worker to come and to build its part


class WorkerFailed(RuntimeError):
    """A worker rank died or failed; the engine cannot run another step."""


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


def _spawn(procs: list, ranks: range, channel: str, daemon: bool) -> None:
    """Start a process for each of these worker ranks, reaching rank 0 at `channel`, each
    added to `procs` as it starts (so a failure midway leaves none unaccounted for)."""
    ctx = multiprocessing.get_context("spawn")
    for rank in ranks:
        p = ctx.Process(target=worker_main, args=(rank, channel), name=f"tokenworks-rank{rank}",
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
                        ray_cores.start_rank(ENTRY, rank, rendezvous.channel, threads, gpu)
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
