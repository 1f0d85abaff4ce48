"""Forward mode (JVPs): the default call's memory and time against the dense path's.

    python benchmarks/forward_mode.py   # writes benchmarks/results/forward-mode.json

- ``memory``: the peak extra resident memory (MiB) of one causal call differentiated
  in forward mode (``torch.func.jvp``; ``jax.jit`` of ``jax.jvp``), each in a fresh
  process: the default call against ``block_size="dense"``, and the default call's
  forward alone; float32, B=1, H=1, D=64, L = 4096 and 16384.
- ``hvp``: the same for a Hessian-vector product, forward over reverse (``jax.jvp`` of
  ``jax.grad`` under ``jit``; ``torch.func.jvp`` of ``torch.func.grad``), the default
  call against the dense path: JAX at L = 4096, 8192 and 16384, torch at 4096 and 16384
  (the dense path not at 16384).
- ``time``: interleaved medians at L = 4096 (B=1, H=8, D=64, float32, causal): the
  default call's JVP against its forward alone and against the dense path's JVP, torch
  eager and JAX under ``jit``.
"""

from __future__ import annotations

import argparse
import json
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
import resource, sys
import numpy as np
library, what, block, L = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from portable_attn import scaled_dot_product_attention
kw = {} if block == "default" else {"block_size": block}
rng = np.random.default_rng(0)
host = [rng.standard_normal((1, 1, L, 64), dtype=np.float32) for _ in range(4)]
if library == "torch":
    import torch
    q, k, v, t = (torch.from_numpy(x) for x in host)
    f = lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    grad = torch.func.grad(lambda *x: f(*x).sum(), argnums=(0, 1, 2))
    run = {
        "forward": lambda: f(q, k, v),
        "jvp": lambda: torch.func.jvp(f, (q, k, v), (t, t, t))[1],
        "hvp": lambda: torch.func.jvp(grad, (q, k, v), (t, t, t))[1],
    }[what]
    f(q[..., :8, :], k[..., :8, :], v[..., :8, :])
else:
    import jax, jax.numpy as jnp
    q, k, v, t = (jnp.asarray(x) for x in host)
    f = lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    grad = jax.grad(lambda *x: jnp.sum(f(*x)), argnums=(0, 1, 2))
    g = jax.jit({
        "forward": f,
        "jvp": lambda q, k, v, t: jax.jvp(f, (q, k, v), (t, t, t))[1],
        "hvp": lambda q, k, v, t: jax.jvp(grad, (q, k, v), (t, t, t))[1],
    }[what])
    args = (q, k, v) if what == "forward" else (q, k, v, t)
    compiled = g.lower(*args).compile()
    run = lambda: jax.block_until_ready(compiled(*args))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def _probe(library: str, what: str, block: str, length: int) -> float:
    probe = [sys.executable, "-c", PROBE, library, what, block, str(length)]
    done = subprocess.run(probe, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def memory() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for library in ("torch", "jax"):
        for length in (4096, 16384):
            row = {}
            for what, block in (("forward", "default"), ("jvp", "default"), ("jvp", "dense")):
                row[f"{what}_{block}_mib"] = _probe(library, what, block, length)
            row["jvp_over_forward"] = row["jvp_default_mib"] / row["forward_default_mib"]
            row["dense_jvp_over_jvp"] = row["jvp_dense_mib"] / row["jvp_default_mib"]
            out[f"{library} L={length}"] = row
            print("memory", library, length, json.dumps(row), flush=True)
    return out


def hvp_memory() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for library, length, blocks in (
        ("jax", 4096, ("default", "dense")),
        ("jax", 8192, ("default", "dense")),
        ("jax", 16384, ("default",)),
        ("torch", 4096, ("default", "dense")),
        ("torch", 16384, ("default",)),
    ):
        row = {f"hvp_{block}_mib": _probe(library, "hvp", block, length) for block in blocks}
        out[f"{library} L={length}"] = row
        print("hvp", library, length, json.dumps(row), flush=True)
    return out


def timing(repeats: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from portable_attn import scaled_dot_product_attention

    rng = np.random.default_rng(1)
    host = [rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in range(4)]
    out: dict[str, Any] = {}

    def attend(**kw: Any) -> Any:
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, **kw)

    q, k, v, t = (torch.from_numpy(x) for x in host)
    fns = {
        "forward": lambda: attend()(q, k, v),
        "jvp": lambda: torch.func.jvp(attend(), (q, k, v), (t, t, t)),
        "jvp_dense": lambda: torch.func.jvp(attend(block_size="dense"), (q, k, v), (t, t, t)),
    }
    with torch.no_grad():
        timed = interleaved_seconds(fns, repeats=repeats)
    out["torch"] = _summary(timed)
    qj, kj, vj, tj = (jnp.asarray(x) for x in host)

    def jvp_of(kw: dict[str, Any]) -> Any:
        return jax.jit(lambda q, k, v, t: jax.jvp(attend(**kw), (q, k, v), (t, t, t))[1])

    forward, jvp, dense = jax.jit(attend()), jvp_of({}), jvp_of({"block_size": "dense"})
    fns = {
        "forward": lambda: forward(qj, kj, vj),
        "jvp": lambda: jvp(qj, kj, vj, tj),
        "jvp_dense": lambda: dense(qj, kj, vj, tj),
    }
    timed = interleaved_seconds(fns, repeats=repeats, sync=jax.block_until_ready)
    out["jax"] = _summary(timed)
    for name, row in out.items():
        print("time", name, json.dumps(row), flush=True)
    return out


def _summary(timed: Any) -> dict[str, Any]:
    import statistics

    return {
        "median_s": timed.medians,
        "jvp_over_forward": statistics.median(timed.ratios("jvp", "forward")),
        "jvp_dense_over_jvp": statistics.median(timed.ratios("jvp_dense", "jvp")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(HERE / "results" / "forward-mode.json"))
    args = parser.parse_args()
    result = {"git": git_state(), "memory": memory(), "hvp": hvp_memory()}
    result["time"] = timing(args.repeats)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
