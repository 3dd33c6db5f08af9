"""Run by the llama.cpp peer's own Python (llama-cpp-python): prints one JSON line.

argv[1]: JSON {"gguf", "prompt", "short", "decode_tokens", "repeats", "threads"}.
Standalone on purpose: it must not import tokenworks, whose pins differ from the peer's.
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
    n_ctx=len(a["prompt"]) + a["decode_tokens"] + 64,
    n_batch=len(a["prompt"]),
    verbose=False,
)
prefill, decode = [], []
for _ in range(a["repeats"] + 1):  # the first round warms up and is dropped
    llm.reset()
    t = time.perf_counter()
    llm.eval(a["prompt"])
    prefill.append(len(a["prompt"]) / (time.perf_counter() - t))
    llm.reset()
    llm.eval(a["short"])
    t = time.perf_counter()
    for _ in range(a["decode_tokens"]):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # greedy, EOS ignored
        llm.eval([tok])
    decode.append(a["decode_tokens"] / (time.perf_counter() - t))
print(json.dumps({"prefill_tok_s": prefill[1:], "decode_tok_s": decode[1:], "dtype": "Q4_1 gguf"}))
