"""Engine cores and worker ranks as Ray actors: `--distributed-executor-backend ray`
(vLLM's name for it).

An actor runs the "module:function" it is handed, so this module imports neither side.
Each replica's core runs engine/core.py's serve_core_json inside one, which Ray places
on any node of the cluster with `threads` CPUs free; it connects back to the API process's
two ZeroMQ sockets over TCP, and everything else (messages, routing, detokenising, death
detection) is what a core process does. RayCore has the part of subprocess.Popen's
interface CoreClient uses, so the client does not care where its core runs.

A worker rank of tensor or pipeline parallelism (engine/rank.py's worker_main) runs its
loop in an actor the same way: it connects to rank 0's step channel, and rank 0 sees it die when
its run returns or fails.

The cluster is the one RAY_ADDRESS names, or else a local one started here. On a one-node
cluster the sockets listen on 127.0.0.1; on several nodes they listen on this node's
address, without authentication, so keep the cluster's network private.
"""

from __future__ import annotations

import logging
import subprocess

import msgspec

from tokenworks.engine.messages import RayNotInstalledError

log = logging.getLogger("tokenworks.engine")

_actor_class = None


def require_ray():
    try:
        import ray
    except ImportError:
        raise RayNotInstalledError(
            "--distributed-executor-backend ray needs Ray: pip install 'tokenworks[ray]' "
            "(or pip install ray), or leave the option out to run engine cores as local "
            "processes"
        ) from None
    return ray


def connect() -> str:
    """Join (or start) the Ray cluster; the address the cores' sockets listen on."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return "127.0.0.1"
    here = ray.util.get_node_ip_address()
    log.warning(
        "engine cores on %d Ray nodes: their sockets listen on %s without authentication",
        len(nodes),
        here,
    )
    return here


def _actor():
    """One actor class for cores and ranks: it runs the "module:function" it is given, so
    this module imports neither (they import it)."""
    global _actor_class
    if _actor_class is None:
        ray = require_ray()

        class EntryActor:
            def run(self, entry: str, label: str, *args) -> int:
                import importlib
                import logging

                logging.basicConfig(
                    level=logging.INFO, format=f"%(levelname)s %(name)s[{label}]: %(message)s"
                )
                module, _, function = entry.partition(":")
                getattr(importlib.import_module(module), function)(*args)
                return 0

        _actor_class = ray.remote(EntryActor)
    return _actor_class


class RayCore:
    """A core in a Ray actor, seen as a process: poll(), wait(), kill()."""

    def __init__(self, entry: str, config, commands: str, outputs: str, init: str | None = None):
        ray = require_ray()
        self._ray = ray
        self.actor = _actor().options(num_cpus=config.threads or 1).remote()
        # the config travels as JSON, as to a core process: Ray pickles arguments
        config_json = msgspec.json.encode(config).decode()
        self.done = self.actor.run.remote(entry, "ray core", config_json, commands, outputs, init)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self._ray.wait([self.done], timeout=0)
            if ready:
                try:
                    self.returncode = self._ray.get(self.done)
                except Exception as e:  # the actor died (killed, out of memory, a crash)
                    log.error("the engine core's Ray actor died: %s", e)
                    self.returncode = -9
                self.kill()  # its CPUs go back to the cluster
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = self._ray.wait([self.done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("ray core", timeout)
        return self.poll()

    def kill(self) -> None:
        self._ray.kill(self.actor)


def start_rank(entry: str, rank: int, channel: str, threads: int | None, gpu: bool) -> tuple:
    """Worker rank `rank` in a Ray actor taking `threads` CPUs (and a GPU of its own on
    CUDA), running `entry` until rank 0 stops it: (the actor, its run's ObjectRef)."""
    actor = _actor().options(num_cpus=threads or 1, num_gpus=1 if gpu else 0).remote()
    return actor, actor.run.remote(entry, "ray rank", rank, channel)


def first_done(actors: list) -> int | None:
    """The index of the first rank actor whose run has ended (returned or died), or None."""
    ray = require_ray()
    done, _ = ray.wait([ref for _, ref in actors], num_returns=1, timeout=0)
    if not done:
        return None
    return [ref for _, ref in actors].index(done[0])


def stop_ranks(actors: list, timeout: float) -> None:
    """Wait up to `timeout` s for the rank actors' runs to end (they were told to stop),
    then kill the actors: their CPUs go back to the cluster."""
    ray = require_ray()
    ray.wait([ref for _, ref in actors], num_returns=len(actors), timeout=timeout)
    for actor, _ in actors:
        ray.kill(actor)
