"""Run by the llama.cpp peer's own Python (llama-cpp-python): prints one JSON line.

argv[1]: JSON {"gguf", "prompts" (token id lists), "max_tokens", "threads", "configs":
[{"name", "num_pred_tokens", "max_ngram_size"} or {"name"} for none]}. Each prompt is
generated greedily once per config, one at a time, timed end to end; llama.cpp's n-gram
speculation is its prompt lookup (LlamaPromptLookupDecoding).
Standalone on purpose: it must not import tokenworks, whose pins differ from the peer's.
"""

import json
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

a = json.loads(sys.argv[1])
longest = max(len(p) for p in a["prompts"])
results = {}
for config in a["configs"]:
    draft = None
    if "num_pred_tokens" in config:
        draft = LlamaPromptLookupDecoding(
            max_ngram_size=config["max_ngram_size"], num_pred_tokens=config["num_pred_tokens"]
        )
    llm = Llama(
        model_path=a["gguf"],
        n_threads=a["threads"],
        n_threads_batch=a["threads"],
        n_ctx=longest + a["max_tokens"] + 64,
        n_batch=longest,
        draft_model=draft,
        logits_all=draft is not None,  # its speculation reads every position's logits
        verbose=False,
    )
    llm.create_completion(a["prompts"][0][:8], max_tokens=4, temperature=0)  # warm-up
    seconds, tokens, outputs = [], [], []
    for prompt in a["prompts"]:
        llm.reset()
        t = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=a["max_tokens"], temperature=0)
        seconds.append(time.perf_counter() - t)
        tokens.append(out["usage"]["completion_tokens"])
        outputs.append(out["choices"][0]["text"])
    results[config["name"]] = {
        "seconds": seconds,
        "completion_tokens": tokens,
        "output_tok_s": sum(tokens) / sum(seconds),
        "texts": outputs,
    }
    del llm
print(json.dumps({"results": results}))
