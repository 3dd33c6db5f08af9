"""`tokenworks bench routing`: how much of a multi-turn trace the replicas' prefix caches
serve, by router policy. Each conversation has a system prompt of its own; each turn sends
the whole history and a new question, all conversations' turns at once, in an order
shuffled each turn. The hit rate is
the prompt tokens the caches served over those they were asked for, summed over the
replicas (their own counters), and the record keeps each policy's split of requests.
"""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.record import make_record, write_record
from tokenworks.bench.workload import latency_prompt
from tokenworks.config import EngineConfig, engine_kwargs


async def _turn(router, prompts: list[list[int]], answer_tokens: int) -> list[list[int]]:
    """Every conversation's next turn at once; each one's answer tokens."""
    from tokenworks.engine.request import SamplingParams
    from tokenworks.front.interface import Submission

    params = SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True)

    async def one(ids):
        out = []
        async for update in router.generate(Submission(params, ids)):
            for d in update.deltas:
                out.extend(d.token_ids)
        return out

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def run_policy(config: EngineConfig, policy: str, args, vocab: int) -> dict:
    from tokenworks.front.core_client import CoreClient
    from tokenworks.front.replicas import ReplicaRouter
    from tokenworks.serve.server import replica_config

    cores = [CoreClient(replica_config(config, i), startup_timeout_s=600)
             for i in range(args.replicas)]  # fmt: skip
    router = ReplicaRouter(cores, policy)
    router.start()
    try:
        history = [latency_prompt(args.system_tokens, vocab, seed=100 + c)
                   for c in range(args.conversations)]  # fmt: skip
        order = random.Random(0)
        for turn in range(args.turns):
            prompts = [h + latency_prompt(args.question_tokens, vocab, seed=1000 * c + turn)
                       for c, h in enumerate(history)]  # fmt: skip
            sent = order.sample(range(len(prompts)), len(prompts))  # arrivals in any order
            answers = asyncio.run(_turn(router, [prompts[c] for c in sent], args.answer_tokens))
            for c, answer in zip(sent, answers, strict=True):
                history[c] = prompts[c] + answer
        queried = sum(c.gauges.prefix_queried or 0 for c in cores)
        hits = sum(c.gauges.prefix_hits or 0 for c in cores)
        return {"hit_rate": hits / queried if queried else None, "queried_tokens": queried,
                "hit_tokens": hits, "routed": list(router.routed)}  # fmt: skip
    finally:
        router.shutdown()


def free_ports(n: int) -> int:
    """The first of n consecutive free ports on 127.0.0.1 (each replica's events take the
    next two)."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def run_routing(args) -> Path:
    from tokenworks.models import load

    port = free_ports(2 * args.replicas)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}",
              "replay_endpoint": f"tcp://127.0.0.1:{port + 1}"}  # fmt: skip
    kwargs = engine_kwargs(args) | {"kv_events_config": events, "threads": args.threads or 1}
    config = EngineConfig(model=args.model, **kwargs)
    vocab = load(args.model, weights=False).spec.vocab_size
    results = {}
    for policy in tqdm(args.policies, desc="policies"):
        results[policy] = run_policy(config, policy, args, vocab)
    record = make_record(
        kind="routing",
        engine=config.to_dict(),
        model={"id": args.model},
        workload={
            "replicas": args.replicas,
            "conversations": args.conversations,
            "turns": args.turns,
            "system_tokens": args.system_tokens,
            "question_tokens": args.question_tokens,
            "answer_tokens": args.answer_tokens,
            "order": "each turn of every conversation at once, in a shuffled order (seed 0), "
            "turn after turn",
        },  # fmt: skip
        results=results,
        seeds=[0],
    )
    path = write_record(record, args.out)
    for policy, r in results.items():
        print(f"{policy:>12}: hit rate {r['hit_rate'] or 0:.3f}, routed {r['routed']}")
    print(f"record: {path}")
    return path
