"""The oracle: a float64 NumPy forward pass for both families, picoGPT style.

No cache, no batching, no fusion: one sequence of token ids in, logits for every position
out. Every function says its shapes. It reads the same Hugging Face-named weights as the
engine, so a disagreement is in the engine's arithmetic, not in the loading.
"""

from __future__ import annotations

import numpy as np

from tokenworks.models.spec import ModelSpec
from tokenworks.ops.rope import inv_frequencies


def rms_norm(x, w, eps):  # [n, h], [h] -> [n, h]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer_norm(x, w, b, eps):  # [n, h] -> [n, h]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def softmax(x):  # [..., n] -> [..., n]
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def rope(x, positions, inv_freq):  # [n, heads, d], [n], [d/2] -> [n, heads, d]
    ang = positions[:, None] * inv_freq[None, :]  # [n, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q, k, v, window=None):  # [n, H, d], [n, KVH, d] x2 -> [n, H*d]
    n, h, d = q.shape
    group = h // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [n, H, d]
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)  # [H, n, n]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    scores = np.where(allowed[None], scores, -np.inf)
    return np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(n, h * d)


def llama_forward(ids, w: dict, spec: ModelSpec):  # [n] -> [n, vocab]
    g = lambda name: w[name]  # noqa: E731
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    inv_freq = inv_frequencies(spec).numpy()
    x = g("model.embed_tokens.weight")[ids]  # [n, h]
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, g(p + "input_layernorm.weight"), spec.norm_eps)
        proj = {}
        for name in "qkv":
            proj[name] = h @ g(p + f"self_attn.{name}_proj.weight").T
            if spec.qkv_bias:
                proj[name] = proj[name] + g(p + f"self_attn.{name}_proj.bias")
        q = rope(proj["q"].reshape(n, spec.n_heads, spec.head_dim), pos, inv_freq)
        k = rope(proj["k"].reshape(n, spec.n_kv_heads, spec.head_dim), pos, inv_freq)
        v = proj["v"].reshape(n, spec.n_kv_heads, spec.head_dim)
        x = x + causal_attention(q, k, v, spec.sliding_window) @ g(p + "self_attn.o_proj.weight").T
        h = rms_norm(x, g(p + "post_attention_layernorm.weight"), spec.norm_eps)
        gate = silu(h @ g(p + "mlp.gate_proj.weight").T)  # [n, inter]
        up = h @ g(p + "mlp.up_proj.weight").T
        x = x + (gate * up) @ g(p + "mlp.down_proj.weight").T
    x = rms_norm(x, g("model.norm.weight"), spec.norm_eps)
    head = g("model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight")
    return x @ head.T  # [n, vocab]


def gpt2_forward(ids, w: dict, spec: ModelSpec):  # [n] -> [n, vocab]
    w = {k.removeprefix("transformer."): v for k, v in w.items()}
    n, eps = len(ids), spec.norm_eps
    x = w["wte.weight"][ids] + w["wpe.weight"][:n]  # [n, h]
    for i in range(spec.n_layers):
        p = f"h.{i}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]  # Conv1D: [h, 3h]
        q, k, v = (t.reshape(n, spec.n_heads, spec.head_dim) for t in np.split(qkv, 3, axis=-1))
        x = x + causal_attention(q, k, v) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        h = gelu_tanh(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
    return x @ w["wte.weight"].T


def forward(ids, weights: dict, spec: ModelSpec) -> np.ndarray:
    """float64 logits [n, vocab] for token ids [n]; weights may be torch or NumPy."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    ids = np.asarray(ids, dtype=np.int64)
    fn = {"llama": llama_forward, "gpt2": gpt2_forward}[spec.arch]
    return fn(ids, w, spec)
