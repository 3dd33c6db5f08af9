"""The C attention for prompt chunks (kattention.prefill_attention), on AMX tiles and with
AVX-512 BF16 dot products, against the exact answer, torch's attention, and itself cut
differently."""

from __future__ import annotations

import pytest
import torch

from tokenworks.kernels import attention as kattention
from tokenworks.kernels import products
from tokenworks.kernels.batch import KernelBatch
from tokenworks.ops.attention import AttentionMetadata, attention_over_pool, sequence_attention

pytestmark = pytest.mark.skipif(
    not kattention.prefill_available(), reason="neither AMX nor AVX-512 BF16 on this CPU"
)


@pytest.fixture(params=["amx", "vector"])
def amx(request) -> bool:
    """Each test on both paths: the AMX tiles (where they run) and the vector products."""
    if request.param == "amx" and not products.tiles_granted():
        pytest.skip("no AMX tiles on this CPU")
    return request.param == "amx"


H, KVH, D = 9, 3, 64  # SmolLM2-135M's heads: three query heads share each KV head
SCALE = D**-0.5
# (keys already cached, new rows): whole prompts, partial tiles, later chunks, one row
CASES = [(0, 128), (0, 37), (64, 64), (100, 28), (0, 1), (5, 3), (300, 200)]


def _pool(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(slots, KVH, D).bfloat16(), torch.randn(slots, KVH, D).bfloat16()


def _exact(q, keys, values, ctx) -> torch.Tensor:
    """float64 causal attention: q [n, H, D]; keys, values [ctx + n, KVH, D] -> [n, H*D]."""
    n = q.shape[0]
    qq = q.double().transpose(0, 1)
    kk = keys.double().transpose(0, 1).repeat_interleave(H // KVH, 0)
    vv = values.double().transpose(0, 1).repeat_interleave(H // KVH, 0)
    scores = qq @ kk.transpose(1, 2) * SCALE
    seen = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n))[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, H * D)


def _run(q, k_pool, v_pool, seqs, amx) -> torch.Tensor:
    out = torch.full((q.shape[0], H * D), float("nan"), dtype=torch.bfloat16)
    assert kattention.prefill_attention(q, k_pool, v_pool, seqs, SCALE, out, amx=amx)
    return out


def test_prompt_chunks_are_as_close_to_exact_as_torch(amx):
    torch.manual_seed(0)
    k_pool, v_pool = _pool(4096)
    slots = torch.randperm(4096)
    q = torch.randn(sum(n for _, n in CASES), H, D).bfloat16()
    seqs, start, used = [], 0, 0
    for ctx, n in CASES:
        seqs.append((start, n, slots[used : used + ctx + n]))
        start, used = start + n, used + ctx + n
    out = _run(q, k_pool, v_pool, seqs, amx)
    for (start, n, index), (ctx, _) in zip(seqs, CASES, strict=True):
        keys, values = k_pool[index], v_pool[index]
        exact = _exact(q[start : start + n], keys, values, ctx)
        ours = (out[start : start + n].double() - exact).abs().max().item()
        kt, vt = keys.transpose(0, 1), values.transpose(0, 1)
        torch_out = sequence_attention(q[start : start + n], kt, vt, SCALE, None)
        theirs = (torch_out.double() - exact).abs().max().item()
        assert ours <= 1.5 * theirs + 1e-3, (ctx, n, ours, theirs)


def test_a_row_does_not_depend_on_how_the_prompt_is_cut_or_batched(amx):
    torch.manual_seed(1)
    k_pool, v_pool = _pool(1024)
    slots = torch.randperm(1024)[:150]
    q = torch.randn(150, H, D).bfloat16()
    whole = _run(q, k_pool, v_pool, [(0, 150, slots)], amx)
    for cuts in ([7, 16, 50, 77], [1, 149], [64, 64, 22]):
        ctx = 0
        for n in cuts:  # each chunk alone, its context already in the pool
            part = _run(q[ctx : ctx + n], k_pool, v_pool, [(0, n, slots[: ctx + n])], amx)
            assert torch.equal(part, whole[ctx : ctx + n]), (cuts, ctx, n)
            ctx += n
    other = torch.randn(40, H, D).bfloat16()
    batch = torch.cat([other, q])
    seqs = [(0, 40, torch.arange(900, 940)), (40, 150, slots)]
    together = _run(batch, k_pool, v_pool, seqs, amx)
    assert torch.equal(together[40:], whole)


def test_what_the_kernel_cannot_take_goes_to_torch():
    k_pool, v_pool = _pool(64)
    index = torch.arange(10)
    out = torch.empty(10, H * D, dtype=torch.bfloat16)
    q = torch.randn(10, H, D).bfloat16()
    assert not kattention.prefill_attention(q.float(), k_pool, v_pool, [(0, 10, index)], 1.0, out)
    small = torch.randn(10, 8, 32).bfloat16()  # head_dim 32
    pool32 = torch.zeros(64, 4, 32, dtype=torch.bfloat16)
    out32 = torch.empty(10, 8 * 32, dtype=torch.bfloat16)
    assert not kattention.prefill_attention(small, pool32, pool32, [(0, 10, index)], 1.0, out32)
    # a sliding window keeps torch's path: the same answer either way
    meta = AttentionMetadata([10], [0], torch.arange(10), [index])
    batch = KernelBatch.build([10], [0], [list(range(64 // 16))], 16)
    with_kernel = kattention.attend(q, batch, k_pool, v_pool, SCALE, 4)
    without = attention_over_pool(q, meta, k_pool, v_pool, SCALE, 4)
    assert torch.equal(with_kernel, without)
