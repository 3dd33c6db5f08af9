"""Loading the default model costs about its file's size in memory, and keeps no copy of
its weights on disk (models/gguf_file.gguf_weights, models/converted.py).

Measured in a fresh process: its resident set once the model's metadata and tokenizer
have been read (what a process that only tokenises holds), then its peak while the engine
loads the weights, builds and generates. The difference is what the weights cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
import gc, json, sys
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch
torch.set_num_threads(2)
from tokenworks import LLM, SamplingParams
from tokenworks.kernels.build import library
from tokenworks.models import load
from tokenworks.tokenizer import TokenizerWrapper
library()
meta = load(sys.argv[1], weights=False)
tok = TokenizerWrapper.from_loaded(meta)
del meta, tok
gc.collect()
base = rss("VmRSS")
llm = LLM(sys.argv[1], kv_cache_memory=0.25, max_num_seqs=1, warmup=False)
llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
engine = llm.engine
print(json.dumps({
    "base": base, "peak": rss("VmHWM"), "file": engine.loaded.file_path,
    "kv": max(s.kv_bytes_in_use for s in engine.stats), "quantization": engine.quantization,
}))
"""


@pytest.mark.real_model
def test_loading_the_default_model_costs_about_its_file():
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, "smollm2-135m"], capture_output=True, text=True, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size = Path(r["file"]).stat().st_size
    assert r["quantization"] == "gguf"
    assert r["peak"] - r["base"] <= 1.5 * size + r["kv"], (r, size)


@pytest.mark.real_model
def test_the_kept_index_holds_no_weights(smol_loaded):
    from tokenworks.models import catalogue, converted

    entry = catalogue.lookup("smollm2-135m")
    kept = converted._dir(converted.key_for(Path(smol_loaded.file_path), entry.sha256))
    size = sum(f.stat().st_size for f in kept.iterdir())
    assert 0 < size < 0.1 * Path(smol_loaded.file_path).stat().st_size
