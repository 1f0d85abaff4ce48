"""Scale-out throughput and worker memory: one NumPy process against 1 and 2 Dask workers.

    python benchmarks/scale.py            # writes benchmarks/results/scale.json
    python benchmarks/scale.py --quick    # 3 repetitions instead of 7
    python benchmarks/scale.py --jax      # also a JAX mesh of 1 and 2 host devices

Throughput: B=16 sequences, H=8 heads, L=1024, D=64, float32, causal, in sequences
per second (medians). Side by side, interleaved repetition by repetition, on the
same machine:

- one NumPy process (its default BLAS threads, as a user would run it; the
  library's own default path);
- a ``LocalCluster`` of 1 and of 2 worker processes with one thread each (BLAS
  limited to one thread), with one chunk per sequence ``(1, H, L, D)`` and with
  ``Lq`` and ``Lk`` chunked at 256 ``(1, H, 256, D)``. The inputs are generated
  and persisted on the workers first, and only one number per sequence comes
  back, so the timing is the attention.

Each Dask row also has every worker's peak RSS growth during its last timed call
(polled every 2 ms in the worker). The memory row is the issue's case: B=1, H=2,
L=16384, D=32 chunked at 2048 along L on 2 workers, against its bound of 64 MiB.

The cores are shared with whatever else runs: the load average before and after
is recorded, and so is what the cores alone give (1 and 2 plain single-threaded
processes running the same kernel at once, before and after), the ceiling for 1 -> 2
workers. ``--jax`` adds a JAX mesh of 1 and 2 host devices (each in its own
process, since the number of host devices is fixed when JAX starts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _timing
import report
from _timing import start_rss_watch, stop_rss_watch

RESULTS = Path(__file__).parent / "results"
B, H, L, D = 16, 8, 1024, 64
CHUNKINGS = {"one chunk per sequence": L, "L chunked at 256": 256}
MEM = {"batch": 1, "heads": 2, "length": 16384, "dim": 32, "chunk": 2048}
MEM_BOUND_MIB = 64
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: dask.distributed starts workers with MALLOC_TRIM_THRESHOLD_=65536, which also fixes
#: glibc's mmap threshold at 128 KiB: every (H, 128, 256) block of the kernel is then a
#: fresh mmap that faults its pages in (1.8x slower per core, measured). The
#: recommended worker setting (docs/scale_out.md) keeps such blocks on the heap.
#: It must be set before the worker process starts (``env=`` comes too late for glibc).
RECOMMENDED = {"MALLOC_TRIM_THRESHOLD_": 256 * 2**20, "MALLOC_MMAP_THRESHOLD_": 32 * 2**20}
WORKER_ENVS = ("recommended", "dask default")


def _local_cluster(workers: int, env: str) -> Any:
    import dask
    import distributed

    key = "distributed.nanny.pre-spawn-environ"
    for name in RECOMMENDED:  # the nanny (in this process) leaves them in os.environ
        os.environ.pop(name, None)
    default = {k: v for k, v in dask.config.get(key).items() if k not in RECOMMENDED}
    default["MALLOC_TRIM_THRESHOLD_"] = 65536  # distributed's default
    environ = {**default, **RECOMMENDED} if env == "recommended" else default
    with dask.config.set({key: environ}):
        return distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            env=SINGLE_THREAD,
        )


def _ship_by_value(module: Any) -> None:
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


class _Cluster:
    """A LocalCluster of single-threaded worker processes with persisted inputs."""

    def __init__(self, workers: int, env: str = "recommended") -> None:
        import distributed

        self.workers, self.env = workers, env
        self.cluster = _local_cluster(workers, env)
        self.client = distributed.Client(self.cluster)
        _ship_by_value(_timing)  # the workers cannot import benchmarks/
        self.calls = {}
        for label, chunk in CHUNKINGS.items():
            self.calls[label] = self._call((B, H, L, D), (1, H, chunk, D))

    def _call(self, shape: tuple[int, ...], chunks: tuple[int, ...]) -> Any:
        import dask.array as da
        import distributed

        from portable_attn import scaled_dot_product_attention

        rng = da.random.default_rng(0)
        qkv = [rng.standard_normal(shape, chunks=chunks, dtype="float32") for _ in range(3)]
        qkv = self.client.persist(qkv)
        distributed.wait(qkv)
        out = scaled_dot_product_attention(*qkv, is_causal=True)  # lazy
        return out.sum(axis=(1, 2, 3))  # one number per sequence comes back

    def run(self, label: str) -> float:
        self.client.run(start_rss_watch)
        start = time.perf_counter()
        self.client.compute(self.calls[label], sync=True)
        elapsed = time.perf_counter() - start
        self.last_growth = sorted(_mib(g) for g in self.client.run(stop_rss_watch).values())
        return elapsed

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


def _numpy_call() -> Any:
    import numpy as np

    from portable_attn import scaled_dot_product_attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))
    return lambda: scaled_dot_product_attention(q, k, v, is_causal=True)


def _blas_threads() -> int | None:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return max(
        (p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"), default=None
    )


def throughput(reps: int) -> list[dict]:
    """Interleaved medians of NumPy and the Dask configurations."""
    numpy_call = _numpy_call()
    clusters = [_Cluster(1), _Cluster(2), _Cluster(2, "dask default")]
    try:
        runs: dict[str, Any] = {"numpy": numpy_call}
        for c in clusters:
            for label in CHUNKINGS:
                runs[f"dask {c.workers} {c.env} {label}"] = (c, label)
        for run in runs.values():  # warm-up: imports, caches, worker-side first calls
            run() if callable(run) else run[0].run(run[1])
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(reps):
            for name, run in runs.items():
                if callable(run):
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
                else:
                    times[name].append(run[0].run(run[1]))
                    times[name + " growth"] = run[0].last_growth
        rows = [
            {
                "engine": "numpy",
                "blas_threads": _blas_threads(),
                "time_s": statistics.median(times["numpy"]),
                "sequences_per_s": B / statistics.median(times["numpy"]),
                "times_s": times["numpy"],
            }
        ]
        for c in clusters:
            for label in CHUNKINGS:
                name = f"dask {c.workers} {c.env} {label}"
                t = statistics.median(times[name])
                rows.append(
                    {
                        "engine": "dask",
                        "workers": c.workers,
                        "worker_env": c.env,
                        "chunks": label,
                        "time_s": t,
                        "sequences_per_s": B / t,
                        "times_s": times[name],
                        "peak_rss_growth_mib_per_worker": times[name + " growth"],
                        "tasks": len(c.calls[label].__dask_graph__()),
                    }
                )
        return rows
    finally:
        for c in clusters:
            c.close()


def memory(env: str) -> dict:
    """Peak RSS growth per worker for the long causal call on 2 workers."""
    import dask.array as da
    import distributed

    from portable_attn import scaled_dot_product_attention

    b, h, n, d, chunk = (MEM[k] for k in ("batch", "heads", "length", "dim", "chunk"))
    c = _Cluster.__new__(_Cluster)
    c.workers, c.env = 2, env
    c.cluster = _local_cluster(2, env)
    c.client = distributed.Client(c.cluster)
    try:
        rng = da.random.default_rng(1)
        warm = [rng.standard_normal((b, h, 4096, d), chunks=(1, h, 512, d)) for _ in range(3)]
        c.client.compute(scaled_dot_product_attention(*warm, is_causal=True).sum(), sync=True)
        c.calls = {"memory": c._call((b, h, n, d), (1, h, chunk, d))}
        seconds = c.run("memory")
        pair = h * chunk * chunk * 4
        return {
            "case": MEM,
            "worker_env": env,
            "chunk_pair_scores_mib": _mib(pair),
            "bound_mib": MEM_BOUND_MIB,
            "peak_rss_growth_mib_per_worker": c.last_growth,
            "time_s": seconds,
        }
    finally:
        c.close()


_KERNEL_LOOP = """
import sys, time
import numpy as np
from threadpoolctl import threadpool_limits
from portable_attn import scaled_dot_product_attention
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, {h}, {n}, {d}), dtype=np.float32) for _ in range(3))
with threadpool_limits(1):
    call = lambda: scaled_dot_product_attention(q, k, v, is_causal=True, block_size=(128, 256))
    call()
    sys.stdout.write("ready\\n"); sys.stdout.flush(); sys.stdin.readline()
    start = time.perf_counter()
    for _ in range({count}):
        call()
    print(time.perf_counter() - start)
"""


def machine_scaling(sequences: int = 48) -> dict:
    """The cores' own 1 -> 2 scaling: 1 and 2 plain single-threaded processes at once.

    Each process runs the kernel a Dask task runs (one sequence, tiles (128, 256),
    one BLAS thread) `sequences` times; no Dask, no scheduler.
    """
    code = _KERNEL_LOOP.format(h=H, n=L, d=D, count=sequences)
    result = {}
    for n in (1, 2):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, **SINGLE_THREAD),
            )
            for _ in range(n)
        ]
        for p in procs:
            p.stdout.readline()  # each has warmed up
        start = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            p.communicate()
        wall = time.perf_counter() - start
        result[f"{n}_processes_sequences_per_s"] = n * sequences / wall
    result["2_vs_1"] = (
        result["2_processes_sequences_per_s"] / result["1_processes_sequences_per_s"]
    )
    return result


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def jax_run(devices: int, reps: int) -> dict:
    """Throughput on a mesh of `devices` host devices (run in a fresh process)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from portable_attn import scaled_dot_product_attention
    from portable_attn._timing import median_seconds
    from portable_attn.testing import make_backend

    sync = make_backend("jax", exact=False).sync
    mesh = jax.make_mesh((devices,), ("batch",), devices=jax.devices()[:devices])
    sharding = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(0)
    q, k, v = (
        jax.device_put(rng.standard_normal((B, H, L, D), dtype=np.float32), sharding)
        for _ in range(3)
    )
    attend = jax.jit(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True))
    t = median_seconds(lambda: attend(q, k, v), repeats=reps, sync=sync)  # warm-up compiles
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {
        "engine": "jax",
        "devices": devices,
        "time_s": t,
        "sequences_per_s": B / t,
        "peak_rss_mib_process": peak,
    }


def _jax_in_subprocess(devices: int, reps: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, __file__, "--jax-child", str(devices), "--reps", str(reps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratios(rows: list[dict]) -> dict:
    numpy = rows[0]["sequences_per_s"]
    dask = {
        (r["workers"], r["worker_env"], r["chunks"]): r["sequences_per_s"]
        for r in rows
        if r["engine"] == "dask"
    }
    out = {}
    for label in CHUNKINGS:
        two, one = dask[2, "recommended", label], dask[1, "recommended", label]
        out[label] = {
            "dask_2_workers_vs_numpy": round(two / numpy, 3),
            "dask_1_worker_vs_numpy": round(one / numpy, 3),
            "dask_2_vs_1_workers": round(two / one, 3),
            "dask_2_workers_dask_default_env_vs_numpy": round(
                dask[2, "dask default", label] / numpy, 3
            ),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--jax", action="store_true", help="also a JAX mesh of 1 and 2 devices")
    parser.add_argument("--jax-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 7)
    if args.jax_child is not None:
        print(json.dumps(jax_run(args.jax_child, reps)))
        return 0

    load_before = _load()
    scaling_before = machine_scaling()
    rows = throughput(reps)
    mem = [memory(env) for env in WORKER_ENVS]
    scaling = {"before": scaling_before, "after": machine_scaling()}
    if args.jax:
        rows += [_jax_in_subprocess(devices, reps) for devices in (1, 2)]
    ratios = _ratios(rows)
    print(f"B={B} H={H} L={L} D={D} float32 causal, {os.cpu_count()} CPUs, medians of {reps}")
    for r in rows:
        if r["engine"] == "numpy":
            unit, extra = f"numpy ({r['blas_threads']} BLAS threads)", ""
        elif r["engine"] == "dask":
            unit = f"dask {r['workers']} worker(s), {r['worker_env']} env, {r['chunks']}"
            extra = f"  RSS growth MiB {r['peak_rss_growth_mib_per_worker']}  {r['tasks']} keys"
        else:
            unit, extra = (
                f"jax {r['devices']} device(s)",
                f"  peak MiB {r['peak_rss_mib_process']}",
            )
        print(f"  {unit:58} {r['sequences_per_s']:7.2f} seq/s  {r['time_s']:6.3f} s{extra}")
    for label, rs in ratios.items():
        print(f"  {label}: {rs}")
    print(f"  the cores alone, plain single-threaded processes: {scaling}")
    for m in mem:
        growth = m["peak_rss_growth_mib_per_worker"]
        print(f"  memory case {m['case']}, {m['worker_env']} env: RSS growth MiB {growth}")
    environment = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "batch": B,
        "shape": {"B": B, "H": H, "L": L, "D": D, "dtype": "float32", "causal": True},
        "repetitions": reps,
        "load_average_before": load_before,
        "load_average_after": _load(),
        **report.git_state(),
    }
    result = {
        "environment": environment,
        "rows": rows,
        "ratios": ratios,
        "memory": mem,
        "machine_scaling": scaling,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "scale.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
