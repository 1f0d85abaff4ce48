"""Quantized KV pools: an int8 decode step against the same step on the float32 pool.

    python benchmarks/quantized.py   # writes benchmarks/results/quantized.json

One decode step: R = 32 requests with 512-4096 keys (spread evenly), Hq = 32, Hkv = 8,
D = 128, pages of 16 slots. The float32 pool, and the same keys and values quantized
to int8 with a scale per token (``paged_kv_write(..., key_scales=, value_scales=)``).

- ``time``: interleaved medians, per library (torch, NumPy, JAX under ``jit``), of the
  step on the int8 pool and on the float32 pool, and their ratio.
- ``error``: the int8 step's largest difference from the float64 oracle of the
  dequantized pool (the quantization's own rounding is not an error of the call),
  relative to the largest output.
- ``memory``: the peak extra resident memory (MiB) of one step in a fresh process (the
  resident set's peak, reset just before the call, less the resident set then), torch
  and NumPy, int8 and float32 pools, against the float32 pool's size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _timing import interleaved_seconds  # noqa: E402
from report import git_state  # noqa: E402

R, HQ, HKV, D, PAGE = 32, 32, 8, 128, 16

#: run in a fresh process: library, pool -> extra MiB of one step on stdout
PROBE = """
import sys
sys.path.insert(0, sys.argv[3])
from quantized import arrays, calls
from _timing import peak_extra_mib
fns = calls(sys.argv[1], arrays())
fns[sys.argv[2]]()
print(peak_extra_mib(fns[sys.argv[2]]))
"""


def arrays(seed: int = 0) -> dict[str, Any]:
    """Host arrays: both pools (the int8 one written by ``paged_kv_write``) and the step."""
    from portable_attn.serving import paged_kv_write

    rng = np.random.default_rng(seed)
    lengths = np.linspace(512, 4096, R).astype(np.int64)
    pages = -(-lengths // PAGE)
    n_pages = int(pages.sum())
    table = np.zeros((R, int(pages.max())), dtype=np.int64)
    order = rng.permutation(n_pages)
    at = 0
    for r in range(R):
        table[r, : pages[r]] = order[at : at + pages[r]]
        at += pages[r]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    new_k, new_v = rng.standard_normal((2, int(lengths.sum()), HKV, D), dtype=np.float32)
    fk, fv = np.zeros((2, n_pages, PAGE, HKV, D), dtype=np.float32)
    paged_kv_write(fk, fv, table, lengths, starts, new_k, new_v)
    qk, qv = np.zeros((2, n_pages, PAGE, HKV, D), dtype=np.int8)
    ks, vs = np.zeros((2, n_pages, PAGE, HKV), dtype=np.float32)
    paged_kv_write(qk, qv, table, lengths, starts, new_k, new_v, key_scales=ks, value_scales=vs)
    return {
        "query": rng.standard_normal((R, HQ, D), dtype=np.float32),
        "float": (fk, fv),
        "int8": (qk, qv, ks, vs),
        "table": table,
        "lengths": lengths,
        "starts": np.arange(R + 1, dtype=np.int64),
    }


def calls(library: str, a: dict[str, Any]) -> dict[str, Any]:
    """The step on each pool, returning its (synchronised) output."""
    from portable_attn.serving import ragged_paged_attention

    if library == "jax":
        import jax
        import jax.numpy as jnp

        on: Any = jnp.asarray
        wrap, sync = jax.jit, jax.block_until_ready
    else:
        on = np.asarray
        if library == "torch":
            import torch

            on = torch.from_numpy

        def wrap(f: Any) -> Any:
            return f

        def sync(x: Any) -> Any:
            return x

    q = on(a["query"])
    fk, fv = (on(x) for x in a["float"])
    qk, qv, ks, vs = (on(x) for x in a["int8"])
    meta = tuple(on(a[n]) for n in ("table", "lengths", "starts"))

    def quantized(q: Any, qk: Any, qv: Any, ks: Any, vs: Any) -> Any:
        return ragged_paged_attention(q, qk, qv, *meta, key_scales=ks, value_scales=vs)

    def full(q: Any, fk: Any, fv: Any) -> Any:
        return ragged_paged_attention(q, fk, fv, *meta)

    quantized_fn, full_fn = wrap(quantized), wrap(full)
    return {
        "int8": lambda: sync(quantized_fn(q, qk, qv, ks, vs)),
        "float32": lambda: sync(full_fn(q, fk, fv)),
    }


def oracle(a: dict[str, Any]) -> np.ndarray:
    """The decode rows over the dequantized int8 pool, in float64."""
    qk, qv, ks, vs = a["int8"]
    keys = qk.astype(np.float64) * ks[..., None]
    values = qv.astype(np.float64) * vs[..., None]
    out = np.zeros((R, HQ, D))
    for r in range(R):
        n = int(a["lengths"][r])
        k = keys[a["table"][r]].reshape(-1, HKV, D)[:n]
        v = values[a["table"][r]].reshape(-1, HKV, D)[:n]
        for h in range(HQ):
            s = k[:, h // (HQ // HKV)] @ a["query"][r, h].astype(np.float64) / np.sqrt(D)
            w = np.exp(s - s.max())
            out[r, h] = (w / w.sum()) @ v[:, h // (HQ // HKV)]
    return out


def memory(library: str, pool: str) -> float:
    probe = [sys.executable, "-c", PROBE, library, pool, str(HERE)]
    done = subprocess.run(probe, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(HERE / "results" / "quantized.json"))
    args = parser.parse_args()
    shape = {"R": R, "Hq": HQ, "Hkv": HKV, "D": D, "page_size": PAGE, "keys": "512-4096"}
    result: dict[str, Any] = {"git": git_state(), "shape": shape}
    a = arrays()
    result["float32_pool_mib"] = sum(x.nbytes for x in a["float"]) / 2**20
    result["int8_pool_mib"] = sum(x.nbytes for x in a["int8"]) / 2**20
    want = oracle(a)
    rows = {}
    for library in ("torch", "numpy", "jax"):
        fns = calls(library, a)
        got = np.asarray(fns["int8"]())
        timed = interleaved_seconds(fns, repeats=args.repeats)
        row: dict[str, Any] = {
            "median_s": timed.medians,
            "int8_over_float32": statistics.median(timed.ratios("int8", "float32")),
            "relative_error_vs_dequantized_oracle": float(
                np.abs(got - want).max() / np.abs(want).max()
            ),
        }
        if library != "jax":
            row["extra_mib"] = {pool: memory(library, pool) for pool in ("int8", "float32")}
        rows[library] = row
        print(library, json.dumps(row), flush=True)
    result["decode"] = rows
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
