"""Ready mask rules: chunked attention skips the other chunks' blocks.

    python benchmarks/rules.py                # writes benchmarks/results/rules.json
    python benchmarks/rules.py --repeats 3 --only numpy

B=1, H=8, D=64, float32, L=8192, causal: the default call a user makes,
``scaled_dot_product_attention(q, k, v, is_causal=True)``, against the same call with
``mask_mod=chunked_mask_mod(1024)`` (Llama 4's chunked layers), on NumPy, torch and
JAX under ``jax.jit``; the two timed interleaved, round-robin, in one process
(``_timing.py``): medians, and the ratio as the median of the per-round ratios. On
torch, one more row: torch SDPA called on each chunk alone with ``is_causal=True``
and the outputs concatenated (what a hand-written chunked layer does). Each chunked
output is checked against a float64 oracle computed chunk by chunk (chunked causal
attention is causal attention within each chunk): the largest difference is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _timing import interleaved_seconds  # noqa: E402
from report import git_state  # noqa: E402

from portable_attn import scaled_dot_product_attention  # noqa: E402
from portable_attn.block_mask import chunked_mask_mod  # noqa: E402
from portable_attn.testing import reference_attention  # noqa: E402

B, H, L, D, CHUNK = 1, 8, 8192, 64, 1024


def inputs() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))


def oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention within each chunk, in float64."""
    parts = []
    for s in range(0, L, CHUNK):
        c = slice(s, s + CHUNK)
        parts.append(
            reference_attention(
                *(x[:, :, c].astype(np.float64) for x in (q, k, v)), is_causal=True
            )
        )
    return np.concatenate(parts, axis=-2)


def case(name: str, repeats: int) -> dict[str, Any]:
    q, k, v = inputs()
    rule = chunked_mask_mod(CHUNK)
    sync: Any = None
    if name == "numpy":
        args = (q, k, v)

        def causal() -> Any:
            return scaled_dot_product_attention(*args, is_causal=True)

        def chunked() -> Any:
            return scaled_dot_product_attention(*args, is_causal=True, mask_mod=rule)

        to_numpy = np.asarray
    elif name == "torch":
        import torch

        args = tuple(torch.from_numpy(x) for x in (q, k, v))

        def causal() -> Any:
            return scaled_dot_product_attention(*args, is_causal=True)

        def chunked() -> Any:
            return scaled_dot_product_attention(*args, is_causal=True, mask_mod=rule)

        def to_numpy(x: Any) -> np.ndarray:
            return x.numpy()
    else:
        import jax
        import jax.numpy as jnp

        args = tuple(jnp.asarray(x) for x in (q, k, v))
        plain = jax.jit(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True))
        ruled = jax.jit(
            lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, mask_mod=rule)
        )

        def causal() -> Any:
            return plain(*args)

        def chunked() -> Any:
            return ruled(*args)

        to_numpy = np.asarray

        def sync(x: Any) -> Any:
            return x.block_until_ready()

    fns = {"causal": causal, "chunked": chunked}
    if name == "torch":
        import torch
        import torch.nn.functional as F

        def per_chunk() -> Any:
            outs = [
                F.scaled_dot_product_attention(
                    *(x[:, :, s : s + CHUNK] for x in args), is_causal=True
                )
                for s in range(0, L, CHUNK)
            ]
            return torch.cat(outs, dim=-2)

        fns["sdpa_per_chunk"] = per_chunk
    out = to_numpy(chunked())
    assert out.dtype == np.float32, out.dtype
    error = float(np.abs(out - oracle(q, k, v)).max())
    timed = interleaved_seconds(fns, repeats=repeats, warmup=1, sync=sync)
    result = {
        "median_s": timed.medians,
        "chunked_vs_causal": float(np.median(timed.ratios("chunked", "causal"))),
        "max_abs_error_vs_float64": error,
    }
    if "sdpa_per_chunk" in fns:
        result["chunked_vs_sdpa_per_chunk"] = float(
            np.median(timed.ratios("chunked", "sdpa_per_chunk"))
        )
    print(name, json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="numpy,torch,jax")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "rules.json"))
    args = parser.parse_args()
    result: dict[str, Any] = {
        "git": git_state(),
        "shape": {"B": B, "H": H, "L": L, "D": D, "chunk": CHUNK, "dtype": "float32"},
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }
    for name in args.only.split(","):
        result[name] = case(name, args.repeats)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
