"""The oracle: a float64 NumPy forward pass for every family, picoGPT style.

No cache, no batching, no fusion: one sequence of token ids in, logits for every position
out. Every function says its shapes. It reads the same Hugging Face-named weights as the
engine, so a disagreement is in the engine's arithmetic, not in the loading.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenworks.kernels.block_linear import dense
from tokenworks.models.arch import family
from tokenworks.models.spec import ModelSpec
from tokenworks.ops.rope import inv_frequencies
from tokenworks.ops.rope_scaling import attention_factor


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


def rope(x, positions, inv_freq, scale=1.0):  # [n, heads, d], [n], [d/2] -> [n, heads, d]
    ang = positions[:, None] * inv_freq[None, :]  # [n, d/2]
    cos, sin = scale * np.cos(ang)[:, None, :], scale * np.sin(ang)[:, None, :]  # scale: YaRN
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q, k, v, window=None, scale=None, softcap=None, sinks=None):  # [n, H*d]
    n, h, d = q.shape  # q [n, H, d]; k, v [n, KVH, d]
    group = h // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [n, H, d]
    scores = np.einsum("qhd,khd->hqk", q, k) * (scale or 1 / np.sqrt(d))  # [H, n, n]
    if softcap is not None:  # Gemma 2
        scores = np.tanh(scores / softcap) * softcap
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    scores = np.where(allowed[None], scores, -np.inf)
    if sinks is not None:  # gpt-oss: one more logit per head in the denominator, no value
        column = np.broadcast_to(sinks[:, None, None], (h, n, 1))
        probs = softmax(np.concatenate([scores, column], axis=-1))[..., :-1]
    else:
        probs = softmax(scores)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(n, h * d)


def gqa(x, w, p, spec, pos, inv_freq, window=None):  # [n, h] -> [n, h]: grouped-query
    n = len(x)
    proj = {}
    for name in "qkv":
        proj[name] = x @ w[p + f"self_attn.{name}_proj.weight"].T
        if spec.qkv_bias:
            proj[name] = proj[name] + w[p + f"self_attn.{name}_proj.bias"]
    if spec.qk_norm_whole:  # OLMo 2: all of q, and all of k, normed at once
        proj["q"] = rms_norm(proj["q"], w[p + "self_attn.q_norm.weight"], spec.norm_eps)
        proj["k"] = rms_norm(proj["k"], w[p + "self_attn.k_norm.weight"], spec.norm_eps)
    q = proj["q"].reshape(n, spec.n_heads, spec.head_dim)
    k = proj["k"].reshape(n, spec.n_kv_heads, spec.head_dim)
    if spec.qk_norm and not spec.qk_norm_whole:  # Qwen3: each head's q and k normed
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], spec.norm_eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], spec.norm_eps)
    af = attention_factor(spec)
    if inv_freq is not None:  # None: a NoPE layer (SmolLM3)
        q, k = rope(q, pos, inv_freq, af), rope(k, pos, inv_freq, af)
        if spec.qk_rms_norm:  # Llama 4: after RoPE, without a weight
            ones = np.ones(spec.head_dim)
            q, k = rms_norm(q, ones, spec.norm_eps), rms_norm(k, ones, spec.norm_eps)
    qt = spec.query_temperature
    if qt is not None and (inv_freq is None or not qt.nope_only):
        q = q * qt.factors(torch.from_numpy(pos).long()).numpy()[:, None, None]
    v = proj["v"].reshape(n, spec.n_kv_heads, spec.head_dim)
    sinks = w[p + "self_attn.sinks"] if spec.attn_sinks else None
    a = causal_attention(q, k, v, window, spec.attn_scale, spec.attn_softcap, sinks)
    out = a @ w[p + "self_attn.o_proj.weight"].T
    return out + w[p + "self_attn.o_proj.bias"] if spec.attn_out_bias else out


def mla(x, w, p, spec, pos, inv_freq):  # [n, h] -> [n, h]: latent attention, expanded
    m, n, heads = spec.mla, len(x), spec.n_heads
    a = p + "self_attn."
    if m.q_lora_rank:
        cq = rms_norm(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], spec.norm_eps)
        q = cq @ w[a + "q_b_proj.weight"].T
    else:
        q = x @ w[a + "q_proj.weight"].T
    q = q.reshape(n, heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_nope, q_rope = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
    ckv = x @ w[a + "kv_a_proj_with_mqa.weight"].T  # [n, r + rope]
    c = rms_norm(ckv[:, : m.kv_lora_rank], w[a + "kv_a_layernorm.weight"], spec.norm_eps)
    af = attention_factor(spec)
    k_rope = rope(ckv[:, None, m.kv_lora_rank :], pos, inv_freq, af)  # [n, 1, rope]: one for all
    kv = (c @ w[a + "kv_b_proj.weight"].T).reshape(n, heads, m.qk_nope_head_dim + m.v_head_dim)
    k = np.concatenate([kv[..., : m.qk_nope_head_dim], np.repeat(k_rope, heads, 1)], -1)
    q = np.concatenate([q_nope, rope(q_rope, pos, inv_freq, af)], -1)
    v = kv[..., m.qk_nope_head_dim :]  # [n, H, v]
    scores = np.einsum("qhd,khd->hqk", q, k) * (spec.attn_scale or 1 / np.sqrt(q.shape[-1]))
    scores = np.where(np.tri(n, dtype=bool)[None], scores, -np.inf)
    out = np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(n, -1)
    return out @ w[a + "o_proj.weight"].T


def gated_mlp(x, w, p, act=silu):  # [n, h] -> [n, h]: SwiGLU (GeGLU with gelu_tanh)
    return (act(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[
        p + "down_proj.weight"
    ].T


def oai_expert(x, w, p, m):  # [n, h] -> [n, h]: gpt-oss's expert, biased and clamped
    gate = np.minimum(x @ w[p + "gate_proj.weight"].T + w[p + "gate_proj.bias"], m.swiglu_limit)
    up = np.clip(x @ w[p + "up_proj.weight"].T + w[p + "up_proj.bias"], -m.swiglu_limit,
                 m.swiglu_limit)  # fmt: skip
    act = gate / (1 + np.exp(-m.swiglu_alpha * gate)) * (up + 1)
    return act @ w[p + "down_proj.weight"].T + w[p + "down_proj.bias"]


def route(x, w, p, m):  # [n, h] -> (weights [n, k], expert ids [n, k])
    logits = x @ w[p + "mlp.gate.weight"].T  # [n, E]
    if m.router_bias:
        logits = logits + w[p + "mlp.gate.bias"]
    if m.scoring == "topk_softmax":  # gpt-oss: softmax over the chosen logits alone
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, : m.top_k]
        return softmax(np.take_along_axis(logits, ids, axis=-1)) * m.routed_scaling_factor, ids
    scores = softmax(logits) if m.scoring == "softmax" else 1 / (1 + np.exp(-logits))
    choice = scores + w[p + "mlp.gate.e_score_correction_bias"] if m.score_bias else scores
    if m.n_group > 1:  # a group's score: its best two (or best); the best topk_group compete
        g = choice.reshape(len(x), m.n_group, -1)
        group_score = np.sort(g, axis=-1)[..., -2 if m.group_scoring == "top2" else -1 :].sum(-1)
        worst = np.argsort(-group_score, axis=-1)[:, m.topk_group :]
        np.put_along_axis(g, worst[..., None], -np.inf, axis=1)
        choice = g.reshape(len(x), -1)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, : m.top_k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if m.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * m.routed_scaling_factor, ids


def moe(x, w, p, m):  # [n, h] -> [n, h]: each token through its top-k experts
    weights, ids = route(x, w, p, m)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for j, e in enumerate(ids[t]):
            e_p = f"{p}mlp.experts.{e}."
            xt = x[t : t + 1] * (weights[t, j] if m.weighted_inputs else 1.0)
            y = oai_expert(xt, w, e_p, m) if m.act == "swiglu_oai" else gated_mlp(xt, w, e_p)
            out[t] += y[0] if m.weighted_inputs else weights[t, j] * y[0]
    if m.shared_intermediate:
        shared = gated_mlp(x, w, p + "mlp.shared_experts.")
        if m.shared_gate:
            shared = shared / (1 + np.exp(-(x @ w[p + "mlp.shared_expert_gate.weight"].T)))
        out = out + shared
    return out


def llama_forward(ids, w: dict, spec: ModelSpec):  # [n] -> [n, vocab]
    n, eps = len(ids), spec.norm_eps
    pos = np.arange(n, dtype=np.float64)
    inv_freq = inv_frequencies(spec).numpy()
    if spec.local_rope is not None:  # Gemma 3's windowed layers: their own base
        local_freq = inv_frequencies(spec.local_rope).numpy()
    x = w["model.embed_tokens.weight"][ids]  # [n, h]
    if spec.embed_scale is not None:
        x = x * spec.embed_scale
    act = silu if spec.mlp_act == "silu" else gelu_tanh
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        window = spec.window(i)
        freq = local_freq if spec.rope_local_theta is not None and window else inv_freq
        if i in spec.nope_layers:
            freq = None
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps) if spec.pre_norms else x
        a = mla(h, w, p, spec, pos, freq) if spec.mla else gqa(h, w, p, spec, pos, freq, window)
        if spec.sandwich_norms:
            a = rms_norm(a, w[p + "attn_output_norm.weight"], eps)
        x = x + a * (spec.residual_scale or 1.0)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps) if spec.pre_norms else x
        m = moe(h, w, p, spec.moe) if spec.is_moe_layer(i) else gated_mlp(h, w, p + "mlp.", act)
        if spec.sandwich_norms:
            m = rms_norm(m, w[p + "mlp_output_norm.weight"], eps)
        x = x + m * (spec.residual_scale or 1.0)
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"]
    logits = x @ head.T  # [n, vocab]
    if spec.logit_scale is not None:
        logits = logits / spec.logit_scale
    if spec.final_softcap is not None:
        logits = np.tanh(logits / spec.final_softcap) * spec.final_softcap
    return logits


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
    w = {k: np.asarray(dense(v), dtype=np.float64) for k, v in weights.items()}  # blocks too
    ids = np.asarray(ids, dtype=np.int64)
    fn = {"decoder": llama_forward, "gpt2": gpt2_forward}[family(spec.arch).module]
    return fn(ids, w, spec)
