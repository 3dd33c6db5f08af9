"""Embeddings (SamplingParams.pooling, LLM.embed, /v1/embeddings): a text's final hidden
states, after the last norm, pooled by mean or last position and scaled to unit length,
equal to transformers' on the same weights, however the prompt is cut into chunks, and the
same through the server's official-SDK call on each transport."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch

from tokenworks import LLM

TEXTS = [
    "The cat sat on the mat.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Hi",
]


def oracle(hf, tokenizer, text: str, pooling: str) -> torch.Tensor:
    ids = tokenizer.encode(text)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].double()  # after the final norm
    v = h.mean(0) if pooling == "mean" else h[-1]
    return torch.nn.functional.normalize(v, dim=0)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers_pooled(smol_llm, hf_smol, pooling):
    got = smol_llm.embed(TEXTS, pooling=pooling, use_tqdm=False)
    for text, vector in zip(TEXTS, got, strict=True):
        v = torch.tensor(vector, dtype=torch.float64)
        assert abs(v.norm().item() - 1) < 1e-5
        assert (v - oracle(hf_smol, smol_llm.tokenizer, text, pooling)).abs().max() < 1e-4


def test_an_embedding_is_the_same_in_chunks_and_beside_generation(smol_loaded, smol_llm):
    """A 16-token step budget cuts the long text into chunks, beside a request that
    generates; the embedding equals the one computed in a single pass, and a second
    embedding of the same text (its blocks in the prefix cache) is the same again."""
    llm = LLM(
        "smollm2-135m", loaded=smol_loaded, dtype="float32", quantization="none", threads=2,
        max_num_batched_tokens=16, kv_cache_memory=0.1, warmup=False,
    )  # fmt: skip
    from tokenworks import SamplingParams

    text = TEXTS[1] * 3
    whole = torch.tensor(smol_llm.embed([text], use_tqdm=False)[0])
    outs = llm.generate(
        [text, "Once upon a time"],
        [SamplingParams(max_tokens=0, pooling="mean"), SamplingParams(max_tokens=5)],
        use_tqdm=False,
    )
    assert len(outs[1].outputs[0].token_ids) == 5 and outs[1].embedding is None
    again = llm.embed([text], use_tqdm=False)[0]
    for vector in (outs[0].embedding, again):
        assert (torch.tensor(vector) - whole).abs().max() < 1e-5


@pytest.fixture(scope="module", params=["process", "thread"])
def embedding_server(smol_loaded, request):
    from conftest import start_server

    srv = start_server(
        smol_loaded, dtype="float32", quantization="none", engine_process=request.param == "process"
    )
    yield srv
    srv.stop()


def test_the_sdks_embeddings_call(embedding_server, smol_llm):
    client = openai.OpenAI(
        base_url=embedding_server.url + "/v1", api_key="x", max_retries=0, timeout=120
    )
    r = client.embeddings.create(model="smollm2-135m", input=TEXTS)
    want = smol_llm.embed(TEXTS, use_tqdm=False)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, w in zip(r.data, want, strict=True):
        assert len(d.embedding) == 576
        assert (torch.tensor(d.embedding) - torch.tensor(w)).abs().max() < 1e-5
    tokens = [smol_llm.tokenizer.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == sum(map(len, tokens))
    # (the SDK asks for base64 itself above and decodes it; asked for, it hands it back)
    raw = client.embeddings.create(model="smollm2-135m", input=tokens[0], encoding_format="base64")
    vector = struct.unpack("<576f", base64.b64decode(raw.data[0].embedding))
    assert (torch.tensor(vector) - torch.tensor(want[0])).abs().max() < 1e-5
    listed = client.embeddings.create(model="smollm2-135m", input="Hi", encoding_format="float")
    assert (torch.tensor(listed.data[0].embedding) - torch.tensor(want[2])).abs().max() < 1e-5


def test_bad_embedding_requests_are_a_400(embedding_server):
    import httpx

    url = embedding_server.url + "/v1/embeddings"
    for body, field in [
        ({"input": "x", "dimensions": 10}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["x"] * 300}, "input"),
        ({"input": [99999999]}, None),
    ]:
        r = httpx.post(url, json={"model": "smollm2-135m", **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        if field is not None:
            assert r.json()["error"]["param"] == field, r.text
