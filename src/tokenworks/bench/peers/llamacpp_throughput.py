"""Run by llama-cpp-python's Python: the requests one after another (its in-process API
serves one sequence at a time; llama.cpp's batched `llama-server` is the serving peer).

argv[1]: JSON {"gguf", "prompts", "max_tokens", "ignore_eos", "threads"}; prints one line.
"""

import json
import sys
import time

import numpy as np
from llama_cpp import Llama

a = json.loads(sys.argv[1])
llm = Llama(
    model_path=a["gguf"],
    n_threads=a["threads"],
    n_threads_batch=a["threads"],
    n_ctx=max(len(p) + n for p, n in zip(a["prompts"], a["max_tokens"], strict=True)) + 16,
    verbose=False,
)
eos = llm.token_eos()
t = time.perf_counter()
generated = 0
for prompt, n in zip(a["prompts"], a["max_tokens"], strict=True):
    llm.reset()
    llm.eval(prompt)
    for i in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # greedy
        generated += 1
        if (tok == eos and not a.get("ignore_eos", True)) or i == n - 1:
            break  # the last token needs no forward pass
        llm.eval([tok])
elapsed = time.perf_counter() - t
print(
    json.dumps(
        {
            "elapsed_s": elapsed,
            "output_tokens": generated,
            "output_tok_s": generated / elapsed,
            "mode": "sequential, in-process",
        }
    )
)
