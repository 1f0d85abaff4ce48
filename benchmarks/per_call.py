"""What a call's Python costs: torch's in a loop of its own and right after a kernel,
NumPy's as a ratio to the float32 textbook.

    python benchmarks/per_call.py          # writes benchmarks/results/per-call-torch.json
    python benchmarks/per_call.py numpy    # writes benchmarks/results/per-call-numpy.json

NumPy: the default call on (1, 1, 8, 8) float32 (a repeated call: the cache's hit) and the
float32 textbook (``q @ kᵀ * (1 / math.sqrt(d))``, max-subtracted softmax, ``@ v``),
interleaved, 100 calls a sample; medians and the median per-round ratio (target: at most
2x, issue 46).

Evidence for the cache's kept kernel call (``portable_attn/_lib/_cache.py``). B=1, H=8,
D=64, bfloat16, L = 1024, the last quarter of the keys masked (padding), in one fresh
process:

- ``route_python_us``: the full route of the default call (nothing kept: every check,
  the plan, the route, the native route's masks) with the kernel replaced by a
  function returning its output,
  timed back to back (``hot``) and each call right after an untimed SDPA call of the
  same inputs (``after_kernel``: the kernel leaves that Python's code and data out of
  the caches), medians of 201 calls;
- ``vs_sdpa``: the default call (a repeated call: the kept kernel call alone), the
  same call by the full route (nothing kept), and SDPA in bfloat16, each sample after
  the same untimed projection ``X W`` in bfloat16, interleaved; medians and the
  median per-round ratio to SDPA.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import report
from _timing import interleaved_seconds

RESULTS = Path(__file__).parent / "results"
B, H, L, D = 1, 8, 1024, 64


def main() -> int:
    import torch
    import torch.nn.functional as F

    from portable_attn import scaled_dot_product_attention
    from portable_attn._lib import _cache
    from portable_attn._paths import _native

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(torch.bfloat16) for _ in range(3))
    mask = torch.arange(L)[None, None, None, :] < (3 * L) // 4
    x = torch.randn(B * L, H * D, generator=gen).to(torch.bfloat16)
    w = torch.randn(H * D, H * D, generator=gen).to(torch.bfloat16) / math.sqrt(H * D)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def full_route():
        _cache.forget()  # nothing kept: the checks, the plan, the route, the masks
        return scaled_dot_product_attention(q, k, v, mask=mask)

    out = {**report.git_state(), "B": B, "H": H, "L": L, "D": D, "dtype": "bfloat16"}
    out["torch"], out["threads"] = torch.__version__, torch.get_num_threads()
    with torch.no_grad():
        assert sdpa().dtype == torch.bfloat16
        result = sdpa()
        kernel = _native._torch
        _native._torch = lambda *args, **kwargs: result  # the route's Python alone
        try:
            hot, cold = [], []
            for _ in range(201):
                start = time.perf_counter()
                full_route()
                hot.append(time.perf_counter() - start)
            for _ in range(201):
                sdpa()
                start = time.perf_counter()
                full_route()
                cold.append(time.perf_counter() - start)
        finally:
            _native._torch = kernel
        out["route_python_us"] = {
            "hot": 1e6 * statistics.median(hot),
            "after_kernel": 1e6 * statistics.median(cold),
        }
        fns = {
            "default": lambda: scaled_dot_product_attention(q, k, v, mask=mask),
            "full_route": full_route,
            "sdpa": sdpa,
        }
        torch.testing.assert_close(fns["default"](), sdpa(), rtol=0, atol=0)
        res = interleaved_seconds(fns, repeats=101, before=lambda: x @ w)
    out["vs_sdpa"] = {
        "ms": {n: 1e3 * t for n, t in res.medians.items()},
        "ratio": {n: statistics.median(res.ratios(n, "sdpa")) for n in fns if n != "sdpa"},
    }
    print(json.dumps({k: out[k] for k in ("route_python_us", "vs_sdpa")}, indent=1))
    (RESULTS / "per-call-torch.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


def numpy_main() -> int:
    import numpy as np

    from portable_attn import scaled_dot_product_attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 8, 8), dtype=np.float32) for _ in range(3))
    scale = np.float32(1 / math.sqrt(q.shape[-1]))

    def textbook():
        s = (q @ np.swapaxes(k, -1, -2)) * scale
        e = np.exp(s - np.max(s, axis=-1, keepdims=True))
        return (e / np.sum(e, axis=-1, keepdims=True)) @ v

    fns = {"default": lambda: scaled_dot_product_attention(q, k, v), "textbook": textbook}
    for f in fns.values():
        assert f().dtype == np.float32
    np.testing.assert_allclose(fns["default"](), textbook(), rtol=1e-5, atol=1e-6)
    res = interleaved_seconds(fns, repeats=201, warmup=5, number=100)
    out = {**report.git_state(), "shape": [1, 1, 8, 8], "dtype": "float32"}
    out["numpy"] = np.__version__
    out["us"] = {n: 1e6 * t for n, t in res.medians.items()}
    out["ratio_vs_textbook"] = statistics.median(res.ratios("default", "textbook"))
    print(json.dumps({k: out[k] for k in ("us", "ratio_vs_textbook")}, indent=1))
    (RESULTS / "per-call-numpy.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(main() if args == [] else numpy_main() if args == ["numpy"] else 2)
