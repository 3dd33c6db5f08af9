"""Tensor and pipeline parallelism: a random-weight model split over gloo ranks (separate
processes on 127.0.0.1) gives the one-process logits within 1e-5 (a prompt pass and paged
decode steps) and greedy tokens, each rank holding only its part; a rank that dies fails
the engine's steps instead of hanging them."""

from __future__ import annotations

import datetime
import multiprocessing

import numpy as np
import pytest
import torch
import transformers
from test_architectures import CONFIGS as ARCH_CONFIGS

from tokenworks.models import tensor_parallel as tp

# the families' random configs of tests/test_architectures.py, with a vocabulary of 322
# rows (4 ranks split it with padding)
FAMILIES = {"llama": "llama-gqa", "qwen3": "qwen3", "qwen3-moe": "qwen3-moe",
            "qwen2-moe": "qwen2-moe", "gemma3": "gemma3", "gpt2": "gpt2", "gpt-oss": "gpt-oss",
            "olmo2": "olmo2"}  # fmt: skip


def resident_bytes(model) -> int:
    """Bytes of the weights a rank's model holds (each storage once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _config(name: str):
    cfg = ARCH_CONFIGS[FAMILIES[name]]()
    cfg.vocab_size = 322
    return cfg


PROMPT, DECODE = 12, 4


def _run(model, spec):
    """Logits of a 12-token prompt pass through a scattered block table, then 4 decode
    steps, as float64 numpy [16, vocab]."""
    from tokenworks.engine.kv_pool import KVPool
    from tokenworks.ops.attention import AttentionMetadata

    ids = torch.arange(5, 5 + PROMPT + DECODE)
    table, bs = [3, 0, 2, 1], 4
    pool = KVPool.for_spec(spec, 4, bs, torch.float32)
    rows = []
    with torch.no_grad():
        meta = AttentionMetadata.paged([PROMPT], [0], [table], bs)
        rows.append(model(ids[:PROMPT], torch.arange(PROMPT), meta, pool))
        for i in range(PROMPT, PROMPT + DECODE):
            meta = AttentionMetadata.paged([1], [i], [table], bs)
            rows.append(model(ids[i : i + 1], torch.tensor([i]), meta, pool))
    return torch.cat(rows).double().numpy()


def _rank(rank, size, path, store, out):
    from tokenworks.models.build import build_model
    from tokenworks.models.loader import load

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        loaded = load(str(path))
        shard = tp.Shard(rank, size)
        spec = tp.shard_spec(loaded.spec, size, rank)
        weights = tp.shard_weights(loaded.weights, loaded.spec, shard)
        model = build_model(spec, weights, torch.float32)
        tp.parallelize_(model, loaded.spec, shard)
        logits = _run(model, spec)
        np.save(f"{out}-{rank}.npy", logits)
        np.save(f"{out}-{rank}-bytes.npy", np.array([resident_bytes(model)]))
    finally:
        torch.distributed.destroy_process_group()


def _ranks(size, path, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = tmp_path / f"tp{size}"
    procs = [ctx.Process(target=_rank, args=(r, size, path, tmp_path / f"store{size}", out))
             for r in range(size)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"a rank of {size} exited with {p.exitcode}"
    return [np.load(f"{out}-{r}.npy") for r in range(size)], [
        int(np.load(f"{out}-{r}-bytes.npy")[0]) for r in range(size)
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> the directory of that random-weight model, saved on first use."""
    dirs = {}

    def get(name):
        if name not in dirs:
            torch.manual_seed(0)
            cfg = _config(name)
            cfg._attn_implementation = "eager"
            model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():  # sharper than the initial weights: fewer near-ties
                for n, p in model.named_parameters():
                    p.mul_(5.0 if p.dim() >= 2 else 1.0)
                    if n.endswith("bias"):  # (initialised to zeros: a bias split wrong or
                        p.normal_(0.0, 0.5)  # added on every rank would go unseen)
            dirs[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(dirs[name])
        return dirs[name]

    return get


# 4 ranks over 2 KV heads: each KV head held twice
@pytest.mark.parametrize(
    ("name", "size"), [("qwen3", 2), ("gemma3", 2), ("gemma3", 4), ("gpt2", 2), ("gpt-oss", 2)]
)
def test_split_logits_equal_one_process(saved, name, size, tmp_path):
    from tokenworks.models.build import build_model
    from tokenworks.models.loader import load

    path = saved(name)
    loaded = load(str(path))
    whole = build_model(loaded.spec, loaded.weights, torch.float32)
    want = _run(whole, loaded.spec)
    got, held = _ranks(size, path, tmp_path)
    for logits in got:
        assert np.abs(logits - want).max() < 1e-5
        assert (logits.argmax(-1) == want.argmax(-1)).all()
    # each rank holds its shard, no more: the parameters of a model with 1/size of the
    # heads, width and vocabulary rows (4 ranks over 2 KV heads hold one each), and the
    # RoPE tables every rank keeps whole
    if loaded.spec.moe is None:
        shard = tp.shard_spec(loaded.spec, size).shape.params() * 4
        tables = sum(t.numel() * 4 for t in whole.buffers())
        assert held == [shard + tables] * size
    assert held[0] < 0.6 * resident_bytes(whole)


def test_sizes_that_do_not_divide_the_heads_are_refused_with_the_ones_that_do(saved):
    from tokenworks.models.loader import load

    spec = load(str(saved("llama")), weights=False).spec
    with pytest.raises(ValueError, match=r"does not divide its 4 query heads.*1, 2, 4"):
        tp.shard_spec(spec, 3)
    assert tp.kv_heads(spec, tp.Shard(3, 4)) == range(1, 2)
    assert tp.kv_heads(spec, tp.Shard(1, 2)) == range(1, 2)
    olmo2 = load(str(saved("olmo2")), weights=False).spec
    with pytest.raises(ValueError, match="Q/K norms span all heads.*--tensor-parallel-size 1"):
        tp.shard_spec(olmo2, 2)


# --------------------------------------------------------------------------- the engine


def _with_tokenizer(path):
    from tokenworks.models.toy import byte_tokenizer

    if not (path / "tokenizer.json").exists():
        byte_tokenizer().save(str(path / "tokenizer.json"))
    return str(path)


PROMPTS = [[7, 8, 9], list(range(10, 50)), [3] * 20, [100 + i % 7 for i in range(23)]]


def _greedy(model, **kw) -> list:
    """Batched, chunked (a step budget of 16 tokens), prefix-cached (the last prompt comes
    again), n = 2 (copy-on-write of the shared last block)."""
    from tokenworks import LLM, SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(model, dtype="float32", max_num_batched_tokens=16, threads=1, **kw)
    try:
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS + [PROMPTS[-1]], params)]
        pair = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, n=2, temperature=0))
        return out + [[o.token_ids for o in pair[0].outputs]]
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    ("name", "tp", "pp"),
    [("qwen3", 2, 1), ("llama", 1, 2), ("qwen3-moe", 2, 1), ("qwen3-moe", 2, 2), ("gpt2", 2, 1)],
)
def test_the_engine_over_several_ranks_gives_one_process_greedy_tokens(saved, name, tp, pp):
    model = _with_tokenizer(saved(name))
    want = _greedy(model)
    assert _greedy(model, tensor_parallel_size=tp, pipeline_parallel_size=pp) == want


def test_a_worker_that_dies_fails_the_step_and_every_later_one(saved):
    """SIGKILL one rank mid-generation: the next step raises, saying a rank failed, well
    within the collective timeout; its requests end aborted; later steps fail at once."""
    import os
    import signal

    from tokenworks import LLM

    llm = LLM(_with_tokenizer(saved("llama")), dtype="float32", tensor_parallel_size=2,
              distributed_timeout=20, warmup=False, threads=1)  # fmt: skip
    try:
        _killed_mid_generation(
            llm.engine, lambda: os.kill(llm.engine.workers.procs[0].pid, signal.SIGKILL), 20
        )
    finally:
        llm.engine.close()


def _killed_mid_generation(eng, kill, timeout: float) -> None:
    """Requests running, `kill` a worker: a step raises WorkerFailed naming a rank within
    `timeout` s (steps until the death is seen: a kill lands asynchronously), the requests
    end aborted, the engine says it is broken, and a later step fails at once."""
    import time

    from tokenworks import SamplingParams
    from tokenworks.engine.workers import WorkerFailed

    seqs = [eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=50))
            for p in PROMPTS]  # fmt: skip
    eng.step()
    kill()
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank"):
        while True:
            eng.step()
    assert time.monotonic() - t0 < timeout
    assert eng.broken and all(s.finish_reason == "abort" for s in seqs)
    eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))
    with pytest.raises(WorkerFailed):
        eng.step()


@pytest.mark.parametrize(("tp", "pp"), [(3, 1), (1, 2)])
def test_the_default_model_split_matches(smol_llm, smol_loaded, tp, pp):
    """SmolLM2 over its 3 KV heads (9 query heads), and in two stages of 15 layers: the
    greedy tokens of the one-process float32 engine."""
    from tokenworks import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    want = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    llm = LLM("smollm2-135m", dtype="float32", quantization="none", loaded=smol_loaded,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, warmup=False,
              threads=1)  # fmt: skip
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        if pp > 1:  # rank 0 holds the first stage: its layers and the embedding, no head
            model = llm.engine.model.model
            assert list(model.stage) == list(range(15)) and model.lm_head is None
    finally:
        llm.engine.close()


def test_the_default_model_split_keeps_the_files_blocks(smol_loaded):
    """SmolLM2 as its GGUF stores it, over 3 ranks: every rank's products stay Q4_1 / Q8_0
    blocks (its rows a view of the file, its columns whole blocks), far fewer bytes than
    its float shard, and the greedy tokens are one process's on the same blocks."""
    from tokenworks import LLM, SamplingParams
    from tokenworks.kernels.block_linear import BlockLinear

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    kw = dict(loaded=smol_loaded, dtype="float32", kernels="torch", warmup=False, threads=1)
    one = LLM("smollm2-135m", **kw)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    llm = LLM("smollm2-135m", tensor_parallel_size=3, **kw)
    try:
        assert llm.engine.quantization == "gguf"
        layers = llm.engine.model.layers
        products = [m for m in layers.modules() if isinstance(m, BlockLinear)]
        assert len(products) >= 4 * len(layers)  # (q, k, v fused or not; o; gate/up; down)
        held = resident_bytes(llm.engine.model)
        assert held < resident_bytes(one.engine.model) / 2
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    finally:
        llm.engine.close()


def test_a_stages_kv_pool_holds_its_own_layers_and_its_budget_counts_them(saved):
    """PP = 2 with the same kv_cache_memory: a block costs the larger stage's layers, so
    the pool holds more blocks than one process's, and rank 0's tensors are its stage's."""
    from tokenworks import LLM
    from tokenworks.models.pipeline import stage_layers

    kw = dict(dtype="float32", kv_cache_memory=0.002, warmup=False, threads=1)
    model = _with_tokenizer(saved("llama"))
    one = LLM(model, **kw).engine
    two = LLM(model, pipeline_parallel_size=2, **kw).engine
    try:
        n = one.spec.n_layers
        first, last = stage_layers(n, 2)
        assert two.block_bytes == one.block_bytes * max(len(first), len(last)) // n
        assert two.blocks.num_blocks >= 2 * one.blocks.num_blocks - 1
        assert two.pool.nbytes == two.blocks.num_blocks * one.block_bytes * len(first) // n
        assert all(two.pool.k[i].numel() == 0 for i in last)
    finally:
        two.close()


def test_a_pipeline_keeps_a_batch_in_flight_for_each_stage(saved):
    """PP = 2: a step launches a batch through stage 0 and returns nothing; the next
    launches a second from the sequences the first does not hold, then finishes the first.
    Each batch takes half the requests. A request aborted while its batch is in flight
    ends alone: the others' tokens are one process's, and every block comes back."""
    from tokenworks import LLM, SamplingParams

    model = _with_tokenizer(saved("llama"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", warmup=False, threads=1)
    want = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(PROMPTS, params)]
    eng = LLM(model, pipeline_parallel_size=2, **kw).engine
    try:
        assert eng.in_flight == 2
        seqs = [eng.add_request(prompt_token_ids=p, params=params) for p in PROMPTS]
        assert eng.step() == []

        def in_flight():
            return [{item.seq for item in f.out.scheduled} for f in eng._flights]

        [first] = in_flight()
        assert len(first) == 2
        assert set(eng.step()) == first  # the second launched, the first finished
        [second] = in_flight()
        assert second == set(seqs) - first
        victim = seqs.index(min(second, key=lambda s: s.arrival))
        eng.abort_request(seqs[victim].request_id)
        while eng.has_unfinished():
            eng.step()
        assert seqs[victim].finish_reason == "abort"
        got = [s.output_ids for s in seqs]
        assert [g for i, g in enumerate(got) if i != victim] == [
            w for i, w in enumerate(want) if i != victim
        ]
        eng.blocks.check()
        assert eng.blocks.num_free == eng.blocks.num_blocks
    finally:
        eng.close()


def test_stages_share_out_the_layers_and_micro_batches_the_chunks():
    from tokenworks.models.pipeline import micro_batches, stage_layers

    assert stage_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="1 to 2 stages"):
        stage_layers(2, 3)
    mbs = micro_batches([5, 1, 1, 1, 8], [4, 5, 6, 7, 15], 2)
    assert [(m.start, m.end, list(m.chunks), m.head_rows) for m in mbs] == [
        (0, 8, [0, 1, 2, 3], [4, 5, 6, 7]),
        (8, 16, [4], [7]),
    ]
    assert len(micro_batches([1], [0], 4)) == 1


def test_serve_splits_the_model_and_a_dead_rank_fails_its_request_and_restarts(saved):
    """`tokenworks serve --tensor-parallel-size 2 --restart-engine`: the official OpenAI
    client gets the one-process completion; a worker rank killed (SIGKILL), the request in
    flight fails with an error that names the rank, the core stops (the server answers 503
    meanwhile) and a new one with new ranks serves the same completion; SIGTERM then stops
    everything with exit 0."""
    import os
    import signal

    import httpx
    import openai
    from conftest import wait_for
    from test_server_shutdown import Served, _gone

    from tokenworks import LLM, SamplingParams

    model = _with_tokenizer(saved("llama"))
    llm = LLM(model, dtype="float32", warmup=False, threads=1)
    want = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0))[0]
    srv = Served("--tensor-parallel-size", "2", "--dtype", "float32", "--restart-engine",
                 "--distributed-timeout", "10", model=model)  # fmt: skip

    def ranks():
        (core,) = srv.core_pids()
        with open(f"/proc/{core}/task/{core}/children") as f:
            children = [int(pid) for pid in f.read().split()]
        return [p for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]

    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        served = client.models.list().data[0].id

        def complete():
            out = client.completions.create(model=served, prompt=PROMPTS[1], max_tokens=8,
                                            temperature=0)  # fmt: skip
            return out.choices[0].text

        assert complete() == want.outputs[0].text
        (worker,) = ranks()
        cores = srv.core_pids()
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="rank"):
            complete()
        wait_for(lambda: srv.core_pids() not in ([], cores), timeout=120)  # a new core
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, timeout=120)
        assert complete() == want.outputs[0].text
        (new_worker,) = ranks()
        srv.signal(signal.SIGTERM, group=False)
        assert srv.exit_code(timeout=30) == 0, "".join(srv.output)
        assert _gone(new_worker)
    finally:
        srv.close()


def _node(model: str, port: int, *flags: str):
    """`tokenworks serve ... --nnodes 2 --node-rank 1`: the second node's command line,
    a process group of its own (as a shell on another machine starts it)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tokenworks.cli", "serve", "--model", model, "--nnodes", "2",
           "--node-rank", "1", "--master-port", str(port), "--threads", "1", *flags]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _two_free_ports() -> int:
    """A port whose next one is free too (the store's and the step channel's)."""
    import socket

    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
            except OSError:
                continue
            return a.getsockname()[1]
    raise RuntimeError("no two free ports in a row")


def test_two_nodes_on_one_machine_give_one_process_tokens(saved):
    """Two groups of processes on 127.0.0.1 standing for two machines: node 1 started
    first (its ranks wait for node 0), node 0's engine split with it (TP = 2 x PP = 2,
    ranks 2 and 3 on node 1) gives the one-process tokens, and when node 0's engine
    closes, node 1 exits 0."""
    model = _with_tokenizer(saved("llama"))
    want = _greedy(model)
    port = _two_free_ports()
    node = _node(model, port, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")
    try:
        got = _greedy(model, tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                      master_port=port)  # fmt: skip
        assert got == want
        assert node.wait(timeout=30) == 0, node.stdout.read()
    finally:
        node.kill()


def test_a_node_that_dies_fails_the_step_within_the_collective_timeout(saved):
    """Node 1 killed (its whole process group, as when a machine is lost) while node 0's
    engine is generating: a step fails naming the ranks within --distributed-timeout, and
    every later one fails at once."""
    import os
    import signal

    from tokenworks import LLM

    model = _with_tokenizer(saved("llama"))
    port = _two_free_ports()
    node = _node(model, port, "--tensor-parallel-size", "2")
    llm = LLM(model, dtype="float32", tensor_parallel_size=2, nnodes=2, master_port=port,
              distributed_timeout=15, warmup=False, threads=1)  # fmt: skip

    def kill():  # the whole machine
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()

    try:
        _killed_mid_generation(llm.engine, kill, 15 + 5)
    finally:
        llm.engine.close()
        node.kill()


def test_worker_ranks_as_ray_actors_give_one_process_tokens_and_a_dead_one_fails(saved):
    """--distributed-executor-backend ray on a local Ray cluster: the worker ranks are
    actors (TP = 2: rank 1), the tokens one process's; a killed actor fails the next step."""
    ray = pytest.importorskip("ray")
    from tokenworks import SamplingParams
    from tokenworks.engine.workers import WorkerFailed

    model = _with_tokenizer(saved("llama"))
    want = _greedy(model)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert _greedy(model, tensor_parallel_size=2, distributed_executor_backend="ray") == want
        from tokenworks import LLM

        llm = LLM(model, dtype="float32", tensor_parallel_size=2, warmup=False, threads=1,
                  distributed_executor_backend="ray", distributed_timeout=15)  # fmt: skip
        eng = llm.engine
        try:
            assert not eng.workers.procs and len(eng.workers.actors) == 1
            ray.kill(eng.workers.actors[0][0])
            eng.add_request(prompt_token_ids=PROMPTS[1], params=SamplingParams(max_tokens=20))
            with pytest.raises(WorkerFailed, match="rank"):
                while eng.has_unfinished():
                    eng.step()
        finally:
            eng.close()
    finally:
        ray.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_the_messages_a_step_sends_are_the_cost_models(saved, tp, pp):
    """Counted on rank 0 over one prompt pass of 3 prompts and one decode step of the 3:
    the all-reduces, all-gathers and stage sends, and their bytes, that plan/parallel.py
    predicts for those tokens (float32 activations)."""
    from tokenworks import LLM, SamplingParams
    from tokenworks.engine.rank import comms_of
    from tokenworks.plan import parallel

    llm = LLM(_with_tokenizer(saved("llama")), dtype="float32", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, pipeline_batches=1, warmup=False,
              threads=1)  # fmt: skip
    eng = llm.engine
    try:
        prompts = PROMPTS[:3]
        for p in prompts:
            eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=4))
        shape = eng.spec.shape
        for tokens, rows in ((sum(map(len, prompts)), 3), (3, 3)):  # the prompts, a decode
            for c in comms_of(eng.model):
                c.reset()
            eng.step()
            count, nbytes = {}, {}
            for c in comms_of(eng.model):
                count |= c.count
                nbytes |= c.nbytes
            if tp > 1:
                want = parallel.tensor_traffic(shape, tokens, rows, act_bytes=4)
                assert count == {"all_reduce": want.allreduces, "all_gather": want.allgathers}
                assert nbytes["all_reduce"] == want.allreduces * want.allreduce_bytes
                assert nbytes["all_gather"] == want.allgather_bytes
            else:  # rank 0 sends each micro-batch's hidden states, receives its logits
                micro = min(pp, 3)
                want = parallel.pipeline_traffic(shape, tokens, rows, pp, 4, micro)
                assert count == {"send": micro, "recv": micro}
                assert nbytes["send"] + nbytes["recv"] == want.send_bytes
                assert count["send"] + count["recv"] == want.sends
    finally:
        eng.close()
