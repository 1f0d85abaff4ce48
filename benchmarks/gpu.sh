#!/usr/bin/env bash
# The GPU checks, as one script for the first machine with an NVIDIA GPU (under 10 minutes
# once the wheels are there: PORTABLE_ATTN_GPU_TOTAL seconds after the installs, at most):
#   1. the test suite's GPU kinds (torch:cuda, jax:gpu, cupy), which skip on CPU-only machines;
#   2. benchmarks/gpu.py: portable_attn against torch's FlashAttention and cuDNN SDPA kernels
#      and jax.nn.dot_product_attention with cuDNN, float16 and bfloat16, L up to 16384;
#   3. benchmarks/gpu_features.py: every route the library takes on a GPU against its peer
#      called directly (flex_attention compiled for mask_mod, block_mask, score_mod, softcap,
#      sinks, ALiBi, lse, max logit; SDPA and jax.nn for the serving calls; CuPy), forward
#      and forward+backward, in the time that is left.
# Results: gpu-tests.xml, gpu-tests.json, gpu.json and gpu-features.json in $OUT (default
# benchmarks/results). Each timing script starts no case past its budget and lists the rest.
#
# Usage: bash benchmarks/gpu.sh
#   PORTABLE_ATTN_GPU_VENV    the venv to use or create (default .venv/gpu); it sees the
#                             system's packages, so a machine with CUDA torch/JAX/CuPy
#                             installed needs no download
#   PORTABLE_ATTN_{TORCH,JAX,CUPY}_SPEC   pip specs for what is missing (defaults below)
#   PORTABLE_ATTN_GPU_TOTAL   seconds for steps 1-3 together (570): step 3's budget is what
#                             is left of it less 60 s (its hard stop: budget + 50 s)
#   PORTABLE_ATTN_GPU_TEST_TIMEOUT      seconds for step 1 (240; a slow machine may need more,
#                                       and the total grows with it)
#   PORTABLE_ATTN_GPU_TIMING_BUDGET     step 2's budget in seconds (100)
#   PORTABLE_ATTN_GPU_FEATURES_BUDGET   step 3's budget at most, in seconds (240)
#   PORTABLE_ATTN_GPU_WORKERS   test processes sharing the GPU (8; pytest-xdist)
# The timing scripts' CPU dry runs (no GPU needed): python benchmarks/gpu.py --cpu and
# python benchmarks/gpu_features.py --cpu
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results}"
VENV="${PORTABLE_ATTN_GPU_VENV:-.venv/gpu}"
mkdir -p "$OUT_DIR"

nvidia-smi -L

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"

# install only what is missing: each module with the pip spec that provides it
need=()
"$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || need+=("${PORTABLE_ATTN_TORCH_SPEC:-torch}")
"$PY" -c "import jax; jax.devices('gpu')" 2>/dev/null \
    || need+=("${PORTABLE_ATTN_JAX_SPEC:-jax[cuda12]}")
"$PY" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" 2>/dev/null \
    || need+=("${PORTABLE_ATTN_CUPY_SPEC:-cupy-cuda12x}")
for module in pytest hypothesis array_api_strict array_api_compat threadpoolctl; do
    "$PY" -c "import $module" 2>/dev/null || need+=("${module//_/-}")
done
if [ "${#need[@]}" -gt 0 ]; then
    echo "installing: ${need[*]}"
    "$PY" -m pip install -q "${need[@]}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS  # the time budget counts from here: the installs are not in it
total="${PORTABLE_ATTN_GPU_TOTAL:-570}"
"$PY" -c "import portable_attn, torch, jax; print('portable_attn', portable_attn.__version__, \
'torch', torch.__version__, torch.version.cuda, 'jax', jax.__version__, jax.devices())"

# 1. the GPU kinds of the suite (their ids name the device: torch:cuda, jax:gpu, cupy)
tests_rc=0
# one GPU shared by several test processes: JAX takes memory as it needs it
export XLA_PYTHON_CLIENT_PREALLOCATE=false
workers=()
"$PY" -c "import xdist" 2>/dev/null && workers=(-n "${PORTABLE_ATTN_GPU_WORKERS:-8}")
timeout "${PORTABLE_ATTN_GPU_TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark \
    "${workers[@]}" --backend torch,jax,cupy -k "cuda or gpu or cupy" \
    --junitxml "$OUT_DIR/gpu-tests.xml" || tests_rc=$?
"$PY" - "$OUT_DIR" "$tests_rc" <<'PY'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, rc = Path(sys.argv[1]), int(sys.argv[2])
summary = {"pytest_exit_code": rc}
try:
    suite = ET.parse(out / "gpu-tests.xml").getroot().find("testsuite")
    summary |= {n: int(suite.get(n, 0)) for n in ("tests", "failures", "errors", "skipped")}
    summary["failed"] = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
except (OSError, ET.ParseError) as exc:  # pytest timed out before writing it
    summary["junit"] = f"not read: {exc}"
(out / "gpu-tests.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: v for k, v in summary.items() if k != "failed"}))
PY

# 2. the timings (cases that would start past the budget are listed as skipped)
timing_rc=0
"$PY" benchmarks/gpu.py --out "$OUT_DIR/gpu.json" \
    --budget-s "${PORTABLE_ATTN_GPU_TIMING_BUDGET:-100}" || timing_rc=$?
[ "$timing_rc" -eq 0 ] || echo "gpu.py exited with $timing_rc"

# 3. the features against their peers, in what is left of the total (0: every case listed
# as skipped); SIGTERM at budget + 50 s makes it list what it had not run and write its JSON
left=$((total - (SECONDS - start) - 60))
budget="${PORTABLE_ATTN_GPU_FEATURES_BUDGET:-240}"
[ "$left" -lt "$budget" ] && budget=$left
[ "$budget" -lt 0 ] && budget=0
echo "gpu_features.py: budget ${budget} s ($((SECONDS - start)) s of ${total} s used)"
features_rc=0
timeout -k 20 "$((budget + 50))" "$PY" benchmarks/gpu_features.py \
    --out "$OUT_DIR/gpu-features.json" --budget-s "$budget" || features_rc=$?
[ "$features_rc" -eq 0 ] || echo "gpu_features.py exited with $features_rc"
echo "steps 1-3 took $((SECONDS - start)) s"

# the tests' exit status; else gpu.py's (gpu_features.py stopped at its hard limit is not a failure)
exit "$((tests_rc != 0 ? tests_rc : timing_rc))"
