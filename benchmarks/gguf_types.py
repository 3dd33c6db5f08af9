"""Write a catalogue model in other GGUF block types with llama.cpp's own quantiser, for
`tokenworks bench quant` to measure each type beside llama-bench on the same file.

    python benchmarks/gguf_types.py MODEL [--types Q2_K,Q3_K_M,...] [--out DIR]

The float source is the model's file dequantised to float16 (metadata copied, Q/K rows as
stored), the only float weights to hand without a download: every type's perplexity is
then against those weights, and its own error adds to the file's. llama-quantize comes
from benchmarks/peers.sh (peers/llamacpp/bin). Prints the paths written, comma-separated.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from tokenworks.models import catalogue

TYPES = "Q2_K,Q3_K_M,IQ4_NL,IQ4_XS,Q5_K_M,Q6_K,Q8_0"


def write_f16(source: Path, out: Path) -> Path:
    """source's metadata and its tensors dequantised: matrices float16, the rest float32."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in tqdm(reader.tensors, desc=f"f16 {source.name}", unit="tensor"):
        shape = tuple(int(d) for d in reversed(t.shape))
        dense = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        w.add_tensor(t.name, dense.astype(np.float16 if len(shape) == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a catalogue name or a .gguf path")
    p.add_argument("--types", default=TYPES, help="llama-quantize's type names, comma-separated")
    p.add_argument("--out", default="peers/types", help="where the files go")
    p.add_argument("--peers-dir", default="peers", help="where peers.sh put llama.cpp")
    args = p.parse_args()
    source = Path(args.model) if args.model.endswith(".gguf") else catalogue.pull(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(args.model).stem if args.model.endswith(".gguf") else args.model
    f16 = out / f"{stem}-F16.gguf"
    if not f16.exists():
        write_f16(source, f16)
    quantize = Path(args.peers_dir) / "llamacpp" / "bin" / "llama-quantize"
    written = [f16]
    for name in tqdm(args.types.split(","), desc="llama-quantize", unit="type"):
        path = out / f"{stem}-{name}.gguf"
        if not path.exists():
            subprocess.run([str(quantize), str(f16), str(path), name], check=True,
                           capture_output=True)  # fmt: skip
        written.append(path)
    print(",".join(str(p) for p in written))


if __name__ == "__main__":
    main()
