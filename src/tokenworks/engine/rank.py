"""A worker rank of tensor or pipeline parallelism: its end of rank 0's step channel, the
process group it joins, the part of the model it builds, and its loop.

A worker connects to rank 0's step channel (a ZeroMQ ROUTER; the worker's DEALER is named
by its rank), says hello, and gets the engine's config and the rendezvous; it joins the
process group, reads the model, keeps its part (its pipeline stage's layers, its
tensor-parallel shard of them: models/pipeline.py, models/tensor_parallel.py), makes its
own KV pool of the same blocks, and then runs every step it is sent. It waits for its next
step on the channel, not in a collective, so an idle engine never times out; a worker whose
rank 0 is gone (its end of the channel closed, or silent past the heartbeat) exits.
`worker_main` is the entry of a local process and, named "module:function", of a Ray
actor (engine/ray_cores.py).
"""

from __future__ import annotations

import datetime
import json
import logging

import msgspec
import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenworks.config import EngineConfig
from tokenworks.engine.kv_groups import KVLayout
from tokenworks.engine.kv_pool import KVPool
from tokenworks.engine.runner import ModelRunner, TorchStep
from tokenworks.engine.topology import own_layers, rank_device, rank_threads
from tokenworks.models import tensor_parallel as tp
from tokenworks.models.build import build_model
from tokenworks.models.loader import load
from tokenworks.models.pipeline import PipelineStage, Topology, stage_weights

log = logging.getLogger("tokenworks.engine")

STEP, DISCARD, STOP = b"s", b"d", b"q"  # rank 0 to a worker (and the pool's size, once)
HELLO, READY, ERROR = b"h", b"r", b"e"  # a worker to rank 0
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 10000  # a rank 0 silent this long is gone
ENTRY = "tokenworks.engine.rank:worker_main"  # what a Ray actor runs (engine/ray_cores.py)


class HeadGone(RuntimeError):
    """Rank 0 went away: a worker has nothing left to serve."""


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


def worker_main(rank: int, channel: str) -> None:
    """A worker rank: say hello on rank 0's channel, take the config and the rendezvous,
    join the group, build its part of the model, take the pool's size, say ready, then
    run steps until told to stop; exit 1 if rank 0 goes away instead."""
    link = HeadLink(channel, rank)
    try:
        link.send(HELLO)
        setup = json.loads(link.recv())
        try:
            config = EngineConfig(**setup["config"])
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
