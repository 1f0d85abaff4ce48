"""Dense vs tiled attention: time and peak extra memory on NumPy and PyTorch CPU.

    python benchmarks/tiled.py                 # full table (several minutes on 2 cores)
    python benchmarks/tiled.py --quick         # L <= 4096 only

Each measurement runs in a fresh subprocess so that peak memory is its own:
NumPy's peak extra memory comes from tracemalloc, torch's from the growth of the
process RSS (sampled every millisecond) over its value before the first full-size
call (after a small warm-up call that loads the libraries), with glibc's mmap
threshold fixed so that freed blocks leave the RSS.
Times are medians (``portable_attn._timing``) of repeated runs in their own
process, after only the small warm-up call: the first full-size call is timed too, and at L >= 8192 it is the only
(cold) run.
Run it on a quiet machine: anything else on the cores shows in the times.
float32, B=1, H=8, D=64. Results go to benchmarks/results/tiled.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

H, D = 8, 64
BLOCK = (128, 256)  # (block_q, block_k), as block_size="auto" picks on NumPy and torch
RESULTS = Path(__file__).parent / "results" / "tiled.json"

WORKER = r"""
import json, os, sys, threading, time, tracemalloc
import numpy as np
backend, path = sys.argv[1], sys.argv[2]
L, reps, H, D, BQ, BK = (int(a) for a in sys.argv[3:9])
causal, backward = sys.argv[9] == "1", sys.argv[10] == "1"
mode = sys.argv[11]  # "memory" or "time": separate processes, separate allocator settings
from portable_attn import scaled_dot_product_attention as sdpa
from portable_attn.testing import make_backend
from portable_attn._timing import median_seconds
table = make_backend(backend, exact=False)  # arrays and sync from the one backend table
rng = np.random.default_rng(0)
data = [rng.standard_normal((1, H, L, D)).astype(np.float32) for _ in range(3)]
block = "dense" if path == "dense" else (BQ, BK)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
if backend == "torch":
    import torch
    torch.manual_seed(0)
    args = [table.asarray(a) for a in data]
    if backward:
        args = [a.requires_grad_(True) for a in args]
    def call():
        out = sdpa(*args, is_causal=causal, block_size=block, implementation="portable")
        if backward:
            out.sum().backward()
            for a in args:
                a.grad = None
        return None
else:
    args = [table.asarray(a) for a in data]
    def call():
        sdpa(*args, is_causal=causal, block_size=block, implementation="portable")
del data  # the backend arrays are copies
# warm up the libraries (lazy imports, thread pools) on a small problem, then measure
# memory on the first full-size call, before freed-and-reused pages could hide growth
warm = sdpa(*[a[..., :128, :] for a in args], is_causal=causal, block_size=64)
if backward:
    warm.sum().backward()
    for a in args:
        a.grad = None
peak = None
if mode == "time":
    pass
elif backend == "numpy":
    tracemalloc.start(); call(); peak = tracemalloc.get_traced_memory()[1]; tracemalloc.stop()
else:
    base = rss(); top = [base]; done = threading.Event()
    def sample():
        while not done.is_set():
            top[0] = max(top[0], rss()); time.sleep(0.001)
    th = threading.Thread(target=sample); th.start(); call(); done.set(); th.join()
    peak = top[0] - base
# no warm-up beyond the small call above: the first full-size call is timed too
time_s = median_seconds(call, repeats=reps, warmup=0, sync=table.sync) if mode == "time" else None
print(json.dumps({"time_s": time_s, "peak_bytes": peak}))
"""


def measure(backend, path, L, causal, backward=False):
    reps = 5 if L <= 4096 else 1
    flags = ["1" if causal else "0", "1" if backward else "0"]
    result = {}
    for mode in ("memory", "time"):
        cmd = [
            sys.executable,
            "-c",
            WORKER,
            backend,
            path,
            *map(str, (L, reps, H, D, *BLOCK)),
            *flags,
            mode,
        ]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        if mode == "memory":
            # a fixed mmap threshold makes glibc return large freed blocks to the OS at once,
            # so RSS growth measures live memory rather than what the allocator keeps cached
            # (it slows allocation down, hence timing runs in another process without it)
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        result["peak_bytes" if mode == "memory" else "time_s"] = got[
            "peak_bytes" if mode == "memory" else "time_s"
        ]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L <= 4096 only")
    parser.add_argument("--backends", default="numpy,torch")
    args = parser.parse_args()
    lengths = [1024, 4096] if args.quick else [1024, 4096, 8192, 16384, 32768]
    backends = [b for b in args.backends.split(",") if b]
    rows = []
    for backend in backends:
        if backend == "torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                print("torch not installed: skipped")
                continue
        for L in lengths:
            for causal in (False, True):
                # dense logits are H*L*L*4 bytes, with temporaries ~3x: only where they fit
                paths = ["dense", "tiled"] if L <= 4096 else ["tiled"]
                for path in paths:
                    r = measure(backend, path, L, causal)
                    rows.append(
                        {
                            "backend": backend,
                            "pass": "forward",
                            "path": path,
                            "L": L,
                            "causal": causal,
                            **r,
                        }
                    )
                    print_row(rows[-1])
        if backend == "torch" and not args.quick:
            for path in ("tiled",):
                r = measure("torch", path, 16384, False, backward=True)
                rows.append(
                    {
                        "backend": "torch",
                        "pass": "forward+backward",
                        "path": path,
                        "L": 16384,
                        "causal": False,
                        **r,
                    }
                )
                print_row(rows[-1])
    if RESULTS.exists():  # keep the rows of backends not measured in this run
        old = json.loads(RESULTS.read_text()).get("rows", [])
        rows = [r for r in old if r["backend"] not in backends] + rows
    summary = targets(rows)
    for line in summary:
        print(line)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "H": H,
        "D": D,
        "B": 1,
        "dtype": "float32",
        "block_size": list(BLOCK),
    }
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows, "targets": summary}, indent=1))
    print(f"wrote {RESULTS}")


def print_row(r):
    size = H * r["L"] * r["L"] * 4
    if "error" in r:
        print(
            f"{r['backend']:6} {r['pass']:16} {r['path']:6} L={r['L']:<6} causal={r['causal']!s:5} ERROR {r['error']}"
        )
        return
    print(
        f"{r['backend']:6} {r['pass']:16} {r['path']:6} L={r['L']:<6} causal={r['causal']!s:5} "
        f"time {r['time_s'] * 1e3:10.1f} ms   peak extra {r['peak_bytes'] / 2**20:9.1f} MiB "
        f"({100 * r['peak_bytes'] / size:6.2f}% of (H, L, L) float32)"
    )


def targets(rows):
    def get(backend, path, L, causal, pass_="forward"):
        for r in rows:
            if (r["backend"], r["path"], r["L"], r["causal"], r["pass"]) == (
                backend,
                path,
                L,
                causal,
                pass_,
            ) and "error" not in r:
                return r
        return None

    out = []
    for b in sorted({r["backend"] for r in rows}):
        t = get(b, "tiled", 4096, False)
        d = get(b, "dense", 4096, False)
        if t:
            frac = t["peak_bytes"] / (H * 4096 * 4096 * 4)
            out.append(
                f"{b}: L=4096 tiled peak extra = {100 * frac:.2f}% of (H,L,L) float32 (target <= 5%)"
            )
        if t and d:
            out.append(
                f"{b}: L=4096 tiled/dense time = {t['time_s'] / d['time_s']:.2f} (target <= 1)"
            )
        c, n = get(b, "tiled", 8192, True), get(b, "tiled", 8192, False)
        if c and n:
            out.append(
                f"{b}: L=8192 causal/non-causal tiled time = {c['time_s'] / n['time_s']:.2f} (target <= 0.6)"
            )
        big = get(b, "tiled", 32768, False)
        if big:
            out.append(
                f"{b}: L=32768 tiled peak extra = {big['peak_bytes'] / 2**20:.0f} MiB (target < 1024)"
            )
        fb = get(b, "tiled", 16384, False, "forward+backward")
        if fb:
            out.append(
                f"{b}: L=16384 forward+backward tiled peak extra = {fb['peak_bytes'] / 2**20:.0f} MiB (target < 1024)"
            )
    return out


if __name__ == "__main__":
    main()
