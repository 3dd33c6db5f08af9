"""Run by llama-cpp-python's Python: the requests one after another (its in-process API
serves one sequence at a time; llama.cpp's batched `llama-server` is the serving peer).

argv[1]: JSON {"gguf", "prompts", "output_tokens", "threads"}; prints one JSON line.
"""

import json
import sys
import time

import numpy as np
from llama_cpp import Llama

a = json.loads(sys.argv[1])
n = a["output_tokens"]
llm = Llama(
    model_path=a["gguf"],
    n_threads=a["threads"],
    n_threads_batch=a["threads"],
    n_ctx=max(len(p) for p in a["prompts"]) + n + 16,
    verbose=False,
)
t = time.perf_counter()
generated = 0
for prompt in a["prompts"]:
    llm.reset()
    llm.eval(prompt)
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # greedy, EOS ignored
        generated += 1
        if generated % n:  # the last token needs no forward pass
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
