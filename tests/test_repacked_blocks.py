"""Block weights repacked eight rows at a time (csrc/repacked_products.h, kernels/blocks.py).

The oracle is the same as for the file's own layout (tests/test_gguf_blocks.py): the gguf
package's dequantisation and a float64 product, within the bound the 8-bit activations
allow. Beyond it, the repacked products must agree with the file-layout ones up to float32
reassociation, give a token the same bits whatever its batch, and give the same bits on
every path a CPU may take (AVX-512, AVX2 with and without VNNI, plain C).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_blocks import activation_bound, random_blocks, reference

from tokenworks.kernels import abi as ck
from tokenworks.kernels import blocks
from tokenworks.kernels.build import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler here")

REPACKED = [t for t in sorted(blocks.EXECUTED) if library() and library().tw_r8_packs(t)]
IDS = [blocks.EXECUTED[t] for t in REPACKED]


def views(t: int, raw: np.ndarray, rows: int, cols: int) -> tuple:
    """(the file-layout view, the repacked view) of the same blocks."""
    keep: list = []
    stored = blocks.c_linear([blocks.from_array(t, (rows, cols), raw)], None, keep, repack=False)
    packed = blocks.c_linear([blocks.from_array(t, (rows, cols), raw)], None, keep)
    return stored, packed, keep


def test_the_repacked_types_are_the_catalogue_files_types():
    assert IDS == [
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
        "IQ4_NL", "IQ4_XS", "MXFP4",
    ]  # fmt: skip


def test_mxfp4_with_a_scale_float16_cannot_hold_keeps_the_files_layout():
    """MXFP4's record holds its power-of-two scales as float16: a tensor with one outside
    2^-24 .. 2^15 is multiplied in the file's layout, with the same results."""
    t, rows, k = 39, 16, 64
    raw = random_blocks(t, rows, k, 0)
    raw[3, 17] = 160  # one block's scale 2^32
    stored, packed, _keep = views(t, raw, rows, k)
    assert packed.dtype == ck.BLOCKS + t
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    y = blocks.block_linear(x, packed, torch.float32).double().numpy()
    x64, w64 = x.double().numpy(), reference(t, raw, rows, k)
    assert (np.abs(y - x64 @ w64.T) <= activation_bound(x64, w64, 32)).all()
    raw[3, 17] = 143  # 2^15: float16's largest power of two
    assert views(t, raw, rows, k)[1].dtype == ck.R8 + t


@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@settings(max_examples=40, deadline=None)
@given(
    t=st.sampled_from(REPACKED),
    tokens=st.integers(0, 20),
    rows=st.integers(1, 40),
    blocks_per_row=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_repacked_products_hold_the_bound_and_the_file_layouts_sums(
    portable, t, tokens, rows, blocks_per_row, seed
):
    """Any number of rows (not a multiple of 8) and of columns (blocks of 32 that are not a
    multiple of 256), any batch: within the activation bound of the float64 product, and
    within float32 reassociation of the file-layout product."""
    el = blocks.block_shape(t)[0]
    k = el * blocks_per_row
    raw = random_blocks(t, rows, k, seed)
    stored, packed, _keep = views(t, raw, rows, k)
    assert packed.dtype == ck.R8 + t and stored.dtype == ck.BLOCKS + t
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed))
    blocks.use_portable(portable)
    try:
        y = blocks.block_linear(x, packed, torch.float32).double().numpy()
        y_file = blocks.block_linear(x, stored, torch.float32).double().numpy()
    finally:
        blocks.use_portable(False)
    x64, w64 = x.double().numpy(), reference(t, raw, rows, k)
    assert (np.abs(y - x64 @ w64.T) <= activation_bound(x64, w64, 256 if el == 256 else 32)).all()
    scale = np.abs(x64) @ np.abs(w64).T
    assert (np.abs(y - y_file) <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("t", REPACKED, ids=IDS)
def test_a_tokens_result_does_not_depend_on_its_batch(t):
    """Each token alone, and the same tokens in batches of every size up to 17 (a tile at a
    time, and from 8 or 16 tokens two or four tiles at once): the same bits."""
    el = blocks.block_shape(t)[0]
    rows, k = 43, 2 * max(el, 256)  # five whole tiles and a part: pairs and a tile alone
    _, packed, _keep = views(t, random_blocks(t, rows, k, t), rows, k)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(t))
    alone = torch.cat([blocks.block_linear(x[i : i + 1], packed, torch.float32) for i in range(17)])
    for n in range(2, 18):
        assert torch.equal(blocks.block_linear(x[:n], packed, torch.float32), alone[:n]), n


@pytest.mark.parametrize(
    ("flags", "isa"),
    [
        (("-mno-avx512f",), "AVX2"),
        (("-mno-avx512f", "-mno-avxvnni"), "AVX2"),
        (("-mno-avx512f", "-mno-avx2"), "plain C"),
    ],
    ids=["avx2", "avx2-without-vnni", "plain-c"],
)
def test_every_cpu_path_gives_the_same_bits(flags, isa):
    """Built for a CPU without AVX-512 (256-bit vectors, dpbusd where AVX-VNNI is, else
    maddubs and madd) or without AVX2 (plain C): the repacked products equal this build's
    bit for bit, as the plain C path inside this build does."""
    from tokenworks.kernels.build import variant

    if isa == "AVX2" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2 to run an AVX2 build on")
    built = variant(*flags)
    assert blocks.vector_isa(built) == isa
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(0))
    for t in REPACKED:
        _, packed, _keep = views(t, random_blocks(t, 27, 512, t), 27, 512)
        here = blocks.block_linear(x, packed, torch.float32)
        assert torch.equal(blocks.block_linear(x, packed, torch.float32, lib=built), here), t
        blocks.use_portable(True)
        try:
            assert torch.equal(blocks.block_linear(x, packed, torch.float32), here), t
        finally:
            blocks.use_portable(False)


@pytest.mark.parametrize("t", REPACKED, ids=IDS)
def test_the_repacked_rows_cost_about_the_files_bytes(t):
    """Within 4% of the file (Q3_K's scales take a byte each, its file packs them in 6 bits),
    MXFP4 within 6% (a block's scale takes two bytes, 18 for the file's 17)."""
    lib = library()
    el, by = blocks.block_shape(t)
    bound = 18 / 17 if blocks.EXECUTED[t] == "MXFP4" else 1.04
    for rows in (8, 4096, 4097):
        file_bytes = rows * (4096 // el) * by
        assert file_bytes <= lib.tw_r8_bytes(t, rows, 4096) <= bound * file_bytes + 8 * 4096


def _resident(address: int) -> int:
    """Resident bytes of the mapping that holds address (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_repacking_a_view_of_a_mapped_file_gives_its_pages_back(tmp_path):
    """The repacked copy is the process's own memory; the file's pages it was read from
    leave the resident set, so a model is held about once, not twice."""
    t, rows, k = 12, 4096, 4096  # 9 MiB of Q4_K
    path = tmp_path / "blocks.bin"
    random_blocks(t, rows, k, 0).tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="c").reshape(rows, -1)
    w = blocks.from_array(t, (rows, k), mm)
    assert w.mapped
    w.data.sum()  # every page read
    assert _resident(w.data.data_ptr()) >= 0.99 * mm.nbytes
    w.repacked(library())
    assert _resident(w.data.data_ptr()) <= 2 * mmap.PAGESIZE
    y = blocks.block_linear(torch.randn(2, k), blocks.c_linear([w], None, []), torch.float32)
    assert torch.isfinite(y).all()
    copied = blocks.from_array(t, (rows, k), np.array(mm))  # the process's own: not dropped
    assert not copied.mapped and not copied.rows(slice(0, 8)).mapped


PROMPTS = ["Once upon a time, there was a little", "def fibonacci(n):\n"]
LOADED = {"smollm2-135m": "smol_loaded", "gemma3-270m": "gemma3_loaded"}


@pytest.mark.real_model
@pytest.mark.parametrize(
    "name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
)
def test_repacking_keeps_each_catalogue_files_greedy_tokens(name, request):
    """Teacher-forced on the file layout's greedy continuations, the repacked rows pick the
    same next token wherever the file layout's choice is not a near-tie: the two differ by
    float32 reassociation alone, which bfloat16 logits (a step of 1/16 to 1/8 at these
    magnitudes) can tip only where the top two are within two steps."""
    from tokenworks import LLM, SamplingParams
    from tokenworks.models import load

    loaded = request.getfixturevalue(LOADED[name]) if name in LOADED else load(name)
    kw = dict(loaded=loaded, warmup=False, kv_cache_memory=0.25, max_num_seqs=2)
    stored, packed = LLM(name, repack=False, **kw), LLM(name, **kw)
    prompts = [stored.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in stored.generate(prompts, params, use_tqdm=False)]
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt + list(out)
        a = stored.engine.runner.run_uncached(ids)[len(prompt) - 1 : -1].float()
        b = packed.engine.runner.run_uncached(ids)[len(prompt) - 1 : -1].float()
        top2 = a.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        differ = a.argmax(-1) != b.argmax(-1)
        assert not (differ & (margin > 0.25)).any(), margin[differ]
    # the step's products alone (bench records set them beside the whole step) run on both
    from tokenworks.kernels.products_pass import products_pass_seconds

    for llm in (stored, packed):
        assert 0 < products_pass_seconds(llm.engine.c_kernels.forward_pass, repeats=1) < 10
