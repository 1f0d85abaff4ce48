"""Causal vs non-causal time of the tiled path at L = 8192, interleaved to cancel drift.

    python benchmarks/causal.py                      # numpy, torch and jax (those installed)
    python benchmarks/causal.py --backend torch --pairs 7

Block skipping should make causal self-attention cost about half of non-causal.
On a shared machine whose speed drifts between runs, timing the two in separate
sweeps can put them seconds apart; here each repetition times one causal and
one non-causal call back to back (alternating which goes first), and the ratio
is the median of the per-pair ratios. B=1, H=8, D=64, float32, blocks 128 x 256
(JAX: block_size="auto", under jax.jit). Results go to benchmarks/results/causal.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from _timing import interleaved_seconds

from portable_attn.testing import make_backend

RESULTS = Path(__file__).parent / "results"
B, H, D = 1, 8, 64


def _setup(backend: str, length: int):
    from portable_attn import scaled_dot_product_attention as sdpa

    table = make_backend(backend, exact=False)  # the library's own speed settings
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((B, H, length, D), dtype=np.float32) for _ in range(3)]
    arrays = [table.asarray(a) for a in data]
    if backend == "numpy":
        fns = {
            c: (lambda q, k, v, c=c: sdpa(q, k, v, is_causal=c, block_size=(128, 256)))
            for c in (False, True)
        }
    elif backend == "torch":
        import torch

        torch.set_grad_enabled(False)
        fns = {
            c: (
                lambda q, k, v, c=c: sdpa(
                    q, k, v, is_causal=c, block_size=(128, 256), implementation="portable"
                )
            )
            for c in (False, True)
        }
    else:
        import jax

        fns = {
            c: jax.jit(lambda q, k, v, c=c: sdpa(q, k, v, is_causal=c, block_size="auto"))
            for c in (False, True)
        }
    return arrays, table.sync, fns


def measure(backend: str, length: int, pairs: int) -> dict:
    arrays, sync, fns = _setup(backend, length)
    # one causal and one non-causal call per round, alternating which goes first
    calls = {c: (lambda f=f: f(*arrays)) for c, f in fns.items()}
    timed = interleaved_seconds(calls, repeats=pairs, warmup=1, sync=sync)  # warm-up compiles
    ratios = timed.ratios(True, False)
    return {
        "backend": backend,
        "L": length,
        "pairs": pairs,
        "noncausal_ms": 1e3 * timed.medians[False],
        "causal_ms": 1e3 * timed.medians[True],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["numpy", "torch", "jax"], action="append")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "causal.json", help="JSON to write")
    args = parser.parse_args()
    backends = args.backend or [
        b for b in ("numpy", "torch", "jax") if b == "numpy" or importlib.util.find_spec(b)
    ]
    rows = []
    for backend in backends:
        row = measure(backend, args.length, args.pairs)
        rows.append(row)
        print(
            f"{backend:6} L={row['L']}: non-causal {row['noncausal_ms']:8.1f} ms, causal "
            f"{row['causal_ms']:8.1f} ms, causal/non-causal median {row['ratio_median']:.2f} "
            f"(range {row['ratio_min']:.2f}-{row['ratio_max']:.2f} over {row['pairs']} pairs)"
        )
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
