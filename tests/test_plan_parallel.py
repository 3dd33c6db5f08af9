"""plan/parallel.py: the ring collectives' closed forms against a step-by-step ring, a
link fitted back from the times it predicts, and what splitting does on separate and on
shared devices."""

from __future__ import annotations

import pytest

from tokenworks.plan import parallel
from tokenworks.plan.hardware import Hardware
from tokenworks.plan.models import get_model
from tokenworks.plan.quant import parse_scheme

LINK = parallel.Link("test", bandwidth=1e9, latency=1e-5)


def _ring_allreduce(nbytes: float, ranks: int, link) -> float:
    """Reduce-scatter then all-gather around the ring, a step at a time: in each step every
    rank sends one chunk (nbytes / ranks) to its neighbour, all at once."""
    seconds, chunk = 0.0, nbytes / ranks
    for _phase in ("reduce-scatter", "all-gather"):
        for _step in range(ranks - 1):
            seconds += link.latency + chunk / link.bandwidth
    return seconds


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("nbytes", [4, 4096, 1 << 20])
def test_collectives_equal_a_step_by_step_ring(ranks, nbytes):
    assert parallel.allreduce_time(nbytes, ranks, LINK) == pytest.approx(
        _ring_allreduce(nbytes, ranks, LINK)
    )
    gather = (ranks - 1) * (LINK.latency + nbytes / ranks / LINK.bandwidth)
    assert parallel.allgather_time(nbytes, ranks, LINK) == pytest.approx(gather)


def test_a_link_is_fitted_back_from_the_times_it_predicts():
    sizes = [1 << 10, 1 << 16, 1 << 22]
    times = [parallel.allreduce_time(n, 2, LINK) for n in sizes]
    fitted = parallel.fit_link(sizes, times)
    assert fitted.bandwidth == pytest.approx(LINK.bandwidth)
    assert fitted.latency == pytest.approx(LINK.latency)
    with pytest.raises(ValueError, match="two sizes"):
        parallel.fit_link(sizes[:1], times[:1])


def test_splitting_pays_on_separate_devices_with_a_fast_link_and_never_on_a_shared_one():
    model, q = get_model("llama-3-70b"), parse_scheme("bf16")
    gpu = Hardware("gpu", 80 * 2**30, 3.35e12, {"bf16": 989e12})
    one = parallel.split_step(model, gpu, q, LINK, 1, 1)
    tp4 = parallel.split_step(model, gpu, q, parallel.get_link("nvlink4"), 4, 1)
    assert one.speedup == 1.0 and one.messages == 0
    assert tp4.compute_s == pytest.approx(one.compute_s / 4) and tp4.pays
    assert tp4.messages == 2 * model.n_layers + 2
    slow = parallel.split_step(model, gpu, q, parallel.get_link("eth-10g"), 8, 1, batch=64)
    assert not slow.pays
    shared = parallel.split_step(model, gpu, q, LINK, 2, 2, devices="shared")
    assert shared.compute_s == one.compute_s and not shared.pays
    # a pipeline of 4 stages with 4 micro-batches: 7 stage times of a quarter each
    pp = parallel.split_step(model, gpu, q, LINK, 1, 4, batch=4)
    base = parallel.split_step(model, gpu, q, LINK, 1, 1, batch=4)
    assert pp.compute_s == pytest.approx(base.compute_s / 4 / 4 * 7)
    with pytest.raises(ValueError, match="unknown link"):
        parallel.get_link("carrier-pigeon")
