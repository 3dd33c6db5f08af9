"""LoRA adapters (engine/lora.py) on the default model, against PEFT on transformers with
the same base and adapter: greedy tokens and logprobs, alone and in one batch with the
base model and a second adapter; loading, unloading and bad adapters."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenworks import LLM, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a": (1, ALL, 8), "b": (2, ["q_proj", "v_proj", "down_proj"], 4)}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)


def make_adapter(hf, path, seed: int, targets: list[str], rank: int):
    """A PEFT adapter with random A and B (B small enough that the text stays text),
    saved as PEFT saves it; the PEFT model."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(copy.deepcopy(hf), config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def adapters(hf_smol, tmp_path_factory):
    pytest.importorskip("peft")  # (a dev dependency: the oracle)
    out = {}
    for name, (seed, targets, rank) in ADAPTERS.items():
        path = tmp_path_factory.mktemp(f"lora-{name}")
        out[name] = (path, make_adapter(hf_smol, path, seed, targets, rank))
    return out


def _lora_llm(loaded, adapters, kernels: str):
    modules = tuple(f"{name}={path}" for name, (path, _) in adapters.items())
    llm = LLM("smollm2-135m", dtype="float32", quantization="none", loaded=loaded,
              threads=2, max_num_seqs=8, kv_cache_memory=0.25, lora_modules=modules,
              max_loras=3, warmup=False, kernels=kernels)  # fmt: skip
    assert (llm.engine.c_kernels is not None) == (kernels == "c")
    return llm


@pytest.fixture(scope="module")
def lora_llm(smol_loaded, adapters):
    return _lora_llm(smol_loaded, adapters, "torch")


@pytest.fixture(scope="module")
def lora_llm_c(smol_loaded, adapters):
    """On the C kernels: a batch without adapter rows in the whole step, one with them
    between C calls."""
    return _lora_llm(smol_loaded, adapters, "c")


@pytest.fixture(params=["torch", "c"])
def either_llm(request):
    return request.getfixturevalue("lora_llm_c" if request.param == "c" else "lora_llm")


def hf_run(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's logprob, from transformers (and PEFT)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        tokens = out[0, len(ids) :].tolist()
        logits = model(out[:, :-1]).logits[0, len(ids) - 1 :].float()
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])
    return tokens, logprobs.flatten().tolist()


def ours(output) -> tuple[list[int], list[float]]:
    c = output.outputs[0]
    return c.token_ids, [lp.logprob for lp in c.logprobs]


def test_one_batch_of_two_adapters_and_the_base_equals_peft(either_llm, adapters, hf_smol):
    """Each row runs its own adapter: the same tokens as PEFT's model with that adapter,
    and logprobs within 1e-4 of its."""
    lora_llm = either_llm
    ids = [lora_llm.tokenizer.encode(p) for p in PROMPTS]
    rows = [(0, "a"), (0, None), (0, "b"), (1, "a"), (1, "b"), (1, None)]
    got = lora_llm.generate([ids[p] for p, _ in rows], GREEDY, use_tqdm=False,
                            lora=[name for _, name in rows])  # fmt: skip
    base = {p: hf_run(hf_smol, ids[p], 16) for p in range(len(PROMPTS))}
    for (p, name), out in zip(rows, got, strict=True):
        tokens, logprobs = ours(out)
        want_tokens, want_logprobs = hf_run(adapters[name][1], ids[p], 16) if name else base[p]
        assert tokens == want_tokens, (p, name)
        if name is not None:  # the adapter's effect on the base, ours against PEFT's
            assert tokens != base[p][0] or logprobs != pytest.approx(base[p][1], abs=1e-3)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_an_adapters_bytes_are_what_the_planner_counts(lora_llm):
    from tokenworks.plan.memory import lora_bytes

    shape = lora_llm.engine.spec.shape
    assert lora_llm.engine.lora.adapters["a"].nbytes == lora_bytes(shape, 8, 4)  # float32


def test_an_adapter_alone_gives_what_it_gives_in_a_mixed_batch(either_llm):
    lora_llm = either_llm
    ids = lora_llm.tokenizer.encode(PROMPTS[0])
    [alone] = lora_llm.generate([ids], GREEDY, use_tqdm=False, lora="b")
    mixed = lora_llm.generate([ids] * 3, GREEDY, use_tqdm=False, lora=["a", "b", None])
    assert ours(alone)[0] == ours(mixed[1])[0]
    # (within float32 rounding: a batch of one and one of three sum in other orders)
    assert ours(alone)[1] == pytest.approx(ours(mixed[1])[1], abs=1e-4)


def test_the_prefix_cache_keeps_adapters_apart(lora_llm):
    ids = lora_llm.tokenizer.encode("A long shared preamble " * 8)
    one = SamplingParams(max_tokens=1, temperature=0)
    lora_llm.generate([ids], one, use_tqdm=False, lora="a")
    [same] = lora_llm.generate([ids], one, use_tqdm=False, lora="a")
    [other] = lora_llm.generate([ids], one, use_tqdm=False, lora="b")
    assert same.num_cached_tokens > 0 and other.num_cached_tokens == 0
    assert other.prefix_miss == "adapter"


def test_loading_unloading_and_bad_adapters_say_what_to_fix(lora_llm, adapters, tmp_path):
    from tokenworks.engine.messages import LoRANotFoundError

    loras = lora_llm.engine.lora
    with pytest.raises(LoRANotFoundError, match="'c' is not loaded"):
        lora_llm.generate(["hi"], GREEDY, use_tqdm=False, lora="c")
    loras.load("c", str(adapters["b"][0]))
    assert (
        ours(lora_llm.generate(["hi"], GREEDY, use_tqdm=False, lora="c")[0])[0]
        == ours(lora_llm.generate(["hi"], GREEDY, use_tqdm=False, lora="b")[0])[0]
    )
    with pytest.raises(ValueError, match="--max-loras"):
        loras.load("d", str(adapters["b"][0]))
    loras.unload("c")
    with pytest.raises(LoRANotFoundError):
        lora_llm.generate(["hi"], GREEDY, use_tqdm=False, lora="c")
    with pytest.raises(ValueError, match="neither a PEFT directory"):
        loras.load("e", str(tmp_path / "missing"))
    loras.max_rank = 4
    try:
        with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
            loras.load("f", str(adapters["a"][0]))
    finally:
        loras.max_rank = 16
    assert sorted(loras.adapters) == ["a", "b"]


def test_the_adapter_merged_into_the_weights_gives_the_same_tokens(lora_llm, smol_loaded):
    """W + scale * B A written into the base weights, run with no adapter at all."""
    import dataclasses

    from tokenworks.kernels.block_linear import dense

    adapter = lora_llm.engine.lora.adapters["a"]
    weights = dict(smol_loaded.weights)
    for (layer, module), (a, b) in adapter.weights.items():
        group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        key = f"model.layers.{layer}.{group}.{module}.weight"
        weights[key] = dense(weights[key]).float() + adapter.scale * (b @ a)
    merged = LLM("smollm2-135m", dtype="float32", quantization="none", threads=2,
                 loaded=dataclasses.replace(smol_loaded, weights=weights), max_num_seqs=4,
                 kv_cache_memory=0.1, warmup=False)  # fmt: skip
    ids = [lora_llm.tokenizer.encode(p) for p in PROMPTS]
    want = [ours(o)[0] for o in lora_llm.generate(ids, GREEDY, use_tqdm=False, lora="a")]
    assert [ours(o)[0] for o in merged.generate(ids, GREEDY, use_tqdm=False)] == want


def test_the_server_serves_adapters_by_name_and_swaps_them_while_streams_run(
    smol_loaded, adapters, lora_llm, hf_smol, tmp_path
):
    """A core process of its own, as `tokenworks serve` runs it: the model field picks the
    adapter, /v1/models lists it over its base, and loading, unloading and naming an unknown
    adapter while 8 streams run fails none of them."""
    import threading

    import httpx
    import openai
    from conftest import start_server

    big = tmp_path / "rank16"
    make_adapter(hf_smol, big, 3, ["q_proj"], 16)
    srv = start_server(smol_loaded, engine_process=True, quantization="none", max_loras=2,
                       max_lora_rank=8, lora_modules=(f"a={adapters['a'][0]}",))  # fmt: skip
    srv.state.runtime_lora = True
    srv.state.add_adapter("a", str(adapters["a"][0]))
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
    try:
        cards = {m.id: m for m in client.models.list().data}
        assert cards["a"].parent == "smollm2-135m" and cards["a"].root == str(adapters["a"][0])
        [want] = lora_llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora="a")
        got = client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=16,
                                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert got.choices[0].text == want.outputs[0].text

        ends, errors = [], []

        def stream(model: str):
            try:
                chunks = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=48,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})  # fmt: skip
                ends.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
            except Exception as e:  # noqa: BLE001 (any failure is the test's to report)
                errors.append(e)

        threads = [threading.Thread(target=stream, args=(("a", "smollm2-135m")[i % 2],))
                   for i in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        post = httpx.Client(base_url=srv.url, timeout=120).post
        r = post("/v1/load_lora_adapter", json={"lora_name": "b",
                                                "lora_path": str(adapters["b"][0])})  # fmt: skip
        assert r.status_code == 200, r.text
        r = post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(big)})
        assert r.status_code == 400 and "--max-lora-rank 8" in r.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError, match="'zzz'"):
            client.completions.create(model="zzz", prompt="hi", max_tokens=2)
        assert post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        for t in threads:
            t.join(120)
        assert not errors and ends == ["length"] * 8
        with pytest.raises(openai.NotFoundError, match="'a'"):
            client.completions.create(model="a", prompt="hi", max_tokens=2)
        assert client.completions.create(model="b", prompt="hi", max_tokens=2).choices
        assert post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    finally:
        srv.stop()
        srv.state.engine.shutdown()


def test_the_gateway_reads_its_gauges_under_vllms_names(lora_llm):
    """The Gateway API Inference Extension's model-server metrics, with --metrics-prefix
    vllm: the queue, the running set, the KV cache's use and the adapters in flight."""
    from prometheus_client.parser import text_string_to_metric_families

    from tokenworks.engine.loop import gauges_of
    from tokenworks.serve.metrics import ServerMetrics

    loop = lora_llm.loop
    long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    heads = [loop.add_request([5 + i] * 20, long, lora=name)
             for i, name in enumerate(("b", None, "a", "b"))]  # fmt: skip
    try:
        loop.step()
        metrics = ServerMetrics("smollm2-135m", "vllm")
        metrics.on_step(0, gauges_of(lora_llm.engine))
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    finally:
        for head in heads:
            loop.abort(head.request_id)
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                 "lora_requests_info"):  # fmt: skip
        assert families[f"vllm:{name}"].type == "gauge", name
    [info] = families["vllm:lora_requests_info"].samples
    assert info.labels["max_lora"] == "3" and info.labels["running_lora_adapters"] == "a,b"
    assert info.labels["waiting_lora_adapters"] == "" and info.value > 0
    [running] = families["vllm:num_requests_running"].samples
    assert running.value == 4


def test_a_gguf_lora_file_gives_what_its_peft_directory_gives(lora_llm, adapters, tmp_path):
    """The adapter written as llama.cpp's convert_lora_to_gguf.py writes one (its tensors
    blk.N.<name>.weight.lora_a and lora_b, adapter.lora.alpha), read back."""
    import gguf

    from tokenworks.engine.lora import GGUF_TARGETS, read_peft

    peft_dir = adapters["b"][0]
    adapter = read_peft("b", peft_dir)
    path = tmp_path / "b.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", adapter.scale * adapter.rank)
    names = {module: name for name, module in GGUF_TARGETS.items()}
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        base = f"blk.{layer}.{names[module]}.weight"
        writer.add_tensor(base + ".lora_a", a.numpy())
        writer.add_tensor(base + ".lora_b", b.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loras = lora_llm.engine.lora
    loaded = loras.load("g", str(path))
    try:
        assert loaded.rank == adapter.rank and loaded.scale == pytest.approx(adapter.scale)
        ids = [lora_llm.tokenizer.encode(p) for p in PROMPTS]
        via_gguf = lora_llm.generate(ids, GREEDY, use_tqdm=False, lora="g")
        via_peft = lora_llm.generate(ids, GREEDY, use_tqdm=False, lora="b")
        assert [ours(o)[0] for o in via_gguf] == [ours(o)[0] for o in via_peft]
    finally:
        loras.unload("g")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_deltas_add_what_torchs_masked_products_add(dtype):
    """kernels/lora_deltas.py, each row reading its own adapter alone, against the masked
    products over every adapter: parts of other widths, adapters of other ranks, a part an
    adapter leaves alone, rows of the base model."""
    from tokenworks.engine.lora_layers import BatchRows, LoRALinear

    torch.manual_seed(0)
    bounds = [(0, 48), (48, 80), (80, 96)]
    weights = {}
    for slot, rank in ((0, 4), (2, 8)):
        weights[slot] = [(torch.randn(rank, 64), torch.randn(hi - lo, rank), 0.5)
                         for lo, hi in bounds]  # fmt: skip
    weights[2][1] = None
    x = torch.randn(7, 64).to(dtype)
    slots = [0, -1, 2, 2, -1, 0, 2]
    outs = []
    for c in (False, True):
        rows = BatchRows()
        rows.c_deltas = c
        lora = LoRALinear(torch.nn.Linear(64, 96, bias=False).to(dtype), bounds, rows)
        torch.manual_seed(1)
        lora.base.weight.data = torch.randn(96, 64).to(dtype)
        lora.weights = {s: [p and (p[0].to(dtype), p[1].to(dtype), p[2]) for p in w]
                        for s, w in weights.items()}  # fmt: skip
        lora.pack()
        rows.set(slots, "cpu")
        assert (rows.c_slots is not None) == c
        with torch.no_grad():
            outs.append(lora(x).float())
    # bfloat16: the masked products round the delta before adding it, C once after
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2**-6, 0.05)
    assert torch.allclose(outs[0], outs[1], rtol=rtol, atol=atol), (outs[0] - outs[1]).abs().max()
    with torch.no_grad():
        base = lora.base(x).float()
    assert torch.equal(outs[1][[1, 4]], base[[1, 4]])  # the base model's rows, untouched
