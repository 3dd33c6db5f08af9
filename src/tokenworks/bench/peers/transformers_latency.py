"""Run by a Python with transformers: prints one JSON line (see llamacpp_latency.py)."""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
gguf = Path(a["gguf"])
dtype = getattr(torch, a.get("dtype", "bfloat16"))
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
prefill, decode = [], []
with torch.inference_mode():
    for _ in range(a["repeats"] + 1):
        ids = torch.tensor([a["prompt"]])
        t = time.perf_counter()
        model(ids, use_cache=False)
        prefill.append(ids.shape[1] / (time.perf_counter() - t))
        out = model(torch.tensor([a["short"]]), use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(a["decode_tokens"]):
            out = model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
        decode.append(a["decode_tokens"] / (time.perf_counter() - t))
print(json.dumps({"prefill_tok_s": prefill[1:], "decode_tok_s": decode[1:], "dtype": str(dtype)}))
