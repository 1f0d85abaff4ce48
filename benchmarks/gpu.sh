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
import json
from pathlib import Path

import jax, jax.numpy as jnp, numpy as np, torch
from portable_attn import scaled_dot_product_attention as sdpa
from portable_attn._backends import make_backend
from portable_attn._timing import interleaved_seconds

# the one backend table makes the arrays and synchronises; exact=False keeps each
# library's own speed settings. The four implementations are timed interleaved.
tb, jb = make_backend("torch:cuda", exact=False), make_backend("jax:gpu", exact=False)
rng = np.random.default_rng(0)
rows = []
for dtype in ("float16", "bfloat16"):
    for L in (1024, 4096, 16384):
        for causal in (False, True):
            data = [rng.standard_normal((1, 8, L, 64), dtype=np.float32) for _ in range(3)]
            q, k, v = (tb.asarray(a, dtype) for a in data)
            qj, kj, vj = (jb.asarray(tb.to_numpy(x), dtype) for x in (q, k, v))
            t = lambda a: jnp.swapaxes(a, 1, 2)
            cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal, implementation="cudnn"))
            ours_j = jax.jit(lambda q, k, v: sdpa(q, k, v, is_causal=causal, block_size="auto", implementation="portable"))
            fns = {
                "torch_portable_ms": lambda: tb.sync(sdpa(q, k, v, is_causal=causal, block_size="auto", implementation="portable")),
                "torch_sdpa_ms": lambda: tb.sync(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)),
                "jax_portable_ms": lambda: jb.sync(ours_j(qj, kj, vj)),
                "jax_cudnn_ms": lambda: jb.sync(cudnn(qj, kj, vj)),
            }
            medians = interleaved_seconds(fns, repeats=10).medians
            row = {"dtype": dtype, "L": L, "causal": causal, **{name: 1e3 * s for name, s in medians.items()}}
            rows.append(row)
            print(row)
Path("benchmarks/results/gpu.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
PY
