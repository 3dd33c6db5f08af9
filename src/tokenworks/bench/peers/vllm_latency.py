"""Run by the vLLM CPU peer's own Python: prints one JSON line (see llamacpp_latency.py).

vLLM reads a Hugging Face directory ("hf_dir": a bfloat16 copy of the same GGUF). Decode
speed is the difference of two runs of the same short prompt, 1 and 1 + N new tokens, so
both include the same scheduling overhead.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams


def main() -> None:
    a = json.loads(sys.argv[1])
    llm = LLM(
        model=a["hf_dir"],
        dtype="bfloat16",
        max_model_len=len(a["prompt"]) + a["decode_tokens"] + 64,
        enable_prefix_caching=False,  # the repeated prompt must be computed each time
    )

    def timed(ids, n):
        t = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        return time.perf_counter() - t

    prefill, decode = [], []
    for _ in range(a["repeats"] + 1):
        prefill.append(len(a["prompt"]) / timed(a["prompt"], 1))
        one = timed(a["short"], 1)
        many = timed(a["short"], a["decode_tokens"] + 1)
        decode.append(a["decode_tokens"] / (many - one))
    print(
        json.dumps({"prefill_tok_s": prefill[1:], "decode_tok_s": decode[1:], "dtype": "bfloat16"})
    )


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
