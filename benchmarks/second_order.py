"""Second derivatives: a gradient differentiated again, against a training step.

    python benchmarks/second_order.py   # writes benchmarks/results/second-order.json

- ``memory``: the peak extra resident memory (MiB) of one causal call (the resident
  set's peak, reset just before it, less the resident set then), each in a fresh
  process, B=1, H=8, D=64, float32: a training step (forward, backward) and a
  Hessian-vector product of the same loss -- torch: a double backward
  (``torch.autograd.grad(..., create_graph=True)``, then ``grad`` of the gradient's dot
  with a tangent); JAX: ``jax.jvp`` of ``jax.grad`` under ``jit`` (forward over
  reverse). The default call, at L = 4096 and 16384; the dense path at 4096 (at 16384
  one of its (H, L, L) float32 arrays is 8 GiB).
- ``memory_tuned``: torch's rows again with glibc's mmap threshold fixed at 128 KiB
  (``MALLOC_MMAP_THRESHOLD_=131072``), a setting, not the default: glibc raises its
  threshold to the largest block it has freed, and then keeps the many freed
  mid-size blocks of a recorded backward in its heap, which the resident set counts.
- ``time``: interleaved medians (torch, L = 4096, H = 8): the double backward's step
  against the training step.
- ``hook``: what the hook that makes SDPA's fused kernels twice differentiable costs a
  training step that never differentiates twice: interleaved medians of the default
  call's forward + backward with the hook and without it (L = 64 and 1024, H = 8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _timing import interleaved_seconds  # noqa: E402
from report import git_state  # noqa: E402

#: run in a fresh process: library, what, block_size, L -> extra MiB on stdout
PROBE = """
import sys
import numpy as np
library, what, block, L = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, sys.argv[5])
from _timing import peak_extra_mib
from portable_attn import scaled_dot_product_attention
kw = {} if block == "default" else {"block_size": block}
rng = np.random.default_rng(0)
host = [rng.standard_normal((1, 8, L, 64), dtype=np.float32) for _ in range(5)]
if library == "torch":
    import torch
    q, k, v, c, t = (torch.from_numpy(x) for x in host)

    def step(q, k, v, c, t):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        if what == "train":
            return torch.autograd.grad(torch.sum(out * c), (q, k, v))
        g = torch.autograd.grad(torch.sum(out * c), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum(torch.sum(x * t) for x in g), (q, k, v))

    step(*(x[..., :64, :] for x in (q, k, v, c, t)))
    run = lambda: step(q, k, v, c, t)
else:
    import jax, jax.numpy as jnp
    q, k, v, c, t = (jnp.asarray(x) for x in host)
    f = lambda q, k, v: jnp.sum(scaled_dot_product_attention(q, k, v, is_causal=True, **kw) * c)
    grad = jax.grad(f, argnums=(0, 1, 2))
    g = jax.jit({
        "train": lambda q, k, v, t: grad(q, k, v),
        "hvp": lambda q, k, v, t: jax.jvp(grad, (q, k, v), (t, t, t))[1],
    }[what])
    compiled = g.lower(q, k, v, t).compile()
    run = lambda: jax.block_until_ready(compiled(q, k, v, t))
print(peak_extra_mib(run))
"""

#: (library, L, what, block_size) of each memory probe
PROBES = (
    ("torch", 4096, "train", "default"),
    ("torch", 4096, "hvp", "default"),
    ("torch", 4096, "hvp", "dense"),
    ("torch", 16384, "train", "default"),
    ("torch", 16384, "hvp", "default"),
    ("jax", 4096, "train", "default"),
    ("jax", 4096, "hvp", "default"),
    ("jax", 4096, "hvp", "dense"),
    ("jax", 16384, "train", "default"),
    ("jax", 16384, "hvp", "default"),
)


#: the tuned allocator's setting of ``memory_tuned``
TUNED = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _probe(library: str, what: str, block: str, length: int, env: dict[str, str]) -> float:
    probe = [sys.executable, "-c", PROBE, library, what, block, str(length), str(HERE)]
    done = subprocess.run(
        probe, capture_output=True, text=True, check=True, env={**os.environ, **env}
    )
    return float(done.stdout.split()[-1])


def memory(env: dict[str, str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for library, length, what, block in PROBES:
        if env and (library != "torch" or block != "default"):
            continue
        row = out.setdefault(f"{library} L={length}", {})
        row[f"{what}_{block}_mib"] = _probe(library, what, block, length, env or {})
        print(
            "memory",
            env or "",
            library,
            length,
            what,
            block,
            row[f"{what}_{block}_mib"],
            flush=True,
        )
    for row in out.values():
        row["hvp_over_train"] = row["hvp_default_mib"] / row["train_default_mib"]
    return out


def _steps(length: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from portable_attn import scaled_dot_product_attention

    rng = np.random.default_rng(1)
    q, k, v, c, t = (
        torch.from_numpy(rng.standard_normal((1, 8, length, 64), dtype=np.float32))
        for _ in range(5)
    )
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def train() -> Any:
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(torch.sum(out * c), (q, k, v))

    def hvp() -> Any:
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        g = torch.autograd.grad(torch.sum(out * c), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum(torch.sum(x * t) for x in g), (q, k, v))

    return {"train": train, "hvp": hvp}


def timing(repeats: int) -> dict[str, Any]:
    timed = interleaved_seconds(_steps(4096), repeats=repeats)
    row = {
        "median_s": timed.medians,
        "hvp_over_train": statistics.median(timed.ratios("hvp", "train")),
    }
    print("time", json.dumps(row), flush=True)
    return row


def hook_cost(repeats: int) -> dict[str, Any]:
    """The default call's training step with SDPA's second-order hook and without it."""
    from portable_attn._paths import _native

    hooked = _native.ONCE_DIFFERENTIABLE
    out: dict[str, Any] = {}
    for length in (64, 1024):
        train = _steps(length)["train"]

        def with_hook(train: Any = train) -> Any:
            _native.ONCE_DIFFERENTIABLE = hooked
            return train()

        def without(train: Any = train) -> Any:
            _native.ONCE_DIFFERENTIABLE = frozenset()
            return train()

        n = repeats * (40 if length == 64 else 4)
        timed = interleaved_seconds({"hook": with_hook, "none": without}, repeats=n)
        out[f"L={length}"] = {
            "median_s": timed.medians,
            "hook_over_none": statistics.median(timed.ratios("hook", "none")),
        }
        print("hook", length, json.dumps(out[f"L={length}"]), flush=True)
    _native.ONCE_DIFFERENTIABLE = hooked
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "second-order.json"))
    args = parser.parse_args()
    result = {"git": git_state(), "hook": hook_cost(args.repeats)}
    result["time"] = timing(args.repeats)
    result["memory"] = memory()
    result["memory_tuned"] = {"env": TUNED, "rows": memory(TUNED)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
