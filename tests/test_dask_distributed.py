"""Dask on a real ``dask.distributed`` cluster: two worker processes with capped memory.

The workers may each use ``WORKER_MEMORY``; the nanny kills a worker whose
resident memory passes 95% of it. A full (Lq, Lk) block of scores for one batch
item (``FULL_BLOCK``) does not fit under that cap, one chunk pair
(``CHUNK_PAIR``) does with room to spare. The control test shows the cap bites:
the same call with Lq and Lk unchunked kills a worker.

Inputs are generated on the workers (``dask.array.random``), so nothing large
crosses from this process either. A third test polls each worker's resident memory
during one long causal call: its growth stays under four chunk pairs of scores,
because each chunk pair is one task whose tiles never build the pair's scores.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from portable_attn import scaled_dot_product_attention
from portable_attn.testing import reference_attention


def _load_bench_timing():
    """``benchmarks/_timing.py``, the one copy of the worker RSS watch (not in the package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "_timing.py"
    spec = importlib.util.spec_from_file_location("portable_attn_bench_timing", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # cloudpickle ships it by value: by its name
    spec.loader.exec_module(module)
    return module


_bench_timing = _load_bench_timing()
start_rss_watch, stop_rss_watch = _bench_timing.start_rss_watch, _bench_timing.stop_rss_watch

pytestmark = pytest.mark.backends("dask", reason="Dask-only: a dask.distributed cluster")

B, H, L, D, CHUNK = 2, 4, 4096, 16, 512
WORKER_MEMORY = 400 * 2**20
CHUNK_PAIR = H * CHUNK * CHUNK * 4  # one batch item, all heads, float32: 4 MiB
FULL_BLOCK = H * L * L * 4  # 256 MiB: with its exp, more than a worker may hold


@pytest.fixture(scope="module")
def client(request):
    try:
        import dask
        import distributed
    except ImportError:
        if request.config.getoption("--backend"):  # the Dask session must have it
            pytest.fail("the Dask session needs dask.distributed: install dask[distributed]")
        pytest.skip("dask.distributed is not installed")
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import tests/
    cloudpickle.register_pickle_by_value(_bench_timing)  # nor benchmarks/
    settings = {
        "distributed.worker.memory.target": False,  # no spilling to disk: memory is the test
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": 0.95,
        "distributed.worker.memory.monitor-interval": "10ms",
        "distributed.scheduler.allowed-failures": 0,
    }
    with dask.config.set(settings):
        cluster = distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit=WORKER_MEMORY,
            dashboard_address=None,
            env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        )
        with cluster, distributed.Client(cluster) as c:
            c.register_plugin(_largest_result_plugin())
            yield c


PLUGIN = "portable-attn-largest-result"


def _largest_result_plugin():
    """A worker plugin that records the largest array chunk its worker computed or received."""
    from distributed import WorkerPlugin

    class LargestResult(WorkerPlugin):
        name = PLUGIN

        def setup(self, worker):
            self.worker = worker
            self.largest = 0

        def transition(self, key, start, finish, **kwargs):
            if finish == "memory" and isinstance(key, tuple):  # array chunks have tuple keys
                value = self.worker.data.get(key)
                if isinstance(value, np.ndarray):
                    self.largest = max(self.largest, value.nbytes)

    return LargestResult()


def _largest(client) -> dict[str, int]:
    def read(dask_worker):
        return dask_worker.plugins[PLUGIN].largest

    return client.run(read)


def _inputs(chunk: int):
    import dask.array as da

    rng = da.random.default_rng(0)
    shape, chunks = (B, H, L, D), (1, H, chunk, D)
    return tuple(rng.standard_normal(shape, chunks=chunks, dtype=np.float32) for _ in range(3))


def test_two_worker_processes_match_numpy(client):
    q, k, v = _inputs(CHUNK)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)  # lazy: nothing computed yet
    rows = slice(3000, 3064)  # check a band of query rows against the float64 oracle
    # one request for everything: resubmitting keys that a finished request is releasing
    # can race in the scheduler
    q0, k0, v0, out_rows, total = client.compute(
        [q[0], k[0], v[0], out[0, :, rows], out.sum()], sync=True
    )
    visible = np.arange(L)[None, :] <= np.arange(L)[rows, None]  # causal, Lq == Lk
    expected = reference_attention(q0[:, rows], k0, v0, mask=visible)
    np.testing.assert_allclose(out_rows, expected, atol=2e-5, rtol=1e-4)
    assert np.isfinite(total)
    largest = _largest(client)
    assert len(largest) == 2, "both worker processes must take part"
    assert all(0 < n <= CHUNK_PAIR for n in largest.values()), (largest, CHUNK_PAIR)


def test_the_memory_cap_stops_a_whole_row_block(client):
    """Control: the dense path unchunked along Lq and Lk needs FULL_BLOCK; a worker dies.

    (The default would tile such a call: its scores pass the dense memory limit.)
    """
    import distributed

    assert FULL_BLOCK > WORKER_MEMORY // 2
    q, k, v = _inputs(L)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, block_size="dense")
    with pytest.raises(distributed.scheduler.KilledWorker):
        client.compute(out.sum(), sync=True)
    client.wait_for_workers(2, timeout=60)


# The memory test: B=1, H=2, L=16384, D=32, float32, chunks of 2048 along L (36 visible
# chunk pairs under causal masking; the scores of one pair are 2 x 2048 x 2048 x 4 B).
MEM_H, MEM_L, MEM_D, MEM_CHUNK = 2, 16384, 32, 2048
#: Issue 15's bound: "4 chunk pairs of float32 scores", which it counts as 16 MiB each;
#: 2 heads make a pair 32 MiB, so this is two of them.
RSS_GROWTH_BOUND = 64 * 2**20


def _long_inputs(length: int, chunk: int):
    import dask.array as da

    rng = da.random.default_rng(1)
    shape, chunks = (1, MEM_H, length, MEM_D), (1, MEM_H, chunk, MEM_D)
    return tuple(rng.standard_normal(shape, chunks=chunks, dtype=np.float32) for _ in range(3))


def test_worker_memory_grows_by_less_than_four_chunk_pairs(client):
    import distributed

    # warm-up on both workers: imports and caches are not the call's memory
    warm = _long_inputs(2 * MEM_CHUNK, MEM_CHUNK // 4)
    client.compute(scaled_dot_product_attention(*warm, is_causal=True).sum(), sync=True)
    q, k, v = client.persist(list(_long_inputs(MEM_L, MEM_CHUNK)))
    distributed.wait([q, k, v])  # the inputs (4 MiB each) are in memory before the watch
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    client.run(start_rss_watch)
    try:
        total = client.compute(out.sum(), sync=True)
    finally:
        growth = client.run(stop_rss_watch)
    assert np.isfinite(total)
    assert len(growth) == 2
    assert all(0 <= g < RSS_GROWTH_BOUND for g in growth.values()), {
        w: f"{g / 2**20:.1f} MiB" for w, g in growth.items()
    }
