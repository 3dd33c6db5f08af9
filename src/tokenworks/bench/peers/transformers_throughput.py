"""Run by a Python with transformers: offline throughput as one left-padded batch.

argv[1]: JSON {"gguf", "prompts", "output_tokens", "threads", "dtype"}; prints one JSON line.
Standalone on purpose: it must not import tokenworks, whose pins differ from the peer's.
"""

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
prompts = a["prompts"]
width = max(len(p) for p in prompts)
ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
n = a["output_tokens"]
with torch.inference_mode():
    t = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - t
generated = (out.shape[1] - width) * len(prompts)
print(
    json.dumps(
        {
            "elapsed_s": elapsed,
            "output_tokens": generated,
            "output_tok_s": generated / elapsed,
            "mode": "one padded batch",
        }
    )
)
