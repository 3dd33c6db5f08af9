"""Loading a GGUF costs about its file's size in memory, and keeps no copy of its weights
on disk (models/gguf_file.gguf_weights, kernels/blocks.BlockTensor.repacked,
models/converted.py): the four catalogue files and a 4.4 GB file of Qwen2-7B's shapes.

Measured in a fresh process: its resident set once the model's metadata and tokenizer
have been read (what a process that only tokenises holds), then, its peak reset, the peak
while the engine loads the weights, repacks them, builds and generates. The difference is
what the weights cost, less the shared libraries' code the run touched: the kernel maps
those pages in folios whose size depends on what other processes read before, which is
noise of the machine, not the model's (the file's own mapping is counted).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenworks.bench import synthetic
from tokenworks.models import catalogue, converted

_CHILD = """
import gc, json, sys
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def libraries():  # resident bytes of mapped files other than the model's
    total, lib = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5:  # a mapping's first line
            lib = len(head) == 6 and head[5].startswith("/") and not head[5].endswith(".gguf")
        elif head[0] == "Rss:" and lib:
            total += int(head[1]) * 1024
    return total
import torch
torch.set_num_threads(2)
from tokenworks import LLM, SamplingParams
from tokenworks.engine.host_memory import release_freed_memory
from tokenworks.kernels.build import library
from tokenworks.models import load
from tokenworks.tokenizer import TokenizerWrapper
library()
meta = load(sys.argv[1], weights=False)
tok = TokenizerWrapper.from_loaded(meta)
gc.collect()
release_freed_memory()
base, libs = rss("VmRSS"), libraries()
del meta, tok  # (the engine reads its own)
gc.collect()
release_freed_memory()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM from here on
llm = LLM(sys.argv[1], kv_cache_memory=0.25, max_num_seqs=1, warmup=False)
llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
engine = llm.engine
print(json.dumps({
    "base": base, "peak": rss("VmHWM"), "file": engine.loaded.file_path,
    "libraries": libraries() - libs,
    "kv": max(s.kv_bytes_in_use for s in engine.stats), "quantization": engine.quantization,
}))
"""

_SEVEN_B = "qwen2-7b-shapes"


def _model(name: str) -> str:
    if name == _SEVEN_B:  # written once under $TOKENWORKS_HOME (random weights)
        return str(synthetic.qwen2_7b_q4_k_m(str(catalogue.pull("smollm2-135m"))))
    return name


@pytest.mark.real_model
@pytest.mark.parametrize("name", [*catalogue.CATALOGUE, _SEVEN_B])
def test_loading_a_file_costs_about_its_size(name):
    model = _model(name)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model], capture_output=True, text=True, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size = Path(r["file"]).stat().st_size
    assert r["quantization"] == "gguf"
    assert r["peak"] - r["base"] - r["libraries"] <= 1.2 * size + r["kv"], (r, size)
    # the index kept of its metadata and tokenizer: a small part of the file, no weights
    sha = catalogue.lookup(name).sha256 if name in catalogue.CATALOGUE else None
    kept = converted._dir(converted.key_for(Path(r["file"]), sha))
    assert 0 < sum(f.stat().st_size for f in kept.iterdir()) < 0.05 * size
