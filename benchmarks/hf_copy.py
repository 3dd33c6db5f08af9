"""Write a bfloat16 Hugging Face copy of a tokenworks model for peers that read that format.

    python benchmarks/hf_copy.py [MODEL] [OUT_DIR]      (default: smollm2-135m peers/smol-hf)

The weights are the GGUF's own, dequantised by tokenworks' loader (Q/K rows already in
Hugging Face order), saved with safetensors; the tokenizer comes from transformers' GGUF
reader. vLLM's CPU build then serves exactly the weights tokenworks and llama.cpp use.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from tokenworks.models import load

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
out = Path(sys.argv[2] if len(sys.argv) > 2 else "peers/smol-hf")
out.mkdir(parents=True, exist_ok=True)
loaded = load(model)
s = loaded.spec
if s.arch != "llama":
    raise SystemExit(f"{model}: only Llama-family models are exported ({s.arch})")
skip = {"lm_head.weight"} if s.tie_embeddings else set()
weights = {k: v.to(torch.bfloat16).contiguous() for k, v in loaded.weights.items() if k not in skip}
save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": s.hidden_size,
    "intermediate_size": s.intermediate_size,
    "num_hidden_layers": s.n_layers,
    "num_attention_heads": s.n_heads,
    "num_key_value_heads": s.n_kv_heads,
    "head_dim": s.head_dim,
    "vocab_size": s.vocab_size,
    "rope_theta": s.rope_theta,
    "rms_norm_eps": s.norm_eps,
    "tie_word_embeddings": s.tie_embeddings,
    "max_position_embeddings": s.max_position,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": s.bos_token_id,
    "eos_token_id": list(s.eos_token_ids),
}
(out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
path = Path(loaded.file_path)
AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
print(f"wrote {out}")
