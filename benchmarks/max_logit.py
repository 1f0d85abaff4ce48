"""`return_max_logit=True`: its agreement with the dense path, and what asking for it costs.

    python benchmarks/max_logit.py          # writes benchmarks/results/max_logit.json

Float32, B=2, H=8, L=1024, D=64, causal, a softcap and a bias. Per library (numpy,
torch, JAX under ``jax.jit``) and block size (the default route, tiles of 128):

- ``max_rel_diff_vs_dense``: the largest relative difference between the row max
  returned by that route and the one the dense path (``block_size="dense"``) returns
  for the same inputs: both are exact maxima of the scores each path computed, so this
  is the rounding of the scores' matmul in blocks against one matmul;
- ``time_ratio``: the call with ``return_max_logit=True`` over the same call with
  ``return_lse=True`` (the portable route either way), timed side by side, round-robin;
  the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _timing import interleaved_seconds  # noqa: E402
from report import git_state  # noqa: E402


def _library(name: str) -> tuple[Any, Any, Any]:
    """(convert, wrap a function for the library's default use, sync) of `name`."""
    if name == "torch":
        import torch

        return torch.asarray, (lambda f: f), (lambda x: x)
    if name == "jax":
        import jax
        import jax.numpy as jnp

        return jnp.asarray, jax.jit, jax.block_until_ready
    return np.asarray, (lambda f: f), (lambda x: x)


def measure(name: str, length: int, repeats: int) -> list[dict[str, Any]]:
    from portable_attn import scaled_dot_product_attention

    convert, wrap, sync = _library(name)
    rng = np.random.default_rng(0)
    shape = (2, 8, length, 64)
    q, k, v = (convert(rng.standard_normal(shape, dtype=np.float32)) for _ in range(3))
    bias = convert((0.1 * rng.standard_normal((8, length, length))).astype(np.float32))
    kw = {"is_causal": True, "softcap": 30.0}

    def call(block_size: Any, **flags: Any) -> Any:
        return wrap(
            lambda q, k, v, bias: scaled_dot_product_attention(
                q, k, v, bias=bias, block_size=block_size, **kw, **flags
            )
        )

    dense = np.asarray(call("dense", return_max_logit=True)(q, k, v, bias)[1])
    rows = []
    for block_size in (None, 128):
        with_max = call(block_size, return_max_logit=True)
        with_lse = call(block_size, return_lse=True)
        top = np.asarray(with_max(q, k, v, bias)[1])
        timed = interleaved_seconds(
            {
                "max": lambda f=with_max: f(q, k, v, bias),
                "lse": lambda f=with_lse: f(q, k, v, bias),
            },
            repeats=repeats,
            sync=sync,
        )
        rows.append(
            {
                "library": name,
                "L": length,
                "block_size": block_size,
                "max_rel_diff_vs_dense": float(np.max(np.abs(top - dense) / np.abs(dense))),
                "medians_s": timed.medians,
                "time_ratio": statistics.median(timed.ratios("max", "lse")),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", nargs="+", default=["numpy", "torch", "jax"])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "max_logit.json"))
    args = parser.parse_args()
    rows = [row for name in args.libraries for row in measure(name, args.length, args.repeats)]
    result = {"benchmark": "max_logit", "git": git_state(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
