#!/usr/bin/env bash
# The checks to run on a lent CUDA machine, as one script (no network there, and the model
# file cannot travel): the test suite's device-parametrised tests on CUDA, every test that
# needs no model file, then engine speed with random weights in the default model's shape.
#   OUT=dir bash benchmarks/gpu_check.sh     (gguf may travel as a wheel in .whl/)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENWORKS_HOME=/tmp/twhome
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
# test files whose clients the image lacks (lm-eval, schemathesis) stay out of collection
IGNORE=()
python3 -c "import lm_eval" 2>/dev/null || IGNORE+=(--ignore tests/test_lm_eval.py)
python3 -c "import schemathesis" 2>/dev/null || IGNORE+=(--ignore tests/test_server_fuzz.py)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# the CUDA path's own tests (bf16/fp16 paged KV, prefix caching, structured output,
# speculation, tiled attention, --compile, the server), then every device-parametrised test
timeout 180 python3 -m pytest -q -p no:cacheprovider -m cuda "${IGNORE[@]}" tests 2>&1 \
  | tee "$OUT/pytest-cuda.log" | tail -12
timeout 180 python3 -m pytest -q -p no:cacheprovider -m "not real_model and not cuda" \
  -k "cuda or not cpu" "${IGNORE[@]}" tests 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout 220 python3 benchmarks/gpu_speed.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/speed.log" \
  | tail -40
