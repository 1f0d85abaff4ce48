"""Benchmark suite: portable_attn against textbook and native attention, side by side.

    python benchmarks/bench.py --backend numpy          # one backend per process
    python benchmarks/bench.py --backend torch --quick
    nox -s bench                                         # every installed backend

For each shape it times, in one process: the portable dense path, the portable
tiled path, the textbook version in the same framework (matmul, max-subtracted
softmax, matmul), the native kernel where one exists (torch SDPA,
``jax.nn.dot_product_attention`` under ``jax.jit``) and the GEMM-bound limit (the
two matmuls alone). All of them are timed interleaved, round-robin
(``portable_attn._timing``), on arrays from the backend table
(``portable_attn._backends``). It reports medians over repeated runs after warm-up, ratios
to native and to textbook, GFLOP/s (4·B·H·Lq·Lk·D) and the fraction of the GEMM
rate, and the per-call overhead on tiny inputs. Results go to
``benchmarks/results/bench-<backend>.json``. Never run it next to other work:
the cores are shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from portable_attn._backends import make_backend
from portable_attn._timing import interleaved_seconds

RESULTS = Path(__file__).parent / "results"
B, H, D = 1, 8, 64


class Runner:
    """The five implementations for one backend; arrays and sync from the backend table."""

    def __init__(self, backend: str):
        if backend not in ("numpy", "torch", "jax"):
            raise SystemExit(f"unknown backend {backend!r}")
        self.backend = backend
        # exact=False: time the library's own defaults (TF32, JAX matmul precision)
        self.table = make_backend(backend, exact=False)
        self.sync = self.table.sync
        if backend == "numpy":
            self.xp = np
            self.native = None
        elif backend == "torch":
            import torch

            torch.set_grad_enabled(False)
            self.torch = torch
            self.xp = torch
            self.native = lambda q, k, v, causal: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal
            )
        else:
            import jax
            import jax.numpy as jnp

            self.jax, self.xp = jax, jnp

            def native(q, k, v, causal):
                t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
                return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal))

            self.native = jax.jit(native, static_argnums=3)

    def asarray(self, a, dtype="float32"):
        return self.table.asarray(a, dtype)

    def functions(self, causal, lq, lk):
        from portable_attn import scaled_dot_product_attention as sdpa

        xp = self.xp
        mask = None
        if causal:
            mask = self.asarray(np.tril(np.ones((lq, lk), dtype=bool), lk - lq), "bool")

        def textbook(q, k, v):
            # math.sqrt: a Python float keeps float32 (np.sqrt gives a float64 NumPy scalar,
            # which NumPy 2 promotes float32 arrays to)
            s = (q @ xp.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
            if mask is not None:
                s = xp.where(mask, s, -math.inf)
            s = (
                s - xp.max(s, axis=-1, keepdims=True)
                if self.backend != "torch"
                else s - s.amax(-1, keepdim=True)
            )
            e = xp.exp(s)
            out = (
                e / xp.sum(e, axis=-1, keepdims=True)
                if self.backend != "torch"
                else e / e.sum(-1, keepdim=True)
            ) @ v
            if out.dtype != q.dtype:
                raise AssertionError(f"textbook gave {out.dtype} for {q.dtype} inputs")
            return out

        def gemm(q, k, v):
            return (q @ xp.swapaxes(k, -1, -2)) @ v

        fns = {
            "portable dense": lambda q, k, v: sdpa(
                q, k, v, is_causal=causal, implementation="portable"
            ),
            "portable tiled": lambda q, k, v: sdpa(
                q, k, v, is_causal=causal, block_size=(128, 256), implementation="portable"
            ),
            "textbook": textbook,
            "gemm": gemm,
        }
        if self.native is not None:
            fns["native"] = lambda q, k, v: self.native(q, k, v, causal)
        if self.backend == "jax":
            fns = {name: self.jax.jit(f) if name != "native" else f for name, f in fns.items()}
        return fns

    def time(self, fns, args, reps):
        """Median seconds of each of `fns` on `args`, timed interleaved (round-robin).

        Each is first called once (warm-up and jit compilation); one that raises
        (a kernel that refuses a dtype) is reported and left out.
        """
        ready = {}
        for name, f in fns.items():
            try:
                self.sync(f(*args))
            except Exception as exc:
                print(f"  {name}: {type(exc).__name__}: {exc}"[:160])
                continue
            ready[name] = lambda f=f: f(*args)
        if not ready:
            return {}
        return interleaved_seconds(ready, repeats=reps, warmup=0, sync=self.sync).medians


def environment(backend):
    info = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
    }
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [
            {k: p.get(k) for k in ("internal_api", "num_threads", "version")}
            for p in threadpool_info()
        ]
    except ImportError:
        info["blas"] = "threadpoolctl not installed"
    if backend == "torch":
        import torch

        info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if backend == "jax":
        import jax

        info |= {"jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()]}
    import portable_attn

    info["portable_attn"] = portable_attn.__version__
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "torch", "jax"])
    parser.add_argument("--quick", action="store_true", help="L <= 2048, fewer repeats")
    parser.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    parser.add_argument(
        "--overhead-only",
        action="store_true",
        help="measure only the per-call overhead and replace it in the existing JSON",
    )
    args = parser.parse_args()
    run = Runner(args.backend)
    env = environment(args.backend)
    print(json.dumps(env, indent=1))
    if args.overhead_only:
        return update_overhead(run, env)
    lengths = [128, 512, 1024, 2048] if args.quick else [128, 512, 1024, 2048, 4096, 8192]
    rng = np.random.default_rng(0)
    rows = []
    shapes = [(L, L, D, causal, "float32") for L in lengths for causal in (False, True)]
    shapes += [(1, 4096, D, False, "float32")]
    shapes += [(1024, 1024, d, False, "float32") for d in (32, 128)]
    if args.backend in ("torch", "jax"):
        shapes += [(1024, 1024, D, True, dt) for dt in ("float16", "bfloat16")]
    for lq, lk, d, causal, dtype in shapes:
        q = run.asarray(rng.standard_normal((B, H, lq, d)), dtype)
        k = run.asarray(rng.standard_normal((B, H, lk, d)), dtype)
        v = run.asarray(rng.standard_normal((B, H, lk, d)), dtype)
        reps = 3 if lq * lk >= 4096 * 4096 else (5 if args.quick else 10)
        flops = 4 * B * H * lq * lk * d
        fns = {}
        for name, f in run.functions(causal, lq, lk).items():
            dense_bytes = B * H * lq * lk * 4 * 3
            if name in ("portable dense", "textbook", "gemm") and dense_bytes > 8 * 2**30:
                continue  # would not fit
            if args.backend == "numpy" and dtype != "float32":
                continue
            fns[name] = f
        times = run.time(fns, (q, k, v), reps)  # side by side, interleaved
        gemm_rate = flops / times["gemm"] if "gemm" in times else None
        for name, t in times.items():
            row = {
                "backend": args.backend,
                "impl": name,
                "Lq": lq,
                "Lk": lk,
                "D": d,
                "causal": causal,
                "dtype": dtype,
                "time_ms": 1e3 * t,
                "gflops": flops / t / 1e9,
                "vs_native": t / times["native"] if "native" in times else None,
                "vs_textbook": t / times["textbook"] if "textbook" in times else None,
                "gemm_fraction": (flops / t) / gemm_rate if gemm_rate else None,
            }
            rows.append(row)
            fmt = lambda x: "   -  " if x is None else f"{x:6.2f}"  # noqa: E731
            print(
                f"{args.backend:5} {dtype:8} Lq={lq:<5} Lk={lk:<5} D={d:<3} causal={causal!s:5} "
                f"{name:15} {1e3 * t:9.2f} ms {row['gflops']:7.1f} GFLOP/s  "
                f"x native {fmt(row['vs_native'])}  x textbook {fmt(row['vs_textbook'])}  "
                f"of GEMM rate {fmt(row['gemm_fraction'])}"
            )
    overhead = per_call_overhead(run)
    _print_overhead(overhead)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"bench-{args.backend}.json"
    out.write_text(json.dumps({"environment": env, "rows": rows, "overhead": overhead}, indent=1))
    print(f"wrote {out}")
    if args.plot:
        plot(rows, RESULTS / f"bench-{args.backend}.png")


def _print_overhead(overhead):
    print(
        f"per-call overhead on B=1 H=1 L=8 D=8: default call {overhead['default_us']:.1f} us, "
        f"portable path {overhead['portable_us']:.1f} us, textbook {overhead['textbook_us']:.1f} us;"
        f" default - textbook {overhead['difference_us']:.1f} us"
    )


def update_overhead(run, env):
    """Re-measure the overhead alone; the timing rows of the last full run are kept."""
    out = RESULTS / f"bench-{run.backend}.json"
    data = json.loads(out.read_text()) if out.exists() else {"environment": env, "rows": []}
    overhead = per_call_overhead(run)
    _print_overhead(overhead)
    overhead["measured_separately"] = time.strftime("%Y-%m-%d")
    data["overhead"] = overhead
    out.write_text(json.dumps(data, indent=1))
    print(f"updated the overhead in {out}")
    return 0


def per_call_overhead(run):
    """Tiny-input call time of the default call, the portable path and the textbook version."""
    from portable_attn import scaled_dot_product_attention as sdpa

    rng = np.random.default_rng(1)
    q, k, v = (run.asarray(rng.standard_normal((1, 1, 8, 8))) for _ in range(3))
    textbook = run.functions(False, 8, 8)["textbook"]
    if run.backend == "jax":  # compare eager with eager: the overhead users see outside jit
        import jax.numpy as jnp

        def textbook(q, k, v):
            s = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(8)
            e = jnp.exp(s - s.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True) @ v

    fns = {
        "default_us": lambda q, k, v: sdpa(q, k, v),
        "portable_us": lambda q, k, v: sdpa(q, k, v, implementation="portable"),
        "textbook_us": textbook,
    }
    calls = {key: (lambda f=f: f(q, k, v)) for key, f in fns.items()}
    timed = interleaved_seconds(calls, repeats=30, warmup=1, number=100, sync=run.sync)
    res = {key: 1e6 * t for key, t in timed.medians.items()}
    res["difference_us"] = res["default_us"] - res["textbook_us"]
    res["portable_difference_us"] = res["portable_us"] - res["textbook_us"]
    return res


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, causal in zip(axes, (False, True), strict=True):
        for impl in sorted({r["impl"] for r in rows}):
            pts = [
                (r["Lq"], r["time_ms"])
                for r in rows
                if r["impl"] == impl
                and r["causal"] == causal
                and r["Lq"] == r["Lk"]
                and r["D"] == D
                and r["dtype"] == "float32"
            ]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="L", title=f"causal={causal}")
    axes[0].set_ylabel("median time (ms)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
