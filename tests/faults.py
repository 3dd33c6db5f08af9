"""Faults injected into an engine, triggered by a request's seed, so that a test can reach
an engine in a core process of its own: `install` runs there as the core's init hook
(CoreClient(init="faults:install")), or in this process through a monkeypatch.

A request with seed SAMPLING_SEED makes its own sampling raise; FORWARD_SEED, the forward
pass of any batch it is in; SCHEDULE_SEED, scheduling while it waits (before any request
is touched). Every other request runs as usual; the seeds lie far from any a test counts
through, since a server's faults stay installed while the test session shares it."""

from __future__ import annotations

SAMPLING_SEED = 2**62 + 4242
FORWARD_SEED = 2**62 + 4343
SCHEDULE_SEED = 2**62 + 4444


def _seed(owner) -> int | None:
    """A request's seed; None for what carries no request parameters (a drafter's state)."""
    return getattr(getattr(owner, "params", None), "seed", None)


def install(set_attr=setattr) -> None:
    import tokenworks.engine.sampler as sampler_module
    from tokenworks.engine.runner import ModelRunner
    from tokenworks.engine.scheduler import Scheduler

    sample_one, start, schedule = sampler_module.sample_one, ModelRunner.start, Scheduler.schedule

    def poisoned_sample_one(logits, params, *args):
        if params.seed == SAMPLING_SEED:
            raise RuntimeError("injected sampling fault")
        return sample_one(logits, params, *args)

    def poisoned_start(self, batch, *args, **kw):
        if any(_seed(s.seq) == FORWARD_SEED for s in batch):
            raise RuntimeError("injected forward fault")
        return start(self, batch, *args, **kw)

    def poisoned_schedule(self, *args, **kw):
        if any(_seed(s) == SCHEDULE_SEED for s in self.waiting):
            raise RuntimeError("injected scheduling fault")
        return schedule(self, *args, **kw)

    set_attr(sampler_module, "sample_one", poisoned_sample_one)
    set_attr(ModelRunner, "start", poisoned_start)
    set_attr(Scheduler, "schedule", poisoned_schedule)
