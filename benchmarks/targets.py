"""Issue 23's targets ("fast without tuning"), every one in one command, with a verdict each.

    python benchmarks/targets.py                  # all groups; benchmarks/results/targets.json
    python benchmarks/targets.py --only numpy,dask
    python benchmarks/targets.py --quick          # a smoke run (few repeats; not for publishing)

Each group runs in a fresh process (its own imports, allocator and thread pools), one
after the other; never run it next to other work: the cores are shared. Every figure
is a median of interleaved, round-robin samples in one process
(``benchmarks/_timing.py``); a ratio is the median of per-round ratios. Nothing is
tuned: default flags, no environment variables, a ``LocalCluster`` as created by
default.

- ``numpy``: the default call against the float32 textbook (B=1, H=8, D=64; plain,
  causal, padding at L = 512 and 1024; the dtype of both asserted, outputs compared);
  the same call timed repeatedly in fresh processes whose history differs, after large
  calls (the float32 textbook and ours at L = 4096, which move glibc's mmap and trim
  thresholds) or after a small one (L = 64), the two kinds of process in alternation;
  and the default against the dense path at L = 64-1024 and for a decoding step (the
  rows behind NumPy's ``dense_limit`` and ``BUFFERED_BLOCK_SCORES`` in ``_route.py``).
- ``dask``: one NumPy process of its own (its default call, driven round by round from
  the benchmark, whose process hosts the clusters' schedulers) against ``LocalCluster(n_workers=2,
  threads_per_worker=1)`` and ``n_workers=1`` (nothing else set), B=16, H=8, L=1024,
  D=64, causal, float32, inputs persisted on the workers, one number per sequence back;
  one chunk per sequence and L chunked at 256; the attention's tasks per call; the
  per-task overhead (a graph of no-op tasks on the same cluster); every run starts after
  half a second of rest (Dask's clean-up after a computation would otherwise land on
  the next run, whichever it is); and, as a second row,
  the glibc worker settings of ``benchmarks/scale.py`` (``RECOMMENDED``), to show
  whether they still matter; and first, before any cluster starts, the ceiling of
  1 -> 2 workers on this machine: two single-threaded processes (Dask's worker
  environment) each computing half the sequences at once, against one computing all;
  and Dask's own 1 -> 2 on the same clusters, ``da.map_blocks`` of the NumPy default
  call (one task per sequence, as ours with a chunk per sequence); one more run of each
  with the workers' task stream (seconds computing and transferring); and the NumPy
  call alone after 0.5 s and after 6 s of rest: every process of the rounds rests
  while the others run, and on this VM a call after a rest of seconds is slower, so
  each timed run follows an untimed run of its own.
- ``torch``: ``benchmarks/bench.py --backend torch`` (its SDPA peers get the same
  masks); the targets are window (256, 0) + causal at L = 1024 and 4096 and decode with
  ``kv_lengths``.
- ``jax``: ``benchmarks/bench.py --backend jax``: the whole case table under ``jit``
  against ``jax.nn.dot_product_attention``, and the eager per-call overhead.

The ``numpy``, ``torch`` and ``jax`` groups run ``benchmarks/bench.py`` in full first, so
``cases-<backend>.json`` (the case tables of the README and the Performance page) are
refreshed at the same commit (a ``--quick`` run writes them to a scratch folder).
- ``flax``: ``benchmarks/integrations.py --part flax``: Linen and NNX with our
  ``attention_fn`` against their own attention on a padded batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import report
from _timing import Interleaved, interleaved_seconds

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "targets.json"
GROUPS = ("numpy", "dask", "torch", "jax", "flax")

#: issue 23's bounds, by target name
BOUNDS = {
    "numpy L=1024 vs textbook": 0.75,
    "numpy L=512 vs textbook": 0.90,
    "numpy same call after a large / after a small call": 1.10,
    "dask 2 workers vs numpy, chunk per sequence": 0.85,
    "dask 2 workers vs numpy, L chunked at 256": 0.60,
    "dask 1 -> 2 workers, chunk per sequence": 1.6,
    "dask 1 -> 2 workers, L chunked at 256": 1.6,
    "torch window (256, 0) + causal vs SDPA with the band mask": 0.70,
    "torch decode with kv_lengths vs SDPA with the mask": 1.10,
    "jax jit vs jax.nn, every case at L=1024 and 4096": 0.90,
    "jax eager overhead (us per call over the textbook)": 25.0,
    "flax linen attention_fn vs linen's own": 1.10,
    "flax nnx attention_fn vs nnx's own": 1.10,
}
#: targets where a larger figure is better (throughput ratios)
AT_LEAST = {name for name in BOUNDS if name.startswith("dask")}


def say(*args: Any) -> None:
    """Progress on stderr: a group's stdout carries its JSON."""
    print(*args, file=sys.stderr, flush=True)


def verdict(name: str, value: float) -> dict[str, Any]:
    bound = BOUNDS[name]
    met = value >= bound if name in AT_LEAST else value <= bound
    return {"target": name, "value": round(value, 3), "bound": bound, "met": met}


# --------------------------------------------------------------------------- numpy
def numpy_group(quick: bool) -> dict[str, Any]:
    import numpy as np

    from portable_attn import scaled_dot_product_attention as sdpa

    bench_rows("numpy", quick)  # the case table (cases-numpy.json), in its own process
    h, d = 8, 64
    reps = 3 if quick else 15
    rng = np.random.default_rng(0)

    def textbook(q, k, v, mask=None):
        s = (q @ np.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]))  # never np.sqrt
        if mask is not None:
            s = np.where(mask, s, -math.inf)
        e = np.exp(s - np.max(s, axis=-1, keepdims=True))
        return (e / np.sum(e, axis=-1, keepdims=True)) @ v

    def problem(n: int, case: str, lq: int | None = None, batch: int = 1) -> tuple:
        lq = n if lq is None else lq
        q = rng.standard_normal((batch, h, lq, d), dtype=np.float32)
        k, v = (rng.standard_normal((batch, h, n, d), dtype=np.float32) for _ in range(2))
        kw: dict[str, Any] = {}
        mask = None
        if case == "causal":
            kw = {"is_causal": True}
            mask = np.tril(np.ones((lq, n), dtype=bool), n - lq)
        elif case == "padding":
            mask = np.broadcast_to(np.arange(n) < n - n // 8, (batch, 1, 1, n))
            kw = {"mask": mask}
        return (q, k, v), kw, mask

    rows, targets = [], []
    for n in (512, 1024):
        for case in ("plain", "causal", "padding"):
            (q, k, v), kw, mask = problem(n, case)
            ours, ref = sdpa(q, k, v, **kw), textbook(q, k, v, mask)
            assert ours.dtype == ref.dtype == np.float32, (ours.dtype, ref.dtype)
            np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-4)
            fns = {
                "ours": lambda q=q, k=k, v=v, kw=kw: sdpa(q, k, v, **kw),
                "textbook": lambda q=q, k=k, v=v, m=mask: textbook(q, k, v, m),
            }
            t = interleaved_seconds(fns, repeats=reps)
            ratio = statistics.median(t.ratios("ours", "textbook"))
            rows.append(
                {
                    "L": n,
                    "case": case,
                    "ms": {name: 1e3 * s for name, s in t.medians.items()},
                    "ratio": ratio,
                }
            )
            say(f"numpy L={n} {case}: {ratio:.2f}x the textbook")
            if case == "plain":
                targets.append(verdict(f"numpy L={n} vs textbook", ratio))

    # the same call in processes whose history differs: after large calls (which move
    # glibc's mmap and trim thresholds) or after a small one; each process times the call
    # repeatedly (the first call after a large one also pays cold caches, in any library)
    history = []
    for n in (512, 1024):
        medians: dict[str, list[float]] = {"after large calls": [], "after a small call": []}
        for _ in range(2 if quick else 4):  # the two histories in alternation
            for before in medians:
                medians[before].append(_history_child(n, before, reps))
        large, small = (statistics.median(m) for m in medians.values())
        ratio = large / small
        history.append(
            {
                "L": n,
                "ms": {"after large calls": 1e3 * large, "after a small call": 1e3 * small},
                "large_over_small": ratio,
                "process_medians_ms": {b: [1e3 * x for x in m] for b, m in medians.items()},
            }
        )
        say(f"numpy L={n}: after large calls / after a small call {ratio:.3f}")
        targets.append(
            verdict("numpy same call after a large / after a small call", max(ratio, 1 / ratio))
        )
    targets = _worst(targets, "numpy same call after a large / after a small call")

    # the rows behind the policy's NumPy constants: dense against the default (tiled)
    crossover = []
    for n in (64, 128, 256, 512, 1024):
        (q, k, v), _, _ = problem(n, "plain")
        fns = {
            "default": lambda q=q, k=k, v=v: sdpa(q, k, v),
            "dense": lambda q=q, k=k, v=v: sdpa(q, k, v, block_size="dense"),
            "tiled": lambda q=q, k=k, v=v: sdpa(q, k, v, block_size=(256, 256)),
        }
        t = interleaved_seconds(fns, repeats=reps * 2)
        crossover.append(
            {
                "L": n,
                "ms": {name: 1e3 * s for name, s in t.medians.items()},
                "tiled_over_dense": statistics.median(t.ratios("tiled", "dense")),
            }
        )
    (q, k, v), kw, _ = problem(4096, "causal", lq=1, batch=4)
    fns = {
        "default (one block)": lambda: sdpa(q, k, v, **kw),
        "16 key blocks of 256": lambda: sdpa(q, k, v, block_size=(1, 256), **kw),
        "dense": lambda: sdpa(q, k, v, block_size="dense", **kw),
    }
    t = interleaved_seconds(fns, repeats=reps * 2)
    decode = {"B": 4, "Lq": 1, "Lk": 4096, "ms": {n: 1e3 * s for n, s in t.medians.items()}}
    return {
        "rows": rows,
        "history": history,
        "dense_or_tiled": crossover,
        "decode": decode,
        "targets": targets,
    }


_HISTORY = """
import math, statistics, sys, time
import numpy as np
from portable_attn import scaled_dot_product_attention as sdpa
n, before, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(0)
def textbook(q, k, v):
    s = (q @ np.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]))
    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
    return (e / np.sum(e, axis=-1, keepdims=True)) @ v
q, k, v = (rng.standard_normal((1, 8, n, 64), dtype=np.float32) for _ in range(3))
if before == "after large calls":  # the float32 textbook and ours at L = 4096
    big = [rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in range(3)]
    textbook(*big)
    sdpa(*big)
    del big
else:
    sdpa(*(rng.standard_normal((1, 8, 64, 64), dtype=np.float32) for _ in range(3)))
sdpa(q, k, v)  # the first call after: caches and threads warm up, in any library
times = []
for _ in range(reps):
    start = time.perf_counter()
    sdpa(q, k, v)
    times.append(time.perf_counter() - start)
print(statistics.median(times))
"""


def _history_child(n: int, before: str, reps: int) -> float:
    """Median seconds of the default call at L=`n`, timed in a fresh process after `before`."""
    command = [sys.executable, "-c", _HISTORY, str(n), before, str(reps)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def _worst(targets: list[dict], name: str) -> list[dict]:
    """Keep the worst row of target `name` (one verdict per target)."""
    same = [t for t in targets if t["target"] == name]
    if len(same) < 2:
        return targets
    worst = (
        max(same, key=lambda t: t["value"])
        if name not in AT_LEAST
        else min(same, key=lambda t: t["value"])
    )
    return [t for t in targets if t["target"] != name] + [worst]


# --------------------------------------------------------------------------- dask
def dask_group(quick: bool) -> dict[str, Any]:
    import dask.array as da
    import distributed
    import scale

    from portable_attn import scaled_dot_product_attention as sdpa

    b, h, n, d = (4, 8, 512, 64) if quick else (16, 8, 1024, 64)
    reps = 3 if quick else 7
    chunkings = {"chunk per sequence": n, "L chunked at 256": 256}
    numpy_call = functools.partial(sdpa, is_causal=True)  # the NumPy default call, per chunk
    ceiling = _two_cores_ceiling((b, h, n, d), reps)  # first: nothing else running yet
    idle = _idle_penalty((b, h, n, d), reps)
    # one NumPy process of its own (the clusters' schedulers run in this process, whose
    # threads would share its GIL), driven round by round from here
    numpy_process = _NumpyProcess((b, h, n, d))
    runs: dict[str, Any] = {"numpy": numpy_process.call}
    clusters, tasks, graph_tasks, clients = [], {}, {}, {}
    settings = {"default": None, "glibc settings": scale.RECOMMENDED}
    try:
        for label, env in settings.items():
            for workers in (1, 2) if label == "default" else (2,):
                if env is None:
                    cluster = distributed.LocalCluster(
                        n_workers=workers, threads_per_worker=1, dashboard_address=None
                    )
                else:
                    cluster = scale._local_cluster(workers, "recommended")
                client = distributed.Client(cluster, set_as_default=False)
                clusters.append((cluster, client))
                for chunk_label, chunk in chunkings.items():
                    r = da.random.default_rng(0)
                    arrays = [
                        r.standard_normal((b, h, n, d), chunks=(1, h, chunk, d), dtype="float32")
                        for _ in range(3)
                    ]
                    arrays = client.persist(arrays)
                    client.gather(client.compute([x.sum() for x in arrays]))
                    out = sdpa(*arrays, is_causal=True)
                    layer = dict(out.__dask_graph__().layers[out.name])
                    tasks[chunk_label] = len(layer)
                    total = out.sum(axis=(1, 2, 3))  # one number per sequence comes back
                    inputs = sum(len(dict(x.__dask_graph__())) for x in arrays)  # persisted
                    graph_tasks[chunk_label] = len(dict(total.__dask_graph__())) - inputs
                    name = f"{label}, {workers} worker{'s' * (workers > 1)}, {chunk_label}"
                    runs[name] = lambda c=client, t=total: c.compute(t, sync=True)
                    clients[name] = client
                    if label == "default" and chunk == n:  # Dask's own: no attention graph
                        per_chunk = da.map_blocks(numpy_call, *arrays, dtype="float32")
                        own = per_chunk.sum(axis=(1, 2, 3))
                        name = f"default, {workers} worker{'s' * (workers > 1)}, {MAP_BLOCKS}"
                        runs[name] = lambda c=client, t=own: c.compute(t, sync=True)
                if label == "default" and workers == 2:
                    overhead = _task_overhead(client, 200 if quick else 1000)
        for run in runs.values():  # warm: imports and first calls everywhere
            run()
        t = _settled_rounds(runs, reps)
        streams = {name: _task_stream(client, runs[name]) for name, client in clients.items()}
    finally:
        numpy_process.close()
        for cluster, client in clusters:
            client.close()
            cluster.close()
    medians = t.medians
    rows = [
        {
            "engine": name,
            "s": medians[name],
            "sequences_per_s": b / medians[name],
            "vs_numpy": statistics.median(t.ratios("numpy", name)),
        }
        for name in runs
    ]
    targets = []
    for chunk_label in chunkings:
        two = f"default, 2 workers, {chunk_label}"
        one = f"default, 1 worker, {chunk_label}"
        targets.append(
            verdict(
                f"dask 2 workers vs numpy, {chunk_label}",
                statistics.median(t.ratios("numpy", two)),
            )
        )
        scaling = verdict(
            f"dask 1 -> 2 workers, {chunk_label}", statistics.median(t.ratios(one, two))
        )
        scaling["ceiling"] = round(ceiling["speedup"], 3)  # two processes without Dask
        if chunk_label == "chunk per sequence":  # the same tasks, without our graph
            one, two = (f"default, {w} worker{'s' * (w > 1)}, {MAP_BLOCKS}" for w in (1, 2))
            scaling["dask_map_blocks"] = round(statistics.median(t.ratios(one, two)), 3)
        targets.append(scaling)
    for row in rows:
        say(f"dask {row['engine']}: {row['vs_numpy']:.2f}x numpy's throughput")
    return {
        "shape": {"B": b, "H": h, "L": n, "D": d, "causal": True, "dtype": "float32"},
        "rows": rows,
        "attention_tasks_per_call": tasks,
        "tasks_per_call": graph_tasks,  # the attention's and the sum's: what Dask schedules
        "task_streams": streams,
        "task_overhead": overhead,
        "two_cores_ceiling": ceiling,
        "idle_penalty": idle,
        "targets": targets,
    }


_NUMPY_CALLS = """
import sys
import numpy as np
from portable_attn import scaled_dot_product_attention as sdpa
shape = tuple(int(x) for x in sys.argv[1:5])
step = int(sys.argv[5]) if len(sys.argv) > 5 else shape[0]  # sequences per call
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
for line in sys.stdin:
    for i in range(0, shape[0], step):
        sdpa(q[i : i + step], k[i : i + step], v[i : i + step], is_causal=True)
    print("done", flush=True)
"""


class _NumpyProcess:
    """The NumPy baseline in a process of its own: each :meth:`call` runs one call there.

    `env`: extra environment variables of the process (the ceiling's single-threaded
    processes get Dask's worker settings); `step`: sequences per call (default all).
    """

    def __init__(
        self, shape: tuple[int, ...], env: dict[str, str] | None = None, step: int | None = None
    ) -> None:
        command = [sys.executable, "-c", _NUMPY_CALLS, *map(str, shape), str(step or shape[0])]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )

    def call(self) -> None:
        self.start()
        self.wait()

    def start(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def wait(self) -> None:
        assert self.proc.stdout is not None
        self.proc.stdout.readline()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


#: Dask's own 1 -> 2 workers on the same clusters: ``da.map_blocks`` of the NumPy
#: default call over the chunk-per-sequence inputs (one task per sequence, as ours)
MAP_BLOCKS = "map_blocks of the NumPy call"

#: seconds the machine is left alone before each timed run: after a computation the
#: scheduler and workers still release keys and collect garbage, on the same 2 cores
SETTLE_S = 0.5


def _two_cores_ceiling(shape: tuple[int, ...], reps: int) -> dict[str, Any]:
    """What 1 -> 2 workers can give on this machine without Dask: the throughput of two
    single-threaded processes, each computing half the sequences at the same time, over
    one computing all of them. Each process runs one call per sequence (a task of "chunk
    per sequence") with Dask's worker environment (``distributed.nanny.pre-spawn-environ``:
    one BLAS thread), so the ratio is what the cores, caches and memory allow.
    """
    import dask

    env = {k: str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}
    b = shape[0]
    one = _NumpyProcess(shape, env, step=1)
    halves = [_NumpyProcess((b // 2, *shape[1:]), env, step=1) for _ in range(2)]
    for p in (one, *halves):
        p.start()
        p.wait()  # warm

    def both() -> None:
        for p in halves:
            p.start()
        for p in halves:
            p.wait()

    try:
        t = _settled_rounds({"one process": one.call, "two processes": both}, reps)
    finally:
        for p in (one, *halves):
            p.close()
    return {
        "environment": env,
        "seconds": t.medians,
        "speedup": statistics.median(t.ratios("one process", "two processes")),
    }


#: rests before a call in :func:`_idle_penalty`: :data:`SETTLE_S`, and about as long as
#: a process of the interleaved rounds waits for its turn
IDLE_S = (SETTLE_S, 6.0)


def _idle_penalty(shape: tuple[int, ...], reps: int) -> dict[str, Any]:
    """The NumPy default call after a short and after a long rest, in one process alone.

    Every process of the interleaved rounds (the NumPy process, the workers) rests
    while the others run. On a VM whose balloon reports free pages to the host, memory
    a process freed comes back slower after such a rest: this row shows what that
    costs a call here, before any cluster starts.
    """
    proc = _NumpyProcess(shape)
    proc.call()  # warm
    samples: dict[str, list[float]] = {f"after {s:g} s": [] for s in IDLE_S}
    try:
        for _ in range(reps):
            for rest, name in zip(IDLE_S, samples, strict=True):
                time.sleep(rest)
                start = time.perf_counter()
                proc.call()
                samples[name].append(time.perf_counter() - start)
    finally:
        proc.close()
    t = Interleaved(samples)
    short, long = samples
    return {
        "seconds": t.medians,
        "long_over_short": statistics.median(t.ratios(long, short)),
    }


def _settled_rounds(runs: dict[str, Any], reps: int) -> Interleaved:
    """Interleaved rounds (the order rotating), each run timed after :data:`SETTLE_S` of rest.

    Each timed run follows an untimed run of its own (then the rest): every process
    rests while the others run, and on this VM a process's first call after a rest of
    seconds is slower (:func:`_idle_penalty`), which would time the machine's memory
    reporting rather than the engines.
    """
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(reps):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            time.sleep(SETTLE_S)
            runs[name]()  # untimed: back from the rest
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            runs[name]()
            samples[name].append(time.perf_counter() - start)
    return Interleaved(samples)


def _task_stream(client: Any, run: Any) -> dict[str, Any]:
    """One more run of `run` on `client`'s cluster, with what its workers spent it on.

    Seconds summed over the workers' task stream by action (``compute``: running tasks;
    ``transfer``: fetching inputs from the other worker), against the run's wall time
    times the workers: what is left is waiting, scheduling and Dask's own work.
    """
    import distributed

    time.sleep(SETTLE_S)
    run()  # untimed, as in the rounds
    time.sleep(SETTLE_S)
    with distributed.get_task_stream(client) as stream:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    spent: dict[str, float] = {}
    for record in stream.data:
        for part in record["startstops"]:
            spent[part["action"]] = spent.get(part["action"], 0.0) + part["stop"] - part["start"]
    workers = len(client.scheduler_info()["workers"])
    return {"wall_s": wall, "workers": workers, "tasks": len(stream.data), "seconds": spent}


def _noop(x: int) -> int:
    return x


def _task_overhead(client: Any, count: int) -> dict[str, Any]:
    """Seconds per task of a graph of `count` independent no-op tasks on `client`'s cluster."""
    client.gather(client.map(_noop, range(10), pure=False))  # warm
    start = time.perf_counter()
    client.gather(client.map(_noop, range(count), pure=False))
    seconds = time.perf_counter() - start
    return {"tasks": count, "ms_per_task": 1e3 * seconds / count}


# --------------------------------------------------------------------------- torch, jax
def bench_rows(backend: str, quick: bool) -> dict[str, Any]:
    """Run benchmarks/bench.py for `backend` in a fresh process; return its JSON.

    A full run writes ``benchmarks/results/cases-<backend>.json`` (the case table the
    README and the Performance page show, at this commit); a quick one a scratch copy.
    """
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) if quick else HERE / "results"
        command = [sys.executable, str(HERE / "bench.py"), "--backend", backend]
        command += ["--out", str(folder)] + (["--quick"] if quick else [])
        subprocess.run(command, check=True, stdout=sys.stderr)
        return json.loads((folder / f"cases-{backend}.json").read_text())


def torch_group(quick: bool) -> dict[str, Any]:
    data = bench_rows("torch", quick)
    targets = []
    for row in data["rows"]:
        if row["dtype"] != "float32" or row["case"] not in ("window+causal", "decode+kv_lengths"):
            continue
        peer = next(p for p in row["ratios"] if p.startswith("sdpa"))
        if row["case"] == "window+causal":
            name = "torch window (256, 0) + causal vs SDPA with the band mask"
        else:
            name = "torch decode with kv_lengths vs SDPA with the mask"
        targets.append(verdict(name, row["ratios"][peer]) | {"L": row["Lk"], "peer": peer})
    return {"cases": "cases-torch.json", "environment": data["environment"], "targets": targets}


def jax_group(quick: bool) -> dict[str, Any]:
    data = bench_rows("jax", quick)
    name = "jax jit vs jax.nn, every case at L=1024 and 4096"
    worst = None
    for row in data["rows"]:
        peer = "jax.nn" if "jax.nn" in row["ratios"] else None
        if peer is None or row["dtype"] != "float32":
            continue
        if worst is None or row["ratios"][peer] > worst[1]:
            worst = (f"{row['case']} L={row['Lk']}", row["ratios"][peer])
    targets = [verdict(name, worst[1]) | {"worst_case": worst[0]}] if worst else []
    over = data["overhead"]["difference_us"]
    targets.append(verdict("jax eager overhead (us per call over the textbook)", over))
    return {
        "cases": "cases-jax.json",
        "overhead": data["overhead"],
        "environment": data["environment"],
        "targets": targets,
    }


def flax_group(quick: bool) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "integrations.py"), "--part", "flax"]
    command += ["--quick"] if quick else []
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    targets = []
    for row in rows:
        kind = "linen" if "linen" in row["what"] else "nnx"
        targets.append(verdict(f"flax {kind} attention_fn vs {kind}'s own", row["ratio"]))
    return {"rows": rows, "targets": targets}


GROUP_FUNCTIONS = {
    "numpy": numpy_group,
    "dask": dask_group,
    "torch": torch_group,
    "jax": jax_group,
    "flax": flax_group,
}


def environment() -> dict[str, Any]:
    """``bench.py``'s record of the machine and commit, with the load average now."""
    import bench

    return bench.environment("numpy") | {"load_average": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups")
    parser.add_argument("--quick", action="store_true", help="few repeats, small sizes")
    parser.add_argument("--group", choices=GROUPS, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.group:
        print(json.dumps(GROUP_FUNCTIONS[args.group](args.quick)))
        return 0
    groups = [g for g in args.only.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    data = {"environment": environment(), "quick": args.quick, "groups": {}}
    data["groups"] = dict(previous.get("groups", {}))  # groups not run now keep their rows
    for group in groups:
        command = [
            sys.executable,
            __file__,
            "--group",
            group,
            *(["--quick"] if args.quick else []),
        ]
        done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["environment"] = result.get("environment", {}) | environment()
        data["groups"][group] = result
    data["environment"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}\n")
    print(report.targets_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
