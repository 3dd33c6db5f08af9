"""Gemma 3 270M, the real model (catalogue `gemma3-270m`, a Q4_K_M GGUF), against
transformers reading the same GGUF: logits past the sliding window, greedy generation,
and its SentencePiece tokenizer rebuilt from the file's metadata.

transformers takes about a minute and a half to read the GGUF (its tokenizer and its
dequantised weights); what it built is kept under $TOKENWORKS_HOME/oracles/, keyed by the
file's sha256, and read back in seconds on later runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tokenworks.models import build_model, catalogue
from tokenworks.ops.attention import AttentionMetadata

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "Hello world!",
    "  two  spaces\tand\ttabs\n\nnew paragraph   ",
    "Grüße aus Köln, naïve café, 日本語のテキスト, Ελληνικά, 😀🎉",
    "Digits 0123456789, 3.14159 and 1,000,000 and 2026-12-01",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "\u00a0non-breaking\u2003em space\u200bzero-width",
    "",
]


@pytest.fixture(scope="session")
def gemma3_oracle(gemma3_loaded):
    """A directory with transformers' own reading of the GGUF: config.json,
    model.safetensors and tokenizer.json."""
    from safetensors.torch import save_file

    entry = catalogue.lookup("gemma3-270m")
    out = catalogue.home() / "oracles" / f"gemma3-270m-{entry.sha256[:16]}"
    if not (out / "done").exists():
        path = catalogue.cached_path(entry)
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
        state.pop("lm_head.weight", None)  # tied to the embeddings
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        hf.config.save_pretrained(out)
        tok.backend_tokenizer.save(str(out / "tokenizer.json"))
        (out / "done").write_text("ok")
        del hf
    return out


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_oracle):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_oracle, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def gemma3_ours(gemma3_loaded):
    return build_model(gemma3_loaded.spec, gemma3_loaded.weights, torch.float32)


def test_the_file_reads_as_gemma_3(gemma3_loaded):
    spec = gemma3_loaded.spec
    assert spec.arch == "gemma3" and spec.sliding_window == 512
    assert [i for i in range(spec.n_layers) if spec.window(i) is None] == [5, 11, 17]
    assert (spec.rope_theta, spec.rope_local_theta) == (1e6, 1e4)
    assert 106 in spec.eos_token_ids  # <end_of_turn> ends a reply


def test_the_rope_tables_fill_as_positions_are_reached(gemma3_loaded):
    """Both of Gemma 3's tables (32k positions, 128 MiB whole) are filled only as far as
    the positions run so far, and rows filled step by step equal the whole table's."""
    from tokenworks.models.llama import ROPE_ROWS, LlamaModel
    from tokenworks.ops.rope import cos_sin_table

    spec = gemma3_loaded.spec
    model = LlamaModel(dataclasses.replace(spec, n_layers=1, vocab_size=8))  # the tables alone
    assert model.rope_filled == 0
    for reached in (1, 700, ROPE_ROWS * 3 + 5):
        model.cover_positions(torch.tensor([0, reached - 1]))
        assert model.rope_filled == -(-reached // ROPE_ROWS) * ROPE_ROWS
    n = model.rope_filled
    for names, rope in ((("cos", "sin"), spec), (("cos_local", "sin_local"), spec.local_rope)):
        whole = cos_sin_table(rope, n)
        for name, table in zip(names, whole, strict=True):
            assert torch.equal(getattr(model, name)[:n], table), name


@pytest.mark.parametrize("n", [1, 700])  # one token, and 188 past the 512-token window
def test_logits_match_transformers_past_the_window(gemma3_ours, gemma3_hf, n):
    ids = torch.randint(3, 262144, (n,), generator=torch.Generator().manual_seed(n))
    ids[0] = 2  # <bos>
    with torch.no_grad():
        ours = gemma3_ours(ids, torch.arange(n), AttentionMetadata.single(n))
        theirs = gemma3_hf(ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3


def test_greedy_generation_matches_transformers(gemma3_loaded, gemma3_hf):
    from tokenworks import LLM, SamplingParams

    llm = LLM(
        "gemma3-270m", dtype="float32", quantization="none", loaded=gemma3_loaded, warmup=False
    )
    chats = [
        [{"role": "user", "content": "Name three colours."}],
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "Count from one to ten: one, two,"}],
    ]
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in chats]
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(12):
                ids.append(int(gemma3_hf(torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[len(p) :])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    solo = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == expected and solo == expected


def test_the_sentencepiece_tokenizer_matches_transformers(gemma3_loaded, gemma3_oracle):
    from tokenizers import Tokenizer

    from tokenworks.tokenizer import TokenizerWrapper

    ours = TokenizerWrapper.from_loaded(gemma3_loaded)
    theirs = Tokenizer.from_file(str(gemma3_oracle / "tokenizer.json"))
    ours_merges = json.loads(ours.tk.to_str())["model"]["merges"]
    assert ours_merges == json.loads(theirs.to_str())["model"]["merges"]
    for text in SAMPLES:
        ids = ours.tk.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.tk.decode(ids, skip_special_tokens=False) == text  # round trip
    assert ours.encode("Hi")[0] == 2  # the file asks for <bos>


def test_the_chat_template_speaks_gemmas_turns(gemma3_loaded):
    from tokenworks.tokenizer import TokenizerWrapper

    tok = TokenizerWrapper.from_loaded(gemma3_loaded)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
        add_generation_prompt=True,
    )  # fmt: skip
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        "Hello!<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_past_the_window_freed_blocks_give_the_mask_only_tokens(gemma3_loaded, gemma3_ours):
    """A 900-token prompt in 256-token chunks, then decoding: with the windowed layers
    giving back the blocks behind their 512-token window, the tokens equal the mask-only
    cache's and those of an uncached pass, and a sequence holds about a third of the KV."""
    from tokenworks import LLM, SamplingParams

    prompt = [2] + torch.randint(
        3, 262144, (899,), generator=torch.Generator().manual_seed(9)
    ).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    held, outputs = {}, {}
    for kv in ("free", "mask"):
        llm = LLM("gemma3-270m", dtype="float32", quantization="none", loaded=gemma3_loaded,
                  warmup=False, max_num_batched_tokens=256, sliding_window_kv=kv)  # fmt: skip
        engine = llm.engine
        seq = engine.add_request(prompt_token_ids=prompt, params=params)
        while not seq.finished:
            engine.step()
            if not seq.finished:
                engine.blocks.check([seq])
                held[kv] = engine.kv_bytes_held(seq)
        outputs[kv] = seq.output_ids
    assert outputs["free"] == outputs["mask"]
    # the oracle: one uncached pass over the prompt and the first five tokens picks each of
    # the six as its most likely next token, as greedy passes token by token would
    ids = prompt + outputs["free"][:-1]
    with torch.no_grad():
        n = len(ids)
        logits = gemma3_ours(torch.tensor(ids), torch.arange(n), AttentionMetadata.single(n))
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == outputs["free"]
    # 15 windowed layers hold 33 blocks of 16 and 3 global ones 57; masking, all 18 hold 57
    assert held["free"] == (15 * 33 + 3 * 57) * 16 * 2 * 256 * 4
    assert held["mask"] == 18 * 57 * 16 * 2 * 256 * 4


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_the_c_forward_takes_gemma_3_and_gives_the_modules_tokens(gemma3_loaded, quantization):
    """Gemma 3 on the C kernels (its four norms, GeGLU, the scaled embedding, Q/K norms and
    the windowed layers' own RoPE base and block tables): a prompt past the window in
    256-token chunks, then decoding, gives the torch modules' tokens, on the dequantised
    weights and on the file's blocks. On the blocks the activations round to 8 bits, where a
    last-bit difference between C's norm and torch's can flip a rounding: there the tokens
    may part at a near-tie (torch scores C's token within 0.5 of its own), nowhere else."""
    from tokenworks import LLM, SamplingParams

    prompt = [2] + torch.randint(
        3, 262144, (700,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    got = {}
    for kernels in ("c", "torch"):
        llm = LLM("gemma3-270m", dtype="float32", quantization=quantization, kernels=kernels,
                  loaded=gemma3_loaded, warmup=False, max_num_batched_tokens=256)  # fmt: skip
        assert (llm.engine.c_kernels is not None) == (kernels == "c")
        got[kernels] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    c, ref = got["c"].token_ids, got["torch"].token_ids
    if quantization == "none" or c == ref:
        assert c == ref
        return
    part = next(i for i, (a, b) in enumerate(zip(c, ref, strict=True)) if a != b)
    scores = {t: lp for t, _, lp in got["torch"].logprobs[part].top}
    assert c[part] in scores and scores[ref[part]] - scores[c[part]] < 0.5, (part, c, ref)
