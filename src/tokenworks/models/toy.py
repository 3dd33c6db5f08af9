"""A tiny random-weight Llama with a byte-level tokenizer: the deterministic toy generator.

Fixed seed, fixed weights, 2 layers, generates in milliseconds: for tests of everything
around the model (sampling, stopping, detokenisation, the engine loop) where the real
model's minutes are not needed. Its text is gibberish by design.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tokenworks.models.loaded import LoadedModel
from tokenworks.models.spec import ModelSpec

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    """Ids 0-2 are the specials, 3-258 the 256 byte-level symbols, no merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def toy_spec() -> ModelSpec:
    return ModelSpec(
        arch="llama",
        vocab_size=len(SPECIALS) + 256,
        hidden_size=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position=512,
        norm_eps=1e-5,
        rope_theta=10000.0,
        tie_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="toy",
        source="builtin:toy (random weights, seed 0)",
    )


def toy_weights(spec: ModelSpec, seed: int = 0) -> dict:
    """Random float32 tensors (torch is imported here: the spec alone needs none)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    h, inter = spec.hidden_size, spec.intermediate_size
    w = {
        "model.embed_tokens.weight": rnd(spec.vocab_size, h, std=1.0),
        "model.norm.weight": 1 + rnd(h, std=0.1),
        "lm_head.weight": rnd(spec.vocab_size, h),
    }
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(h, std=0.1)
        w[p + "self_attn.q_proj.weight"] = rnd(spec.q_size, h)
        w[p + "self_attn.k_proj.weight"] = rnd(spec.kv_size, h)
        w[p + "self_attn.v_proj.weight"] = rnd(spec.kv_size, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, spec.q_size)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    return w


def load_toy(weights: bool = True) -> LoadedModel:
    spec = toy_spec()
    return LoadedModel(
        spec=spec,
        weights=toy_weights(spec) if weights else {},
        tokenizer_source={"kind": "object", "tokenizer": byte_tokenizer()},
        chat_template=CHATML,
        model_id="toy",
        file_sha256=None,
        file_path="builtin:toy",
    )
