"""Random-weight models built with transformers (no download) against the engine and oracle.

Each config is saved as a Hugging Face directory (config.json + safetensors) and loaded by
the engine's own loader, so the directory path of the loader is tested too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenworks.models import build_model, load, reference
from tokenworks.ops.attention import AttentionMetadata

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256
    ),
    "llama-gqa": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2, rope_theta=5e5),
    "llama3-rope-scaling": lambda: transformers.LlamaConfig(
        **SMALL,
        num_key_value_heads=2,
        rope_theta=5e5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2-bias": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2),
    "mistral-window": lambda: transformers.MistralConfig(
        **SMALL, num_key_value_heads=1, sliding_window=8
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = CONFIGS[request.param]()
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def test_logits_match_transformers_within_1e_4(saved, device):
    name, hf, path = saved
    loaded = load(str(path))
    ours = build_model(loaded.spec, loaded.weights, torch.float32, device)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(ids.to(device), torch.arange(40, device=device), AttentionMetadata.single(40))
        b = hf(ids[None]).logits[0]
    assert (a.cpu() - b).abs().max().item() < 1e-4, name


def test_the_float64_reference_matches_transformers(saved):
    name, hf, path = saved
    loaded = load(str(path))
    ids = np.arange(3, 23)
    with torch.no_grad():
        b = hf(torch.tensor(ids)[None]).logits[0].double().numpy()
    assert np.abs(reference.forward(ids, loaded.weights, loaded.spec) - b).max() < 1e-4, name


@pytest.mark.parametrize("batch_decode", [True, False])
def test_decoding_through_paged_blocks_matches_one_full_pass(saved, batch_decode, device):
    """Prefill 10 tokens in chunks of 3, 7, then decode one at a time through a scattered
    block table: every step's logits equal the full pass (fast and reference paths)."""
    from tokenworks.engine.kv_cache import KVPool

    _, _, path = saved
    loaded = load(str(path))
    spec = loaded.spec
    model = build_model(spec, loaded.weights, torch.float32, device)
    ids = torch.arange(5, 25, device=device)
    table = [5, 0, 3, 6, 1]  # block size 4: 20 tokens in 5 blocks, out of order on purpose
    pool = KVPool(spec.n_layers, 8, 4, spec.n_kv_heads, spec.head_dim, torch.float32, device)

    def run(start, n):
        meta = AttentionMetadata.paged([n], [start], [table], 4, device, batch_decode)
        positions = torch.arange(start, start + n, device=device)
        return model(ids[start : start + n], positions, meta, pool)

    with torch.no_grad():
        full = model(ids, torch.arange(20, device=device), AttentionMetadata.single(20))
        steps = [run(0, 3), run(3, 7)] + [run(i, 1) for i in range(10, 20)]
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4
