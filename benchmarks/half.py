"""Half precision: the default call against the framework kernel in the same dtype.

    python benchmarks/half.py torch    # writes benchmarks/results/half-torch.json
    python benchmarks/half.py jax      # writes benchmarks/results/half-jax.json

Evidence for the kernels' ``own_half`` and the rows' ``half_flash`` in
``portable_attn/_lib/_route.py`` (issue 25). B=1, H=8, D=64; each (dtype, length) in a
fresh process (the allocator of a process that already made large calls hides the
cost of the float32 copies); interleaved rounds, medians and per-round ratios.

torch: the default call, both native routes (half Q, K, V given to SDPA as they are,
or as float32 copies) and SDPA itself in the inputs' dtype (asserted), plain / causal /
padding (the last quarter of the keys masked), in rotation; then the default call and
SDPA alone, each sample after the same untimed projection ``X W`` in the inputs' dtype
(``after_projection``: what precedes attention in a layer, the same for both; in the
rotation the default call mostly follows SDPA, and SDPA the float32 native call);
max error against float64 SDPA on the same inputs; the peak resident memory a causal
call adds (the median of 5 fresh processes each), as the first call of the process
and after one small call (``warm``: the call's own working memory, without the
modules and caches a process loads once).
jax: under ``jit``, the default call, the dense path in both half forms (float32
copies, FlashAttention's form) and ``jax.nn.dot_product_attention`` in bfloat16.
The machine's load average is recorded: it is shared.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import report
from _timing import interleaved_seconds

RESULTS = Path(__file__).parent / "results"
B, H, D = 1, 8, 64
MEMORY_PROCESSES = 5  # fresh processes per memory figure (the median is reported)


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def _torch_inputs(dtype: str, length: int, case: str):
    import torch

    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(B, H, length, D, generator=gen).to(dt) for _ in range(3))
    kw, peer = {}, {}
    if case == "causal":
        kw, peer = {"is_causal": True}, {"is_causal": True}
    elif case == "padding":
        mask = torch.arange(length)[None, None, None, :] < (3 * length) // 4
        kw, peer = {"mask": mask}, {"attn_mask": mask}
    return q, k, v, kw, peer


def torch_child(dtype: str, length: int) -> dict:
    import torch
    import torch.nn.functional as F

    from portable_attn import scaled_dot_product_attention
    from portable_attn._lib._call import prepare
    from portable_attn._lib._path import Native
    from portable_attn._lib._route import route
    from portable_attn._paths import run

    rows = []
    for case in ("plain", "causal", "padding"):
        q, k, v, kw, peer = _torch_inputs(dtype, length, case)
        call = prepare(q, k, v, **kw)
        default = route(call, None, None).path

        def sdpa(q=q, k=k, v=v, peer=peer):
            assert q.dtype == k.dtype == v.dtype == getattr(torch, dtype)  # the peer's dtype
            return F.scaled_dot_product_attention(q, k, v, **peer)

        fns = {
            "default": lambda q=q, k=k, v=v, kw=kw: scaled_dot_product_attention(q, k, v, **kw),
            "native_own_dtype": lambda c=call: c.finish(run(c, _route(Native(upcast=False)))[0]),
            "native_float32": lambda c=call: c.finish(run(c, _route(Native(upcast=True)))[0]),
            "sdpa": sdpa,
        }
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(B * length, H * D, generator=gen).to(q.dtype)
        w = torch.randn(H * D, H * D, generator=gen).to(q.dtype) / math.sqrt(H * D)

        def projection(x=x, w=w):  # what runs before attention in a layer: Q = X W
            return x @ w

        with torch.no_grad():
            res = interleaved_seconds(fns, repeats=41 if length < 4096 else 15)
            pair = {"default": fns["default"], "sdpa": sdpa}
            after = interleaved_seconds(
                pair, repeats=41 if length < 4096 else 15, before=projection
            )
            exact = F.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), **peer)
            errors = {}
            for name, fn in fns.items():
                out = fn()
                assert out.shape == exact.shape
                errors[name] = float((out.double() - exact).abs().max())
            assert sdpa().dtype == getattr(torch, dtype)
        med = res.medians
        row = {
            "L": length,
            "case": case,
            "default_path": repr(default),
            "ms": {n: 1e3 * t for n, t in med.items()},
            "ratio_vs_sdpa": {
                n: statistics.median(res.ratios(n, "sdpa")) for n in fns if n != "sdpa"
            },
            # default and SDPA alone, each sample after the same projection (in the
            # rotation above, the default call mostly follows SDPA, and SDPA the float32
            # native call): the headline figure
            "after_projection": {
                "ms": {n: 1e3 * t for n, t in after.medians.items()},
                "ratio_vs_sdpa": statistics.median(after.ratios("default", "sdpa")),
            },
            "max_error_vs_float64": errors,
        }
        rows.append(row)
        print(
            f"{dtype} L={length} {case:8s} default/sdpa {row['ratio_vs_sdpa']['default']:.2f} "
            f"after projection {row['after_projection']['ratio_vs_sdpa']:.2f} "
            f"own/sdpa {row['ratio_vs_sdpa']['native_own_dtype']:.2f} "
            f"f32/sdpa {row['ratio_vs_sdpa']['native_float32']:.2f}  err {errors}",
            flush=True,
        )
    return {"dtype": dtype, "L": length, "rows": rows, "loadavg_after": _loadavg()}


def torch_memory_child(dtype: str, length: int, impl: str, warm: bool) -> dict:
    """Peak resident memory one causal call adds in a fresh process (MiB).

    `warm`: after one small call (L = 64) of the same implementation, so the figure is
    the call's own working memory; the first call of a process also loads modules
    (array-api-compat's torch namespace, on ours) and fills caches once.
    """
    import torch
    import torch.nn.functional as F

    from portable_attn import scaled_dot_product_attention

    def call(length: int) -> float:
        q, k, v, kw, peer = _torch_inputs(dtype, length, "causal")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if impl == "sdpa":
            F.scaled_dot_product_attention(q, k, v, **peer)
        else:
            scaled_dot_product_attention(q, k, v, **kw)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024

    with torch.no_grad():
        if warm:
            call(64)
        return {"extra_peak_MiB": call(length)}


def _swap_heads(x):
    return x.swapaxes(1, 2)  # (B, H, L, D) <-> (B, L, H, D), jax.nn's layout


def _route(path):
    """`path` as the router would give it: half inputs kept where the path takes them."""
    from portable_attn._lib._path import Route
    from portable_attn._lib._route import _keeps_dtype

    return Route(path, keeps_dtype=_keeps_dtype(path))


def _finished(call, path, run):
    return call.finish(run(call, _route(path))[0])  # in the inputs' dtype, as the public call


def jax_child(length: int) -> dict:
    import jax
    import jax.numpy as jnp

    from portable_attn import scaled_dot_product_attention
    from portable_attn._lib._call import prepare
    from portable_attn._lib._path import Dense
    from portable_attn._lib._route import route
    from portable_attn._paths import run

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, length, D)), jnp.bfloat16) for _ in "qkv")
    rows = []
    for case in ("plain", "causal"):
        causal = case == "causal"

        def nn(q, k, v, causal=causal):
            assert q.dtype == k.dtype == v.dtype == jnp.bfloat16  # the peer's dtype
            t = _swap_heads
            return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal))

        fns = {
            "default": jax.jit(
                lambda q, k, v, c=causal: scaled_dot_product_attention(q, k, v, is_causal=c)
            ),
            "jax_nn": jax.jit(nn),
        }
        if length <= 2048:  # the dense path (the default's up to AUTO_DENSE_LIMIT_BYTES)
            for name, flash in (("dense_flash_form", True), ("dense_float32", False)):
                fns[name] = jax.jit(
                    lambda q, k, v, c=causal, f=flash: _finished(
                        prepare(q, k, v, is_causal=c), Dense(flash=f, weights_first=not f), run
                    )
                )
        timed = {n: (lambda f=f: f(q, k, v)) for n, f in fns.items()}
        res = interleaved_seconds(
            timed, repeats=7 if length < 4096 else 5, sync=lambda x: x.block_until_ready()
        )
        exact = np.asarray(
            scaled_dot_product_attention(
                *(np.asarray(x, np.float64) for x in (q, k, v)), is_causal=causal
            )
        )
        errors = {
            n: float(np.abs(np.asarray(f(q, k, v), np.float64) - exact).max())
            for n, f in fns.items()
        }
        row = {
            "L": length,
            "case": case,
            "default_path": repr(route(prepare(q, k, v, is_causal=causal), None, None).path),
            "ms": {n: 1e3 * t for n, t in res.medians.items()},
            "ratio_vs_jax_nn": {
                n: statistics.median(res.ratios(n, "jax_nn")) for n in fns if n != "jax_nn"
            },
            "max_error_vs_float64": errors,
        }
        rows.append(row)
        print(f"jax L={length} {case}: {row['ratio_vs_jax_nn']}  err {errors}", flush=True)
    return {"dtype": "bfloat16", "L": length, "rows": rows, "loadavg_after": _loadavg()}


def _child(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False
    )
    sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "")
    if proc.returncode:
        msg = f"child {args} failed ({proc.returncode})"
        raise RuntimeError(msg)
    text, result = proc.stdout.rsplit("RESULT ", 1)
    print(text, end="", flush=True)
    return json.loads(result)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        kind, *rest = argv[1:]
        if kind == "torch":
            result = torch_child(rest[0], int(rest[1]))
        elif kind == "torch-memory":
            result = torch_memory_child(rest[0], int(rest[1]), rest[2], rest[3] == "warm")
        else:
            result = jax_child(int(rest[0]))
        print("RESULT " + json.dumps(result))
        return 0
    which = argv[0] if argv else "torch"
    out = {**report.git_state(), "B": B, "H": H, "D": D, "loadavg_before": _loadavg()}
    if which == "torch":
        import torch

        out["torch"] = torch.__version__
        out["threads"] = torch.get_num_threads()
        lengths = [int(x) for x in argv[1:]] or [1024, 2048, 4096]
        out["runs"] = [
            _child("torch", dt, str(n)) for dt in ("bfloat16", "float16") for n in lengths
        ]
        # each in MEMORY_PROCESSES fresh processes: a first call's figure moves by about
        # 4 MiB between processes (8.3 or 12.2 MiB for SDPA itself), on both sides
        samples = {
            f"bfloat16 L={max(lengths)} {impl} {when}": [
                _child("torch-memory", "bfloat16", str(max(lengths)), impl, when)["extra_peak_MiB"]
                for _ in range(MEMORY_PROCESSES)
            ]
            for when in ("warm", "first")
            for impl in ("default", "sdpa")
        }
        out["memory_causal"] = {k: statistics.median(v) for k, v in samples.items()}
        out["memory_causal_samples"] = samples
        print(out["memory_causal"])
    else:
        import jax

        out["jax"] = jax.__version__
        out["runs"] = [_child("jax", str(n)) for n in (1024, 4096)]
    out["loadavg_after"] = _loadavg()
    (RESULTS / f"half-{which}.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
