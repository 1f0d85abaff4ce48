#!/usr/bin/env bash
# GPU checks for a machine with an NVIDIA GPU (not run on CPU-only machines):
#   1. the test suite on CuPy, torch CUDA and JAX GPU (their GPU kinds stop skipping);
#   2. portable_attn against torch SDPA (flash) and jax.nn.dot_product_attention (cuDNN)
#      at L up to 16384 in float16 and bfloat16, written to benchmarks/results/gpu.json.
# Usage: bash benchmarks/gpu.sh   (needs network access to PyPI for the CUDA wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
python -m venv .venv-gpu
. .venv-gpu/bin/activate
pip install -q "${PORTABLE_ATTN_TORCH_CUDA_SPEC:-torch}" "${PORTABLE_ATTN_JAX_CUDA_SPEC:-jax[cuda12]}" \
    "${PORTABLE_ATTN_CUPY_SPEC:-cupy-cuda12x}" ".[test]"
python -m pytest -q --backend torch,jax,cupy
python - <<'PY'
import json, statistics, time
from pathlib import Path

import jax, jax.numpy as jnp, torch
from portable_attn import scaled_dot_product_attention as sdpa

rows = []
def timed(f, sync, reps=10):
    sync(f()); times = []
    for _ in range(reps):
        t = time.perf_counter(); sync(f()); times.append(time.perf_counter() - t)
    return statistics.median(times)

for dtype in ("float16", "bfloat16"):
    for L in (1024, 4096, 16384):
        for causal in (False, True):
            q, k, v = (torch.randn(1, 8, L, 64, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
            sync = lambda _: torch.cuda.synchronize()
            ours = timed(lambda: sdpa(q, k, v, is_causal=causal, block_size="auto", implementation="portable"), sync)
            flash = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), sync)
            qj, kj, vj = (jnp.asarray(x.float().cpu().numpy(), dtype=getattr(jnp, dtype)) for x in (q, k, v))
            t = lambda a: jnp.swapaxes(a, 1, 2)
            cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal, implementation="cudnn"))
            ours_j = jax.jit(lambda q, k, v: sdpa(q, k, v, is_causal=causal, block_size="auto", implementation="portable"))
            jsync = lambda x: x.block_until_ready()
            row = {"dtype": dtype, "L": L, "causal": causal, "torch_portable_ms": 1e3 * ours,
                   "torch_sdpa_ms": 1e3 * flash, "jax_portable_ms": 1e3 * timed(lambda: ours_j(qj, kj, vj), jsync),
                   "jax_cudnn_ms": 1e3 * timed(lambda: cudnn(qj, kj, vj), jsync)}
            rows.append(row)
            print(row)
Path("benchmarks/results/gpu.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
PY
