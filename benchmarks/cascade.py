"""Cascade attention: a shared prompt read once per group, against a paged call that reads it per request.

    python benchmarks/cascade.py   # writes benchmarks/results/cascade.json

A decode step of R requests sampled from one prompt of Lp tokens (G = 1), each with
its own keys after it (64 to 512), Hq = 32, Hkv = 8, D = 128, float32. Interleaved
medians, per library (NumPy, torch, JAX eager), of:

- ``cascade``: :func:`portable_attn.serving.cascade_attention`, the prompt as one
  (1, Lp, Hkv, D) prefix;
- ``paged``: :func:`portable_attn.serving.ragged_paged_attention` with the prompt kept
  once in the pool and named by every request's table (prefix caching: the same memory,
  the prompt's keys read for each request).

Both compute the same result (checked); ``paged_over_cascade`` is the ratio of times.
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

HQ, HKV, D, PAGE = 32, 8, 128, 16


def problem(requests: int, prompt: int, seed: int = 0) -> dict[str, Any]:
    """Host arrays of both forms of one decode step."""
    rng = np.random.default_rng(seed)
    own = rng.integers(64, 513, size=requests)
    prompt_pages = prompt // PAGE
    own_pages = -(-own // PAGE)
    pool = prompt_pages + int(own_pages.sum())
    key_pages = rng.standard_normal((pool, PAGE, HKV, D), dtype=np.float32)
    value_pages = rng.standard_normal((pool, PAGE, HKV, D), dtype=np.float32)
    width = int(own_pages.max())
    table = np.zeros((requests, width), dtype=np.int64)  # own pages, after the prompt's
    shared = np.zeros((requests, prompt_pages + width), dtype=np.int64)
    nxt = prompt_pages
    for r in range(requests):
        table[r, : own_pages[r]] = np.arange(nxt, nxt + own_pages[r])
        shared[r, :prompt_pages] = np.arange(prompt_pages)
        shared[r, prompt_pages : prompt_pages + own_pages[r]] = table[r, : own_pages[r]]
        nxt += own_pages[r]
    prefix_k = key_pages[:prompt_pages].reshape(1, prompt, HKV, D)
    prefix_v = value_pages[:prompt_pages].reshape(1, prompt, HKV, D)
    return {
        "query": rng.standard_normal((requests, HQ, D), dtype=np.float32),
        "pools": (key_pages, value_pages),
        "prefix": (prefix_k, prefix_v),
        "table": table,
        "shared": shared,
        "own": own.astype(np.int64),
        "starts": np.arange(requests + 1, dtype=np.int64),
        "groups": np.array([0, requests], dtype=np.int64),
        "prompt": prompt,
    }


def calls(library: str, p: dict[str, Any]) -> dict[str, Any]:
    from portable_attn.serving import cascade_attention, ragged_paged_attention

    if library == "numpy":
        on = np.asarray
        sync = None
    elif library == "torch":
        import torch

        on = torch.from_numpy
        sync = None
    else:
        import jax
        import jax.numpy as jnp

        on = jnp.asarray
        sync = jax.block_until_ready
    q = on(p["query"])
    kp, vp = (on(x) for x in p["pools"])
    pk, pv = (on(np.ascontiguousarray(x)) for x in p["prefix"])
    table, shared = on(p["table"]), on(p["shared"])
    own, starts, groups = on(p["own"]), on(p["starts"]), on(p["groups"])
    whole = on(p["own"] + p["prompt"])
    fns = {
        "cascade": lambda: cascade_attention(q, pk, pv, kp, vp, table, own, starts, groups),
        "paged": lambda: ragged_paged_attention(q, kp, vp, shared, whole, starts),
    }
    return {"fns": fns, "sync": sync}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "cascade.json"))
    args = parser.parse_args()
    result: dict[str, Any] = {"git": git_state(), "shape": {"Hq": HQ, "Hkv": HKV, "D": D}}
    rows = {}
    for requests, prompt in ((32, 4096), (8, 16384)):
        p = problem(requests, prompt)
        for library in ("numpy", "torch", "jax"):
            c = calls(library, p)
            got = [np.asarray(f()) for f in c["fns"].values()]
            error = float(np.abs(got[0] - got[1]).max())
            timed = interleaved_seconds(c["fns"], repeats=args.repeats, sync=c["sync"])
            row = {
                "median_s": timed.medians,
                "paged_over_cascade": statistics.median(timed.ratios("paged", "cascade")),
                "max_abs_difference": error,
            }
            rows[f"{library} R={requests} Lp={prompt}"] = row
            print(library, requests, prompt, json.dumps(row), flush=True)
    result["decode"] = rows
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
