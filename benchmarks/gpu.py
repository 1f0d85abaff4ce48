"""GPU timings: portable_attn against the libraries' own fused kernels, on one GPU.

For each dtype (float16, bfloat16), sequence length and causal flag, interleaved
in one process (``_timing.interleaved_seconds``; medians over rounds):

- ``torch_portable``: ``scaled_dot_product_attention(..., implementation="portable")``
  on torch CUDA tensors;
- ``torch_flash`` / ``torch_cudnn``: ``torch.nn.functional.scaled_dot_product_attention``
  restricted to the FlashAttention or the cuDNN kernel (``torch.nn.attention.sdpa_kernel``);
- ``jax_portable``: ours under ``jax.jit`` on the JAX GPU device;
- ``jax_default``: our default call (``implementation=None``) under ``jax.jit``;
- ``jax_cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``;
- issue 25's half-precision forms: ``torch_default`` (the default call),
  ``torch_native_own_dtype`` / ``torch_native_float32`` (SDPA given half Q, K, V as
  they are, or float32 copies: the kernel's ``own_half``) with the aten SDPA
  kernel each runs (``torch_kernels_selected``: flash, efficient, cuDNN or math, by
  the profiler), and up to L = 4096 ``jax_dense_flash_form`` / ``jax_dense_float32``
  (the dense path in FlashAttention's form or on float32 copies:
  the row's ``half_flash``).

An implementation that cannot run (a kernel the GPU or the build lacks) is
recorded with its error and left out of the timing. Each case also records the
largest difference of ours from the library's kernel. The libraries keep their
own speed settings (``make_backend(kind, exact=False)``: TF32 and JAX's default
matmul precision are left as they are).

``--cpu`` is a dry run of this script without a GPU: the CPU kinds, float32,
short sequences, and the kernels a CPU has (torch's math SDPA, jax.nn's XLA one),
routed by the GPU rows of the router's table (``gpu_features._gpu_rows_on_cpu``).

Usage::

    python benchmarks/gpu.py [--cpu] [--out PATH] [--budget-s SECONDS]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import report
from _timing import interleaved_seconds

from portable_attn import scaled_dot_product_attention as sdpa
from portable_attn._lib._call import prepare
from portable_attn._lib._path import Dense, Native, Route
from portable_attn._lib._route import _keeps_dtype
from portable_attn._paths import run as run_path
from portable_attn.testing import make_backend

RESULTS = Path(__file__).parent / "results"
B, H, D = 2, 16, 128
GPU_CASES = {"dtypes": ("float16", "bfloat16"), "lengths": (1024, 4096, 16384), "repeats": 10}
CPU_CASES = {"dtypes": ("float32",), "lengths": (128, 256), "repeats": 3}


def _torch_kernels(cpu: bool) -> dict[str, Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def restricted(kernel: Any) -> Any:
        def call(q: Any, k: Any, v: Any, causal: bool) -> Any:
            with sdpa_kernel(kernel):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return call

    if cpu:
        return {"torch_math": restricted(SDPBackend.MATH)}
    return {
        "torch_flash": restricted(SDPBackend.FLASH_ATTENTION),
        "torch_cudnn": restricted(SDPBackend.CUDNN_ATTENTION),
    }


def _jax_kernel(cpu: bool) -> tuple[str, Any]:
    import jax
    import jax.numpy as jnp

    name, implementation = ("jax_xla", "xla") if cpu else ("jax_cudnn", "cudnn")

    def call(q: Any, k: Any, v: Any, causal: bool) -> Any:
        t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (B, L, H, D) layout
        out = jax.nn.dot_product_attention(
            t(q), t(k), t(v), is_causal=causal, implementation=implementation
        )
        return t(out)

    return name, call


def _first_call(fn: Any, sync: Any) -> tuple[Any, str | None]:
    try:
        out = fn()
        sync(out)
    except Exception as exc:  # a kernel this GPU or build lacks: record it, time the rest
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out, None


def _time_case(
    tb: Any,
    jb: Any,
    kernels: dict[str, Any],
    jax_kernel: tuple[str, Any],
    case: dict,
    repeats: int,
) -> dict[str, Any]:
    """Time ours and the kernels on one case; return its row."""
    import jax

    dtype, causal = case["dtype"], case["causal"]
    rng = np.random.default_rng(case["L"])
    data = [rng.standard_normal((B, H, case["L"], D), dtype=np.float32) for _ in range(3)]
    q, k, v = (tb.asarray(a, dtype) for a in data)
    qj, kj, vj = (jb.asarray(a, dtype) for a in data)
    jax_name, jax_fn = jax_kernel

    def ours(q: Any, k: Any, v: Any) -> Any:
        return sdpa(q, k, v, is_causal=causal, block_size="auto", implementation="portable")

    def on_path(path: Any, q: Any, k: Any, v: Any) -> Any:  # issue 25's half forms
        call = prepare(q, k, v, is_causal=causal)
        return call.finish(run_path(call, Route(path, keeps_dtype=_keeps_dtype(path)))[0])

    ours_j = jax.jit(ours)
    default_j = jax.jit(lambda q, k, v: sdpa(q, k, v, is_causal=causal))
    theirs_j = jax.jit(lambda q, k, v: jax_fn(q, k, v, causal))
    candidates = {
        "torch_portable": (tb, lambda: ours(q, k, v)),
        "torch_default": (tb, lambda: sdpa(q, k, v, is_causal=causal)),
        "torch_native_own_dtype": (tb, partial(on_path, Native(upcast=False), q, k, v)),
        "torch_native_float32": (tb, partial(on_path, Native(upcast=True), q, k, v)),
        **{name: (tb, partial(fn, q, k, v, causal)) for name, fn in kernels.items()},
        "jax_portable": (jb, lambda: ours_j(qj, kj, vj)),
        "jax_default": (jb, lambda: default_j(qj, kj, vj)),
        jax_name: (jb, lambda: theirs_j(qj, kj, vj)),
    }
    if case["L"] <= 4096:  # the dense path's two half forms (B x H x L x L float32 scores)
        for name, flash in (("jax_dense_flash_form", True), ("jax_dense_float32", False)):
            fn = jax.jit(partial(on_path, Dense(flash=flash)))
            candidates[name] = (jb, partial(fn, qj, kj, vj))
    fns, outs, errors = {}, {}, {}
    for name, (backend, fn) in candidates.items():
        out, error = _first_call(fn, backend.sync)
        if error is None:
            fns[name] = partial(_synced, backend, fn)
            outs[name] = backend.to_numpy(out).astype(np.float32)
        else:
            errors[name] = error
    medians = interleaved_seconds(fns, repeats=repeats).medians
    row: dict[str, Any] = {**case, **{f"{n}_ms": 1e3 * s for n, s in medians.items()}}
    pairs = [*(("torch_portable", n) for n in kernels), ("jax_portable", jax_name)]
    for mine, theirs in [*pairs, ("jax_default", jax_name)]:
        if mine in outs and theirs in outs:
            row[f"{mine}_vs_{theirs}_max_abs_diff"] = float(
                np.abs(outs[mine] - outs[theirs]).max()
            )
    row["torch_kernels_selected"] = {
        name: _sdpa_ops(candidates[name][1])
        for name in ("torch_default", "torch_native_own_dtype", "torch_native_float32")
        if name in fns
    }
    if errors:
        row["errors"] = errors
    return row


def _sdpa_ops(fn: Any) -> list[str]:
    """The aten SDPA kernels `fn` runs (flash, efficient, cuDNN or math), by the profiler."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key})


def _synced(backend: Any, fn: Any) -> None:
    backend.sync(fn())


def run(cpu: bool, budget_s: float) -> dict[str, Any]:
    """Time every case that starts within `budget_s` seconds; return the rows and the rest."""
    cases = CPU_CASES if cpu else GPU_CASES
    tb = make_backend("torch" if cpu else "torch:cuda", exact=False)
    jb = make_backend("jax" if cpu else "jax:gpu", exact=False)
    kernels, jax_kernel = _torch_kernels(cpu), _jax_kernel(cpu)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for dtype in cases["dtypes"]:
        for length in cases["lengths"]:
            for causal in (False, True):
                case = {"dtype": dtype, "L": length, "causal": causal}
                if time.perf_counter() - start > budget_s:
                    skipped.append({**case, "why": f"past the budget of {budget_s:.0f} s"})
                    continue
                rows.append(_time_case(tb, jb, kernels, jax_kernel, case, cases["repeats"]))
                print(json.dumps(rows[-1]), flush=True)
    shape = {"B": B, "H": H, "D": D}
    return {
        "rows": rows,
        "skipped": skipped,
        "torch": tb.version,
        "jax": jb.version,
        "shape": shape,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU kinds")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: results/)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting cases after")
    args = parser.parse_args(argv)
    if args.cpu:  # route as a GPU would: the GPU rows of the router's table
        from gpu_features import _gpu_rows_on_cpu

        _gpu_rows_on_cpu()
    result = run(args.cpu, args.budget_s)
    if args.cpu:
        device = platform.processor() or platform.machine()
    else:
        import torch

        device = torch.cuda.get_device_name()
    date = time.strftime("%Y-%m-%d %H:%M:%S")
    result = {
        "device": device,
        "date": date,
        "cpu_dry_run": args.cpu,
        **report.git_state(),
        **result,
    }
    out = args.out or RESULTS / ("gpu-cpu-dry-run.json" if args.cpu else "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
