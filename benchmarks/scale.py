"""Scale-out throughput: Dask with 1 and 2 worker processes, a JAX mesh of 1 and 2 devices.

    python benchmarks/scale.py             # both, writes benchmarks/results/scale.json
    python benchmarks/scale.py --quick     # B=16 instead of 64

The workload is one batch of B=64 sequences, H=8 heads, L=1024, D=64, float32,
causal. Throughput is sequences per second (median of repeated runs after a
warm-up, timed by ``portable_attn._timing``), side by side in one run, with
each worker's (or the JAX process's) peak resident memory. Dask inputs are generated and kept on the workers first,
so the timing is the attention and not the transfer; JAX inputs are sharded over
the batch axis of the mesh and computed with ``block_size="auto"``. Each JAX configuration runs in its own process,
because the number of host devices is fixed when JAX starts. Never run it next
to other work: the cores are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

from portable_attn._timing import median_seconds

RESULTS = Path(__file__).parent / "results"
H, L, D = 8, 1024, 64
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _peak_rss_mib() -> int:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def dask_run(workers: int, batch: int, reps: int) -> dict:
    """Throughput of one cluster of `workers` single-threaded worker processes."""
    import dask.array as da
    import distributed

    from portable_attn import scaled_dot_product_attention

    with (
        distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            env=SINGLE_THREAD,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        rng = da.random.default_rng(0)
        chunks = (2, H, 512, D)  # 2 sequences x 512 queries or keys per chunk
        q, k, v = (
            rng.standard_normal((batch, H, L, D), chunks=chunks, dtype="float32") for _ in range(3)
        )
        q, k, v = client.persist([q, k, v])
        distributed.wait([q, k, v])
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        per_sequence = out.sum(axis=(1, 2, 3))  # (B,): the output stays on the workers
        # sync=True: the call returns when the workers are done
        t = median_seconds(lambda: client.compute(per_sequence, sync=True), repeats=reps)
        peaks = client.run(_peak_rss_mib)
    return {
        "engine": "dask",
        "workers": workers,
        "time_s": t,
        "sequences_per_s": batch / t,
        "peak_rss_mib_per_worker": sorted(peaks.values()),
    }


def jax_run(devices: int, batch: int, reps: int) -> dict:
    """Throughput on a mesh of `devices` host devices (run in a fresh process)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from portable_attn import scaled_dot_product_attention
    from portable_attn._backends import make_backend

    sync = make_backend("jax", exact=False).sync
    mesh = jax.make_mesh((devices,), ("batch",), devices=jax.devices()[:devices])
    sharding = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(0)
    q, k, v = (
        jax.device_put(rng.standard_normal((batch, H, L, D), dtype=np.float32), sharding)
        for _ in range(3)
    )

    def attend(q, k, v):  # "auto": tiled above 64 MiB of logits, as users would call it
        return scaled_dot_product_attention(q, k, v, is_causal=True, block_size="auto")

    attend = jax.jit(attend)
    t = median_seconds(lambda: attend(q, k, v), repeats=reps, sync=sync)  # warm-up compiles
    return {
        "engine": "jax",
        "devices": devices,
        "time_s": t,
        "sequences_per_s": batch / t,
        "peak_rss_mib_process": _peak_rss_mib(),
    }


def _jax_in_subprocess(devices: int, batch: int, reps: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, __file__, "--jax-child", str(devices), "--batch", str(batch)]
    cmd += ["--reps", str(reps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B=16, 3 repetitions")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--jax-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    batch = args.batch or (16 if args.quick else 64)
    reps = args.reps or (3 if args.quick else 5)
    if args.jax_child is not None:
        print(json.dumps(jax_run(args.jax_child, batch, reps)))
        return 0

    rows = []
    for workers in (1, 2):
        rows.append(dask_run(workers, batch, reps))
        print(json.dumps(rows[-1]))
    for devices in (1, 2):
        rows.append(_jax_in_subprocess(devices, batch, reps))
        print(json.dumps(rows[-1]))
    dask_speedup = rows[1]["sequences_per_s"] / rows[0]["sequences_per_s"]
    jax_speedup = rows[3]["sequences_per_s"] / rows[2]["sequences_per_s"]
    print(
        f"\nB={batch} H={H} L={L} D={D} float32 causal, {os.cpu_count()} CPUs, medians of {reps}"
    )
    for r in rows:
        unit = f"{r['engine']} {r.get('workers', r.get('devices'))} " + (
            "worker(s)" if r["engine"] == "dask" else "device(s)"
        )
        peak = r.get("peak_rss_mib_per_worker", r.get("peak_rss_mib_process"))
        print(
            f"  {unit:20} {r['sequences_per_s']:7.2f} seq/s  {r['time_s']:7.3f} s  peak MiB {peak}"
        )
    print(f"  speedup 2 vs 1: dask x{dask_speedup:.2f}, jax x{jax_speedup:.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "scale.json"
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "batch": batch}
    summary = {"dask_speedup": dask_speedup, "jax_speedup": jax_speedup}
    out.write_text(json.dumps({"environment": env, "rows": rows, **summary}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
