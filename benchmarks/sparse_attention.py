"""Sparse attention: each row's listed keys gathered from a paged pool (``kv_indices``).

    python benchmarks/sparse_attention.py   # writes benchmarks/results/sparse.json

DeepSeek-V3.2-shaped: T = 4096 query rows of one request, each seeing k = 2048 keys
listed from its L = 65536 (sorted random positions), Hq = 16 query heads over one KV
head, D = 512, the values the keys (one pool, K = V), float32, pages of 64 slots.

- ``time``: interleaved medians, per library (torch, NumPy, JAX under ``jit``), of
  ``sparse`` (the call above), ``contiguous`` (the same call, every row listing the same
  2048 consecutive positions: the keys it reads already laid out together) and
  ``dense`` (``scaled_dot_product_attention`` of the rows over those 2048 keys,
  (Hq, T, D) by (1, 2048, D): the default call of the same arithmetic, every row
  sharing one set of keys).
- ``memory``: the peak extra resident memory (MiB) of one sparse call in a fresh
  process (the resident set's peak, reset just before the call, less the resident set
  then: the 128 MiB output included), torch and NumPy, against 16 GiB for the dense
  (T, L) float32 scores of one head.
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

T, K, L, HQ, D, PAGE = 4096, 2048, 65536, 16, 512, 64

#: run in a fresh process: library -> extra MiB of one sparse call on stdout
PROBE = """
import sys
sys.path.insert(0, sys.argv[2])
from sparse_attention import arrays, calls
from _timing import peak_extra_mib
library = sys.argv[1]
fns = calls(library, arrays())
fns["sparse"]()  # once: the library's own first-call allocations are not the call's
print(peak_extra_mib(fns["sparse"]))
"""


def arrays(seed: int = 0) -> dict[str, Any]:
    """Host arrays of the three calls."""
    rng = np.random.default_rng(seed)
    listed = np.sort(
        np.stack([rng.choice(L, size=K, replace=False) for _ in range(T)])[:, None, :], axis=-1
    )
    return {
        "query": rng.standard_normal((T, HQ, D), dtype=np.float32),
        "pool": rng.standard_normal((L // PAGE, PAGE, 1, D), dtype=np.float32),
        "listed": listed.astype(np.int64),
        "contiguous": np.broadcast_to(np.arange(L - K, L)[None, None, :], (T, 1, K)).copy(),
    }


def calls(library: str, a: dict[str, Any]) -> dict[str, Any]:
    """The three calls on `library`'s arrays, each returning its output (synchronised)."""
    from array_api_compat import array_namespace

    from portable_attn import scaled_dot_product_attention
    from portable_attn.serving import ragged_paged_attention

    if library == "jax":
        import jax
        import jax.numpy as jnp

        on: Any = jnp.asarray
        wrap = jax.jit
        sync = jax.block_until_ready
    else:
        if library == "torch":
            import torch

            on = torch.from_numpy
        else:
            on = np.asarray

        def wrap(f: Any) -> Any:
            return f

        def sync(x: Any) -> Any:
            return x

    q, pool = on(a["query"]), on(a["pool"])
    listed, contiguous = on(a["listed"]), on(a["contiguous"])
    xp = array_namespace(q)
    table = on(np.arange(L // PAGE, dtype=np.int64)[None, :])
    lengths = on(np.array([L]))
    starts = on(np.array([0, T]))

    def sparse(q: Any, pool: Any, listed: Any) -> Any:
        return ragged_paged_attention(
            q, pool, None, table, lengths, starts, kv_indices=listed, is_causal=False
        )

    def dense(q: Any, pool: Any) -> Any:
        keys = xp.reshape(pool[-(K // PAGE) :, ...], (1, K, D))  # the last 2048 keys
        out = scaled_dot_product_attention(xp.permute_dims(q, (1, 0, 2)), keys, keys)
        return xp.permute_dims(out, (1, 0, 2))

    sparse_fn, dense_fn = wrap(sparse), wrap(dense)
    return {
        "sparse": lambda: sync(sparse_fn(q, pool, listed)),
        "contiguous": lambda: sync(sparse_fn(q, pool, contiguous)),
        "dense": lambda: sync(dense_fn(q, pool)),
    }


def memory(library: str) -> float:
    probe = [sys.executable, "-c", PROBE, library, str(HERE)]
    done = subprocess.run(probe, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libraries", default="torch,numpy,jax")
    parser.add_argument("--out", default=str(HERE / "results" / "sparse.json"))
    args = parser.parse_args()
    shape = {"T": T, "k": K, "L": L, "Hq": HQ, "Hkv": 1, "D": D, "page_size": PAGE}
    result: dict[str, Any] = {"git": git_state(), "shape": shape}
    a = arrays()
    rows = {}
    for library in args.libraries.split(","):
        fns = calls(library, a)
        contiguous = np.asarray(fns["contiguous"]())
        error = float(np.abs(contiguous - np.asarray(fns["dense"]())).max())
        timed = interleaved_seconds(fns, repeats=args.repeats)
        row = {
            "median_s": timed.medians,
            "sparse_over_contiguous": statistics.median(timed.ratios("sparse", "contiguous")),
            "sparse_over_dense": statistics.median(timed.ratios("sparse", "dense")),
            "contiguous_vs_dense_max_abs_difference": error,
        }
        if library != "jax":
            row["sparse_extra_mib"] = memory(library)
        rows[library] = row
        print(library, json.dumps(row), flush=True)
    result["sparse"] = rows
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
