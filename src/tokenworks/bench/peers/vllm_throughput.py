"""Run by the vLLM CPU peer's own Python: offline throughput through vLLM's LLM.generate.

argv[1]: JSON {"hf_dir", "prompts", "max_tokens", "ignore_eos", "threads"}; prints one line.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams


def main() -> None:
    a = json.loads(sys.argv[1])
    prompts, max_tokens = a["prompts"], a["max_tokens"]
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
    llm = LLM(model=a["hf_dir"], dtype="bfloat16", max_model_len=longest + 16)
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=a.get("ignore_eos", True))
        for n in max_tokens
    ]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        json.dumps(
            {
                "elapsed_s": elapsed,
                "output_tokens": generated,
                "output_tok_s": generated / elapsed,
                "mode": "LLM.generate (offline)",
            }
        )
    )


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main()
