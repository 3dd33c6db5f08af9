"""lm-evaluation-harness itself against `tokenworks serve`: its `local-completions` model
scores a small multiple-choice task (a local file) through /v1/completions with echo and
logprobs, tokenising through the server's /tokenize and /tokenizer_info, and gets the
log-likelihoods the engine gives the same continuations in-process."""

from __future__ import annotations

import json

import pytest

from tokenworks import SamplingParams
from tokenworks.bench.lmeval import TASK
from tokenworks.eval.harness import split_pair

CAPITALS = [
    ("France", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("Italy", ["Vienna", "Rome", "Lisbon", "Oslo"], 1),
    ("Germany", ["Prague", "Warsaw", "Berlin", "Paris"], 2),
    ("Spain", ["Athens", "Dublin", "Brussels", "Madrid"], 3),
    ("Japan", ["Tokyo", "Seoul", "Beijing", "Bangkok"], 0),
    ("Egypt", ["Nairobi", "Cairo", "Lagos", "Tunis"], 1),
]


def engine_loglikelihood(llm, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, the pair split into tokens as
    lm-evaluation-harness splits it (tokenworks.eval.harness.split_pair)."""
    whole, n_context = split_pair(llm.tokenizer, context, continuation)
    (out,) = llm.generate([whole], SamplingParams(max_tokens=0, prompt_logprobs=0), False)
    return sum(lp.logprob for lp in out.prompt_logprobs[n_context:])


@pytest.fixture(scope="module")
def float32_server(smol_loaded):
    from conftest import start_server

    srv = start_server(smol_loaded, quantization="none")  # float32, as smol_llm
    yield srv
    srv.stop()


def test_lm_eval_local_completions_scores_as_the_engine_does(
    float32_server, smol_llm, tmp_path, monkeypatch
):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a local file: nothing to fetch
    data = tmp_path / "capitals.jsonl"
    data.write_text(
        "".join(
            json.dumps({"country": c, "choices": choices, "answer": a}) + "\n"
            for c, choices, a in CAPITALS
        )
    )
    (tmp_path / "capitals.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": float32_server.url + "/v1/completions",
            "model": "smollm2-135m",
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["tokenworks_capitals"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = results["samples"]["tokenworks_capitals"]
    assert len(samples) == len(CAPITALS)
    scored = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            got = resp[0][0]
            want = engine_loglikelihood(smol_llm, context, continuation)
            assert abs(got - want) < 1e-3, (context, continuation, got, want)
            scored += 1
    assert scored == 4 * len(CAPITALS)
    assert results["results"]["tokenworks_capitals"]["acc,none"] >= 0.5  # a 135M model knows some
    # in process (tokenworks.eval.harness.TokenworksLM): the same figures without a server
    from tokenworks.eval.harness import TokenworksLM

    inside = lm_eval.simple_evaluate(
        model=TokenworksLM(smol_llm),
        tasks=["tokenworks_capitals"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    by_doc = {s["doc_id"]: s for s in inside["samples"]["tokenworks_capitals"]}
    for sample in samples:
        theirs = [r[0][0] for r in by_doc[sample["doc_id"]]["resps"]]
        ours = [r[0][0] for r in sample["resps"]]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3
    assert (
        inside["results"]["tokenworks_capitals"]["acc,none"]
        == (results["results"]["tokenworks_capitals"]["acc,none"])
    )


def test_an_engine_a_server_steps_refuses_a_second_loop(smol_loaded):
    """One loop steps an engine: while a server's core thread runs an LLM's engine, the
    LLM's own generate() is refused with what to do instead (two loops corrupt its KV)."""
    from tokenworks import LLM
    from tokenworks.serve.app import build_app
    from tokenworks.serve.server import ServerThread, make_state

    llm = LLM("smollm2-135m", loaded=smol_loaded, dtype="float32", quantization="none",
              threads=2, kv_cache_memory=0.05, warmup=False)  # fmt: skip
    with ServerThread(build_app(make_state(llm.engine, ["smollm2-135m"]))):
        with pytest.raises(RuntimeError, match="served by a core thread"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)) == 1
