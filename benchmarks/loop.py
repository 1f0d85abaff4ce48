"""Long context under ``jax.jit``: the traced loop against the unrolled loop and ``jax.nn``.

Each case runs in a fresh process (``--case``), so its peak RSS is its own:
B=1, H=8, D=64, float32, causal unless said, under ``jax.jit``: the traced loop
(``_paths/_loop.py``, forced at every length), the default call (the loop from
``LOOP_MIN_SCORE_BYTES``, unrolled below), the tiled path unrolled as before
(a Python loop in blocks of ``max(256, 128 * ceil(L / 2048))``, at most 16 per
axis, the old ``default_tiles``) and ``jax.nn.dot_product_attention`` given the
same causal mask (Lq == Lk: its ``is_causal`` agrees with ours). Per case:
compile time (``lower().compile()``), the median of the timed calls, and the
extra peak RSS of compile plus calls over the inputs (``VmHWM`` after
``clear_refs``). Forward, and ``jit(grad)`` of ``sum(out * w)`` w.r.t. Q, K, V.

    python benchmarks/loop.py            # the table, JSON in benchmarks/results/loop.json
    python benchmarks/loop.py --quick    # short lengths only (not for publishing)
    python benchmarks/loop.py --only default:forward:1024:1,jax.nn:forward:1024:1 \
        --out loop-some.json             # some cases, in another results file
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

FULL = {  # impl -> {mode: lengths}
    "loop": {
        "forward": [2048, 4096, 8192, 16384, 32768, 65536],
        "grad": [2048, 4096, 8192, 16384, 32768],
    },
    "unrolled": {"forward": [2048, 4096, 8192, 16384], "grad": [2048, 4096, 8192]},
    "jax.nn": {"forward": [1024, 2048, 4096, 8192], "grad": [2048, 4096]},
}
EXTRA = [  # (impl, mode, L, causal): the skipping ratio and the default call
    ("loop", "forward", 8192, False),
    ("default", "forward", 1024, True),
    ("default", "forward", 4096, True),
    ("default", "grad", 4096, True),
]
QUICK = {
    "loop": {"forward": [2048, 4096], "grad": [2048]},
    "unrolled": {"forward": [2048], "grad": [2048]},
    "jax.nn": {"forward": [1024, 2048], "grad": [2048]},
}


def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_hwm() -> None:
    with contextlib.suppress(OSError):  # Linux: the peak RSS starts again from here
        Path("/proc/self/clear_refs").write_text("5")


def run_case(impl: str, mode: str, length: int, causal: bool) -> dict:
    """One case, in this process: compile time, run time and extra peak RSS."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import portable_attn._lib._route as route
    from portable_attn import scaled_dot_product_attention

    rng = np.random.default_rng(0)
    q, k, v, w = (
        jnp.asarray(rng.standard_normal((1, 8, length, 64)).astype(np.float32)) for _ in range(4)
    )
    assert q.dtype == jnp.float32
    if impl == "unrolled":  # the Python loop, in the tiles the old policy gave traced libraries
        route.LOOP_MIN_SCORE_BYTES = 2**62  # never the traced loop
        block = max(256, 128 * math.ceil(length / 2048))

        def attend(q, k, v):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, block_size=block)
    elif impl == "jax.nn":

        def attend(q, k, v):  # (B, H, L, D) <-> jax.nn's (B, L, H, D)
            def t(x):
                return jnp.swapaxes(x, 1, 2)

            return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal))
    else:  # "loop": the traced loop at every length; "default": the default call
        if impl == "loop":
            route.LOOP_MIN_SCORE_BYTES = 0

        def attend(q, k, v):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)

    if mode == "grad":  # `w` is an argument: closed over, it would be a constant of the
        # program (64 MiB at L = 32768), whose embedding made compile time grow with L
        grad = jax.grad(lambda q, k, v, w: (attend(q, k, v) * w).sum(), argnums=(0, 1, 2))
        fn = jax.jit(grad)
        args = (q, k, v, w)
    else:
        fn = jax.jit(attend)
        args = (q, k, v)
    jax.block_until_ready((q, k, v, w))
    _reset_hwm()
    base = _hwm_mib()
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    repeats = 1 if length >= 32768 else 2 if length >= 16384 else 3
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return {
        "impl": impl,
        "mode": mode,
        "L": length,
        "causal": causal,
        "compile_s": round(compile_s, 3),
        "run_s": round(sorted(times)[len(times) // 2], 4),
        "runs": [round(t, 4) for t in times],
        "extra_rss_mib": round(_hwm_mib() - base, 1),
        "dense_scores_mib": 8 * length * length * 4 / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", nargs=4, metavar=("IMPL", "MODE", "L", "CAUSAL"))
    parser.add_argument("--only", help="IMPL:MODE:L:CAUSAL cases, comma-separated")
    parser.add_argument("--out", help="results file name (default loop.json)")
    args = parser.parse_args()
    if args.case:
        impl, mode, length, causal = args.case
        print(json.dumps(run_case(impl, mode, int(length), causal == "1")))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    import report

    git = report.git_state()  # the commit the cases run at, recorded before they run
    table = QUICK if args.quick else FULL
    cases = [(i, m, n, True) for i, modes in table.items() for m, ls in modes.items() for n in ls]
    if not args.quick:
        cases += EXTRA
    if args.only:
        cases = [
            (i, m, int(n), c == "1")
            for i, m, n, c in (case.split(":") for case in args.only.split(","))
        ]
    cases.sort(key=lambda c: c[2])  # short first: the long ones last
    rows = []
    for impl, mode, length, causal in cases:
        cmd = [sys.executable, __file__, "--case", impl, mode, str(length), "1" if causal else "0"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            row = {
                "impl": impl,
                "mode": mode,
                "L": length,
                "causal": causal,
                "error": proc.stderr[-400:],
            }
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "benchmark": "loop",
        "git": git,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3]
        if os.path.exists("/proc/loadavg")
        else None,
        "setup": "B=1, H=8, D=64, float32, causal unless said; jax.jit; one process per case",
        "quick": args.quick,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    name = args.out or ("loop-quick.json" if args.quick else "loop.json")
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
