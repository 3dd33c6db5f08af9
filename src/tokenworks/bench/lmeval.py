"""`tokenworks bench lmeval`: lm-evaluation-harness on one small multiple-choice task, in
process (tokenworks.eval.harness.TokenworksLM over an LLM) and through a server on the same
engine (lm-eval's own `local-completions` model: /v1/completions with echo and logprobs,
tokenised through /tokenize), in rounds that alternate which goes first. The record keeps
each way's seconds and accuracy, and how far the two disagree: the largest difference of
any continuation's log-likelihood, and the questions whose chosen answer differs.

The task is local (capitals: COUNTRIES, four choices each), so nothing is fetched.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from tokenworks.bench.record import make_record, model_record, write_record

# (country, capital, three wrong choices)
COUNTRIES = [
    ("France", "Paris", "Rome", "Berlin", "Madrid"), ("Italy", "Rome", "Vienna", "Lisbon", "Oslo"),
    ("Germany", "Berlin", "Prague", "Warsaw", "Paris"), ("Spain", "Madrid", "Athens", "Dublin",
    "Brussels"), ("Japan", "Tokyo", "Seoul", "Beijing", "Bangkok"), ("Egypt", "Cairo",
    "Nairobi", "Lagos", "Tunis"), ("Canada", "Ottawa", "Toronto", "Vancouver", "Montreal"),
    ("Australia", "Canberra", "Sydney", "Melbourne", "Perth"), ("Brazil", "Brasilia",
    "Rio de Janeiro", "Sao Paulo", "Lima"), ("Russia", "Moscow", "Kyiv", "Minsk", "Riga"),
    ("China", "Beijing", "Shanghai", "Tokyo", "Hanoi"), ("India", "New Delhi", "Mumbai",
    "Karachi", "Dhaka"), ("Mexico", "Mexico City", "Bogota", "Havana", "Lima"), ("Greece",
    "Athens", "Sofia", "Ankara", "Rome"), ("Portugal", "Lisbon", "Porto", "Madrid", "Seville"),
    ("Norway", "Oslo", "Stockholm", "Helsinki", "Copenhagen"), ("Sweden", "Stockholm", "Oslo",
    "Helsinki", "Tallinn"), ("Poland", "Warsaw", "Krakow", "Prague", "Budapest"), ("Austria",
    "Vienna", "Salzburg", "Zurich", "Munich"), ("Ireland", "Dublin", "Belfast", "London",
    "Cork"), ("Turkey", "Ankara", "Istanbul", "Athens", "Baghdad"), ("Argentina",
    "Buenos Aires", "Santiago", "Montevideo", "Lima"), ("Kenya", "Nairobi", "Mombasa",
    "Kampala", "Addis Ababa"), ("Peru", "Lima", "Quito", "La Paz", "Bogota"),
]  # fmt: skip
TASK = """task: tokenworks_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def write_task(folder: Path) -> str:
    """The task's YAML and data in folder (choices in a fixed rotated order); its name."""
    rows = []
    for i, (country, capital, *wrong) in enumerate(COUNTRIES):
        choices = wrong[:]
        choices.insert(i % 4, capital)
        rows.append(json.dumps({"country": country, "choices": choices, "answer": i % 4}))
    data = folder / "capitals.jsonl"
    data.write_text("\n".join(rows) + "\n")
    (folder / "capitals.yaml").write_text(TASK.format(data=data))
    return "tokenworks_capitals"


def evaluate(model, model_args, folder: Path) -> tuple[float, dict]:
    """(seconds, lm-eval's results with samples) of the task under model."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tokenworks_capitals"],
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
    )
    return time.perf_counter() - t0, out


def _scores(results: dict) -> list[list[float]]:
    """Each question's choices' log-likelihoods."""
    samples = results["samples"]["tokenworks_capitals"]
    return [[resp[0][0] for resp in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]


def run_model(name: str, args) -> Path:
    from tokenworks import LLM
    from tokenworks.eval.harness import TokenworksLM
    from tokenworks.models import load
    from tokenworks.serve.app import build_app
    from tokenworks.serve.server import ServerThread, make_state

    loaded = load(name)
    kw = dict(loaded=loaded, threads=args.threads, dtype=args.dtype, quantization=args.quantization)
    llm = LLM(name, **kw)
    served = LLM(name, **kw)  # the server's engine: one loop steps an engine
    rounds: dict[str, list[float]] = {"in_process": [], "server": []}
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ServerThread(
        build_app(make_state(served.engine, [name]))
    ) as srv:  # fmt: skip
        folder = Path(tmp)
        write_task(folder)
        ways = {
            "in_process": (TokenworksLM(llm), None),
            "server": ("local-completions", {
                "base_url": srv.url + "/v1/completions", "model": name,
                "tokenizer_backend": "remote", "tokenized_requests": True,
                "num_concurrent": args.concurrency, "max_retries": 1,
            }),
        }  # fmt: skip
        order = list(ways)
        for r in tqdm(range(args.rounds), desc=name):
            for way in order if r % 2 == 0 else order[::-1]:
                seconds, found[way] = evaluate(*ways[way], folder)
                rounds[way].append(seconds)
    inside, served = _scores(found["in_process"]), _scores(found["server"])
    diffs = [
        abs(a - b)
        for qa, qb in zip(inside, served, strict=True)
        for a, b in zip(qa, qb, strict=True)
    ]
    differ = sum(
        max(range(len(qa)), key=qa.__getitem__) != max(range(len(qb)), key=qb.__getitem__)
        for qa, qb in zip(inside, served, strict=True)
    )
    results = {
        way: {
            "seconds": rounds[way],
            "median_s": statistics.median(rounds[way]),
            "acc": found[way]["results"]["tokenworks_capitals"]["acc,none"],
        }
        for way in ways
    }
    results["in_process"]["engine_s"] = ways["in_process"][0].seconds / args.rounds
    results["server_over_in_process"] = (
        results["server"]["median_s"] / results["in_process"]["median_s"]
    )
    results["max_abs_loglikelihood_diff"] = max(diffs)
    results["questions_answered_differently"] = differ
    workload = {
        "task": "tokenworks_capitals",
        "questions": len(COUNTRIES),
        "choices": 4,
        "requests": 4 * len(COUNTRIES),
        "rounds": args.rounds,
        "server": "a ServerThread in this process over a second engine on the same weights "
        "and configuration; lm-eval's local-completions",
        "concurrency": args.concurrency,
    }
    record = make_record(
        kind="lmeval",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload=workload,
        results=results,
        seeds=[],
    )
    path = write_record(record, args.out)
    print(
        f"{name}: in process {results['in_process']['median_s']:.2f} s, through the server "
        f"{results['server']['median_s']:.2f} s (x{results['server_over_in_process']:.2f}); "
        f"acc {results['in_process']['acc']:.3f} / {results['server']['acc']:.3f}; largest "
        f"log-likelihood difference {max(diffs):.2e}; {differ} questions answered "
        f"differently -> {path}"
    )
    return path


def run_lmeval(args) -> None:
    for name in args.models:
        run_model(name, args)
