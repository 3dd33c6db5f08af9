"""Lab: a queue in front of a one-at-a-time engine, past its capacity: four admission
policies, a deadline after which an answer is worth nothing, who is turned away, and what
stale estimates cost; on a live engine and on a simulator held to queueing theory.

- theory: `plan.queueing`'s simulators against M/M/1's and Pollaczek-Khinchine's mean
  waits and M/M/1/K's blocking probability;
- the engine: SmolLM2-135M with one sequence at a time, two kinds of request (short: a
  64-token prompt and 16 new tokens; long: 512 and 64, one in five), each timed alone;
- policies: admit every request; a bounded queue (`--max-waiting`); admit every request
  but stop it at its deadline (the request's deadline); turn away a request whose
  predicted end (the work ahead and its own, from the timed service) is past its
  deadline. Each on the simulator at several loads with the timed service, and on the
  live engine (Poisson arrivals, in process) at one overload. Goodput is the share of
  requests answered within the deadline;
- stale estimates: the predicting policy on the simulator with every estimate scaled.

    python labs/admission_policies.py [--load 1.5] [--requests 150] [--deadline 2.0]

Writes an evidence record and a PNG (goodput by policy and load; simulator against live).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.bench.workload import latency_prompt  # noqa: E402
from tokenworks.engine.messages import DeadlineExceededError, QueueFullError  # noqa: E402
from tokenworks.front.core_client import CoreClient  # noqa: E402
from tokenworks.front.interface import Submission  # noqa: E402
from tokenworks.models import load as load_model  # noqa: E402
from tokenworks.plan import queueing  # noqa: E402

KINDS = {"short": (64, 16, 0.8), "long": (512, 64, 0.2)}  # prompt, new tokens, share


def theory(n: int) -> dict:
    """The simulators beside the closed forms, at a few utilisations."""
    out = {}
    for rho in (0.5, 0.8, 0.9):
        sim = queueing.simulate(rho, lambda r: r.expovariate(1.0), n=n, seed=1)
        out[f"mm1_wait_{rho}"] = {"theory": queueing.mm1(rho, 1.0)["mean_wait_s"],
                                  "simulated": sim["mean_wait_s"]}  # fmt: skip
        sim = queueing.simulate(rho, lambda r: 1.0, n=n, seed=2)
        out[f"md1_wait_{rho}"] = {"theory": queueing.mg1(rho, 1.0, 0.0)["mean_wait_s"],
                                  "simulated": sim["mean_wait_s"]}  # fmt: skip
    for rho in (0.5, 0.9, 1.5):
        sim = queueing.admit(rho, [("all", 1.0, lambda r: r.expovariate(1.0))], "bounded_queue",
                             deadline=1e9, n=n, queue=3, seed=3)  # fmt: skip
        out[f"mm1k_blocking_{rho}"] = {"theory": queueing.mm1k_blocking(rho, 1.0, 4),
                                       "simulated": sim["turned_away"]}  # fmt: skip
    for v in out.values():
        v["relative_error"] = abs(v["simulated"] - v["theory"]) / v["theory"]
    return out


def runs_of(lam: float, jobs, policy: str, args, seeds: int = 200, estimate: float = 1.0) -> dict:
    """The simulator's mean over `seeds` runs of `args.requests` arrivals each."""
    runs = [queueing.admit(lam, jobs, policy, args.deadline, n=args.requests, queue=args.queue,
                           estimate=estimate, seed=s) for s in range(seeds)]  # fmt: skip
    return {k: statistics.mean(r[k] for r in runs) for k in ("goodput", "turned_away", "late")}


def request(kind: str, vocab: int, seed: int) -> tuple[list[int], SamplingParams]:
    prompt, new, _ = KINDS[kind]
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return latency_prompt(prompt, vocab, seed=seed), params


async def front_service_times(front, vocab: int, repeats: int) -> dict[str, float]:
    """Each kind's seconds through the engine's front, one request at a time: what a
    request costs the live service, as its operator would measure it."""
    out = {}
    for kind in KINDS:
        times = []
        for i in range(repeats + 1):  # the first, untimed
            ids, params = request(kind, vocab, seed=200 + i)
            t0 = time.monotonic()
            async for _ in front.generate(Submission(params, ids)):
                pass
            times.append(time.monotonic() - t0)
        out[kind] = statistics.median(times[1:])
    return out


def service_times(llm: LLM, repeats: int) -> dict[str, float]:
    """Each kind's seconds alone on the engine (the median of `repeats`)."""
    vocab = llm.engine.spec.vocab_size
    out = {}
    for kind in KINDS:
        times = []
        for i in range(repeats + 1):  # the first, untimed, warms the shapes
            ids, params = request(kind, vocab, seed=100 + i)
            t0 = time.perf_counter()
            llm.generate([ids], params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        out[kind] = statistics.median(times[1:])
    return out


async def live(front, policy: str, lam: float, n: int, deadline: float, service: dict,
               vocab: int, seed: int, estimate: float = 1.0) -> dict:  # fmt: skip
    """One policy on the live engine: n Poisson arrivals at lam, each judged by the
    deadline. predicted_wait keeps the lab's own clock of when the engine will be free,
    each request taken as `estimate` x its measured service."""
    rng = random.Random(seed)
    plan, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(lam)
        kind = rng.choices(list(KINDS), [k[2] for k in KINDS.values()])[0]
        plan.append((t, kind, i))
    free_at = 0.0  # predicted_wait: when the work admitted so far ends, by the estimates
    outcomes = {k: {"arrived": 0, "turned_away": 0, "late": 0, "on_time": 0} for k in KINDS}
    start = time.monotonic()

    async def one(offset: float, kind: str, i: int) -> None:
        nonlocal free_at
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        arrived = time.monotonic()
        outcomes[kind]["arrived"] += 1
        if policy == "predicted_wait":  # the engine may run ahead of the clock: never behind
            end = max(arrived, free_at) + estimate * service[kind]
            if end - arrived > deadline:
                outcomes[kind]["turned_away"] += 1
                return
            free_at = end
        ids, params = request(kind, vocab, seed=seed * 1000 + i)
        stop = arrived + deadline if policy == "stop_at_deadline" else None
        try:
            async for _ in front.generate(Submission(params, ids, deadline=stop)):
                pass
        except QueueFullError:
            outcomes[kind]["turned_away"] += 1
            return
        except DeadlineExceededError:  # the engine stopped the request at its deadline
            outcomes[kind]["late"] += 1
            return
        took = time.monotonic() - arrived
        outcomes[kind]["on_time" if took <= deadline else "late"] += 1

    await asyncio.gather(*(one(*p) for p in plan))
    total = {k: sum(o[k] for o in outcomes.values()) for k in ("arrived", "turned_away",
                                                                   "late", "on_time")}  # fmt: skip
    return {
        "goodput": total["on_time"] / total["arrived"],
        "turned_away": total["turned_away"] / total["arrived"],
        "late": total["late"] / total["arrived"],
        "by_class": {
            k: {f: v / max(o["arrived"], 1) for f, v in o.items() if f != "arrived"}
            for k, o in outcomes.items()
        },  # fmt: skip
        "seconds": time.monotonic() - start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--load", type=float, default=1.5, help="the live runs' offered load")
    ap.add_argument("--loads", default="0.5,0.8,1.2,1.5,2.0", help="the simulator's loads")
    ap.add_argument("--requests", type=int, default=150, help="arrivals of each live run")
    ap.add_argument("--deadline", type=float, default=2.0, help="seconds an answer is worth")
    ap.add_argument("--queue", type=int, default=4, help="the bounded queue's waiting room")
    ap.add_argument("--estimates", default="0.5,0.75,1,1.5,2", help="scales of stale estimates")
    ap.add_argument("--cautious", type=float, default=1.5,
                    help="the estimates' scale of the live cautious run")  # fmt: skip
    ap.add_argument("--sim-requests", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(ap, fast=dict(requests=3, loads="1.5", estimates="1", sim_requests=2000,
                                        repeats=1))  # fmt: skip
    checked = theory(4 * args.sim_requests)
    for name, v in checked.items():
        print(f"{name:22s} theory {v['theory']:.4f}, simulated {v['simulated']:.4f}")

    loaded = load_model(args.model)
    engines = {  # the bounded queue's engine refuses past `queue` waiting; the other, never
        q: LLM(args.model, loaded=loaded, threads=args.threads, max_num_seqs=1,
               max_waiting=size, enable_prefix_caching=False)
        for q, size in (("bounded", args.queue), ("open", 100_000))
    }  # fmt: skip
    llm = engines["open"]
    alone = service_times(llm, args.repeats)
    front = CoreClient(engine=llm.engine)
    front.start()
    try:
        service = asyncio.run(front_service_times(front, llm.engine.spec.vocab_size,
                                                  args.repeats))  # fmt: skip
    finally:
        front.shutdown()
    mean = sum(service[k] * KINDS[k][2] for k in KINDS)
    print(
        "service: "
        + ", ".join(
            f"{k} {s * 1e3:.0f} ms through the front, {alone[k] * 1e3:.0f} alone"
            for k, s in service.items()
        )
    )
    # the estimates an operator would have from the engine alone: stale for the service
    alone_scale = sum(alone[k] * KINDS[k][2] for k in KINDS) / mean
    jobs = [(k, KINDS[k][2], service[k]) for k in KINDS]

    simulated = {}
    for load in [float(x) for x in args.loads.split(",")]:
        simulated[str(load)] = {
            p: queueing.admit(
                load / mean,
                jobs,
                p,
                args.deadline,
                n=args.sim_requests,
                queue=args.queue,
                seed=args.seed,
            )  # fmt: skip
            for p in queueing.POLICIES
        }
    stale = {
        f"{float(e):g}": queueing.admit(args.load / mean, jobs, "predicted_wait", args.deadline,
                                        n=args.sim_requests, estimate=float(e), seed=args.seed)
        for e in args.estimates.split(",")
    }  # fmt: skip
    stale["from_the_engine_alone"] = queueing.admit(
        args.load / mean, jobs, "predicted_wait", args.deadline, n=args.sim_requests,
        estimate=alone_scale, seed=args.seed)  # fmt: skip
    # the live runs' own length: `requests` arrivals from an empty queue, over many seeds
    at_load = {p: runs_of(args.load / mean, jobs, p, args) for p in queueing.POLICIES}

    measured = {}
    # the four policies, and the predicting one again with cautious estimates
    ways = [(p, p, 1.0) for p in queueing.POLICIES]
    ways.append(("predicted_wait_cautious", "predicted_wait", args.cautious))
    at_load["predicted_wait_cautious"] = runs_of(args.load / mean, jobs, "predicted_wait", args,
                                                 estimate=args.cautious)  # fmt: skip
    for p, policy, estimate in tqdm(ways, desc="live policies", unit="policy"):
        engine = engines["bounded" if p == "bounded_queue" else "open"].engine
        front = CoreClient(engine=engine)
        front.start()
        try:
            measured[p] = asyncio.run(live(front, policy, args.load / mean, args.requests,
                                           args.deadline, service, engine.spec.vocab_size,
                                           args.seed, estimate))  # fmt: skip
        finally:
            front.shutdown()
        sim = at_load[p]
        print(f"{p:17s} live goodput {measured[p]['goodput']:.2f} (simulated "
              f"{sim['goodput']:.2f}), turned away {measured[p]['turned_away']:.2f} "
              f"({sim['turned_away']:.2f}), late {measured[p]['late']:.2f} "
              f"({sim['late']:.2f})")  # fmt: skip

    record = make_record(
        kind="lab.admission_policies",
        engine=llm.config.to_dict() | {"max_waiting": f"{args.queue} (bounded_queue), else 100000"},
        model=model_record(llm),
        workload={
            "kinds": KINDS,
            "load": args.load,
            "loads": args.loads,
            "requests": args.requests,
            "deadline_s": args.deadline,
            "queue": args.queue,
            "sim_requests": args.sim_requests,
            "arrivals": "Poisson",
        },  # fmt: skip
        results={
            "theory": checked,
            "service_s": service,
            "mean_service_s": mean,
            "service_alone_s": alone,
            "alone_over_front": alone_scale,
            "simulated": simulated,
            "simulated_at_load": at_load,
            "live": measured,
            "stale_estimates": stale,
        },  # fmt: skip
        seeds=[args.seed],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    loads = list(simulated)
    for p in queueing.POLICIES:
        a.plot([float(x) for x in loads], [simulated[x][p]["goodput"] for x in loads], "o-",
               label=p.replace("_", " "))  # fmt: skip
    a.set(xlabel="offered load (1: the engine's capacity)", ylabel="goodput",
          title=f"simulated, deadline {args.deadline} s")  # fmt: skip
    a.legend(fontsize=7)
    xs = range(len(measured))
    b.bar([x - 0.2 for x in xs], [at_load[p]["goodput"] for p in measured], 0.4,
          label="simulated")  # fmt: skip
    b.bar([x + 0.2 for x in xs], [measured[p]["goodput"] for p in measured], 0.4,
          label="live engine")  # fmt: skip
    b.set(xticks=list(xs), xticklabels=[p.replace("_", "\n") for p in measured],
          ylabel="goodput",
          title=f"at {args.load}x capacity, {args.requests} requests")  # fmt: skip
    b.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
