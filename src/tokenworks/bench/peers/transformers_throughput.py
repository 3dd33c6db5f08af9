"""Run by a Python with transformers: offline throughput, one left-padded batch per output
length (a fixed-length workload is one batch).

argv[1]: JSON {"gguf", "prompts", "max_tokens", "ignore_eos", "threads", "dtype"}; prints
one JSON line. Standalone on purpose: it must not import tokenworks, whose pins differ.
"""

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
gguf = Path(a["gguf"])
dtype = getattr(torch, a.get("dtype", "bfloat16"))
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
eos = model.generation_config.eos_token_id
groups = defaultdict(list)  # output length -> prompts
for prompt, n in zip(a["prompts"], a["max_tokens"], strict=True):
    groups[n].append(prompt)
generated = 0
with torch.inference_mode():
    t = time.perf_counter()
    for n, prompts in groups.items():
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n if a.get("ignore_eos", True) else 0,
            do_sample=False,
            pad_token_id=0,
        )
        new = out[:, width:]
        if a.get("ignore_eos", True) or eos is None:
            generated += new.numel()
        else:  # count each row up to and including its first EOS
            for row in new.tolist():
                generated += row.index(eos) + 1 if eos in row else len(row)
    elapsed = time.perf_counter() - t
print(
    json.dumps(
        {
            "elapsed_s": elapsed,
            "output_tokens": generated,
            "output_tok_s": generated / elapsed,
            "mode": "padded batches (one per output length)",
        }
    )
)
