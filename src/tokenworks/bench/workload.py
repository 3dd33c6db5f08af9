"""Workloads: what requests a benchmark sends, declared as a manifest so every engine in a
run gets the same token ids, and a record can say exactly what was measured.

A manifest is a dict (JSON, or YAML when PyYAML is installed), hashed into the record:

    {"kind": "random", "num_requests": 64, "seed": 0,
     "input": {"dist": "lognormal", "mean": 256, "sigma": 0.5, "min": 8, "max": 2048},
     "output": {"dist": "fixed", "value": 128}, "ignore_eos": true}

kinds: `random` (random token ids), `shared_prefix` (`groups` groups whose prompts share a
`prefix_len`-token prefix, then a random suffix), `text` (prompts cut from a text file at
`path`, e.g. any plain English text), `jsonl` (one request a line:
{"prompt": "..." or [ids], "max_tokens": n}), `multi_turn` (`num_requests` chats of
`turns` user turns of `input` words each; every turn is sent with the conversation so far,
answers included, to /v1/chat/completions). Length distributions: `fixed` (value),
`uniform` (low, high), `lognormal` (mean, sigma; clipped to min/max).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

KINDS = ("random", "shared_prefix", "text", "jsonl", "multi_turn")

# Words for synthetic user turns of multi-turn chats (the server tokenises them).
_WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this "
    "be or has had but not they their one all new more first two time after who its also "
    "other into over can some most about when many may only these such used then three "
    "city river music water history between world house story light garden letter morning "
    "question answer reason number market winter summer friend teacher window evening"
).split()


class WorkloadError(ValueError):
    pass


@dataclass
class BenchRequest:
    prompt_ids: list[int] | None  # token ids (random and shared-prefix workloads)
    prompt: str | None  # or text (text and jsonl workloads), tokenised by the engine
    max_tokens: int
    ignore_eos: bool = True
    input_len: int | None = None  # prompt tokens, when the workload knows them
    turns: list[str] | None = None  # a multi-turn chat: user turns, sent one after another


def latency_prompt(n_tokens: int, vocab_size: int = 49152, seed: int = 0) -> list[int]:
    """n_tokens ids from the ordinary vocabulary (skipping the low ids where special tokens
    usually sit), fixed by the seed: speed does not depend on which tokens they are."""
    return _random_ids(n_tokens, vocab_size, random.Random(seed))


def _random_ids(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    vocab_low, vocab_high = min(200, vocab_size // 4), min(40000, vocab_size)
    return [rng.randrange(vocab_low, vocab_high) for _ in range(n)]


def sample_length(spec: dict | int, rng: random.Random) -> int:
    """One length from a distribution spec (an int means fixed)."""
    if isinstance(spec, int):
        spec = {"dist": "fixed", "value": spec}
    dist = spec.get("dist", "fixed")
    if dist == "fixed":
        n = spec["value"]
    elif dist == "uniform":
        n = rng.randint(spec["low"], spec["high"])
    elif dist == "lognormal":
        # mean is the distribution's mean: mu = ln(mean) - sigma^2 / 2
        sigma = spec.get("sigma", 0.5)
        mu = math.log(spec["mean"]) - sigma * sigma / 2
        n = round(rng.lognormvariate(mu, sigma))
    else:
        raise WorkloadError(f"length dist {dist!r} is not one of fixed, uniform, lognormal")
    return max(spec.get("min", 1), min(spec.get("max", 1 << 30), int(n)))


def load_manifest(path: str | Path) -> dict:
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise WorkloadError(
                "YAML manifests need PyYAML: pip install 'tokenworks[bench]'"
            ) from e
        return yaml.safe_load(text)
    return json.loads(text)


def build_requests(manifest: dict, vocab_size: int) -> list[BenchRequest]:
    """The manifest's requests, the same for every engine (all randomness is seeded)."""
    kind = manifest.get("kind")
    if kind not in KINDS:
        raise WorkloadError(f"workload kind {kind!r} is not one of {', '.join(KINDS)}")
    rng = random.Random(manifest.get("seed", 0))
    n = manifest.get("num_requests", 1)
    ignore_eos = manifest.get("ignore_eos", True)
    out_spec = manifest.get("output", 128)
    if kind == "random":
        reqs = []
        for _ in range(n):
            ids = _random_ids(sample_length(manifest.get("input", 128), rng), vocab_size, rng)
            reqs.append(BenchRequest(ids, None, sample_length(out_spec, rng), ignore_eos, len(ids)))
        return reqs
    if kind == "shared_prefix":
        groups = manifest.get("groups", 1)
        prefixes = [
            _random_ids(manifest.get("prefix_len", 256), vocab_size, rng) for _ in range(groups)
        ]
        reqs = []
        for i in range(n):
            suffix = _random_ids(sample_length(manifest.get("input", 32), rng), vocab_size, rng)
            ids = prefixes[i % groups] + suffix
            reqs.append(BenchRequest(ids, None, sample_length(out_spec, rng), ignore_eos, len(ids)))
        return reqs
    if kind == "multi_turn":
        reqs = []
        for _ in range(n):
            turns = [
                " ".join(
                    rng.choice(_WORDS) for _ in range(sample_length(manifest.get("input", 32), rng))
                )
                for _ in range(manifest.get("turns", 3))
            ]
            reqs.append(
                BenchRequest(None, None, sample_length(out_spec, rng), ignore_eos, None, turns)
            )
        return reqs
    if kind == "text":
        path = manifest.get("path")
        if not path or not Path(path).exists():
            raise WorkloadError(f"text workload: file {path!r} not found (give 'path')")
        words = Path(path).read_text(errors="replace").split()
        reqs = []
        for _ in range(n):
            length = sample_length(manifest.get("input", 128), rng)  # in words
            start = rng.randrange(0, max(1, len(words) - length))
            text = " ".join(words[start : start + length])
            reqs.append(BenchRequest(None, text, sample_length(out_spec, rng), ignore_eos))
        return reqs
    path = manifest.get("path")
    if not path or not Path(path).exists():
        raise WorkloadError(f"jsonl workload: file {path!r} not found (give 'path')")
    reqs = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            reqs.append(
                BenchRequest(prompt, None, row.get("max_tokens", 128), ignore_eos, len(prompt))
            )
        elif isinstance(prompt, str):
            reqs.append(BenchRequest(None, prompt, row.get("max_tokens", 128), ignore_eos))
        else:
            raise WorkloadError(f"{path}:{i + 1}: 'prompt' must be a string or a list of ids")
    return reqs[:n] if "num_requests" in manifest else reqs


# ------------------------------------------------------------------ arrivals


def arrival_offsets(
    n: int,
    rate: float | None,
    burstiness: float = 1.0,
    seed: int = 0,
    ramp_to: float | None = None,
) -> list[float]:
    """Send times (seconds from the start) of n requests.

    rate None or inf: all at once. Otherwise gaps are gamma-distributed with mean 1/rate and
    shape `burstiness` (vLLM's convention): 1 is a Poisson process (exponential gaps, the
    coefficient of variation is 1); below 1 is burstier, above 1 more regular (CV is
    1/sqrt(burstiness)). With ramp_to, the rate rises (or falls) linearly from `rate` for
    the first request to `ramp_to` for the last: a ramp that finds where latency breaks.
    """
    if rate is None or math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0 or (ramp_to is not None and ramp_to <= 0):
        raise WorkloadError("rate, ramp_to and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        r = rate if ramp_to is None else rate + (ramp_to - rate) * i / max(1, n - 1)
        t += rng.gammavariate(burstiness, 1.0 / (r * burstiness))
    return out
