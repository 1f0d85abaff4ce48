"""Query blocks in threads (``portable_attn._paths._threads``): the tiled path's result."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from _helpers import (
    TILE_CASES,
    TILE_SIZES,
    assert_close,
    float32_error_bound,
    on_backend,
    qkv,
    randn,
)
from portable_attn._lib._call import prepare
from portable_attn._lib._cpu import available_workers
from portable_attn._lib._path import Tiled
from portable_attn._lib._route import fold_row_sums
from portable_attn._lib._tiled import tiled_forward
from portable_attn._paths._threads import threaded_attention
from portable_attn.testing import reference_attention

pytestmark = pytest.mark.backends("numpy", reason="threads for NumPy's one-core ufuncs")


def _threaded_and_tiled(backend, q, k, v, block_q, block_k, workers, dtype="float64", **kw):
    arrays = [backend.asarray(a, dtype) for a in (q, k, v)]
    call = prepare(*arrays, **on_backend(backend, kw))
    fold = fold_row_sums(call)
    path = Tiled(block_q, block_k, fold=fold, walk="buffered", workers=workers)
    threaded, _ = threaded_attention(call, path)
    tiled, _ = tiled_forward(call, block_q, block_k, fold=fold)
    return call.finish(threaded), call.finish(tiled)


@pytest.mark.parametrize("name", list(TILE_CASES))
@pytest.mark.parametrize(("lq", "lk"), TILE_SIZES)
@pytest.mark.parametrize(("block_q", "block_k", "workers"), [(4, 5, 2), (3, 7, 3), (8, 64, 2)])
def test_equals_tiled_path_and_oracle(backend, name, lq, lk, block_q, block_k, workers):
    kw = TILE_CASES[name](lq, lk)
    q, k, v = qkv(lq=lq, lk=lk)  # GQA: 4 query heads over 2 key/value heads
    threaded, tiled = _threaded_and_tiled(backend, q, k, v, block_q, block_k, workers, **kw)
    np.testing.assert_array_equal(backend.to_numpy(threaded), backend.to_numpy(tiled))
    if "mask_mod" not in kw:  # the oracle takes masks (tests/test_buffered.py converts)
        assert_close(backend, threaded, reference_attention(q, k, v, **kw))


def test_causal_more_queries_than_keys_has_zero_rows(backend):
    q, k, v = qkv(lq=20, lk=6)
    threaded, _ = _threaded_and_tiled(backend, q, k, v, 3, 4, 2, is_causal=True)
    out = backend.to_numpy(threaded)
    assert np.all(out[..., :14, :] == 0)
    assert_close(backend, threaded, reference_attention(q, k, v, is_causal=True))


def test_fully_masked_rows_and_query_blocks_are_zero(backend):
    q, k, v = qkv(lq=12, lk=12)
    mask = np.ones((12, 12), dtype=bool)
    mask[:4] = False  # the first query block (and worker run) sees nothing
    mask[[6, 9]] = False
    threaded, _ = _threaded_and_tiled(backend, q, k, v, 4, 4, 2, mask=mask)
    out = backend.to_numpy(threaded)
    assert np.all(out[..., :4, :] == 0)
    assert np.all(out[..., [6, 9], :] == 0)
    assert_close(backend, threaded, reference_attention(q, k, v, mask=mask))


@pytest.mark.parametrize("limit_blas", [True, False])
@pytest.mark.parametrize("tasks_per_worker", [1, 3])
def test_float32_is_as_close_to_the_oracle_as_the_tiled_path(
    backend, limit_blas, tasks_per_worker
):
    """In float32 the threads' BLAS calls may sum in another order than the tiled path's
    (single-threaded BLAS, another library version): both are bounded, not equal."""
    q, k, v = (randn(1, 4, 300, 32, seed=s, dtype=np.float32) for s in range(3))
    call = prepare(q, k, v, is_causal=True)
    fold = fold_row_sums(call)
    threaded, _ = threaded_attention(
        call,
        Tiled(64, 128, fold=fold, walk="buffered", workers=2),
        limit_blas=limit_blas,
        tasks_per_worker=tasks_per_worker,
    )
    tiled, _ = tiled_forward(call, 64, 128, fold=fold)
    assert threaded.dtype == np.float32
    expected = reference_attention(q, k, v, is_causal=True)
    bound = float32_error_bound(v, length=300 + 32)
    assert np.abs(tiled - expected).max() <= bound
    assert np.abs(threaded - expected).max() <= bound


@pytest.mark.parametrize(
    ("block_q", "workers", "inline"),
    [(2, 1, True), (64, 4, True), (2, 2, False)],
    ids=["one_worker", "one_block", "two_workers"],
)
def test_one_worker_or_one_block_runs_inline(backend, block_q, workers, inline):
    """The scores of every block are computed in the calling thread (a `score_mod` sees
    which); with two workers and several blocks, in other threads."""
    seen = set()

    def record_thread(scores, b, h, i, j):
        seen.add(threading.get_ident())
        return scores

    q, k, v = qkv()
    kw = {"score_mod": record_thread}
    threaded, tiled = _threaded_and_tiled(backend, q, k, v, block_q, 3, workers, **kw)
    np.testing.assert_array_equal(backend.to_numpy(threaded), backend.to_numpy(tiled))
    seen_by_threaded = seen - {threading.get_ident()}  # tiled_forward runs here too
    assert (not seen_by_threaded) == inline, seen


def test_available_workers_is_positive():
    assert available_workers() >= 1


@pytest.fixture
def without_threadpoolctl(monkeypatch):
    """``import threadpoolctl`` raises ImportError, as if it were not installed."""
    import portable_attn._lib._cpu as threads

    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    threads._controller.cache_clear()
    yield threads
    monkeypatch.undo()
    threads._controller.cache_clear()


def test_without_threadpoolctl(backend, without_threadpoolctl):
    threads = without_threadpoolctl
    assert not threads.can_limit_blas()  # the import failed: nothing limits BLAS
    q, k, v = qkv(lq=17, lk=19)
    threaded, tiled = _threaded_and_tiled(backend, q, k, v, 4, 5, 2, is_causal=True)
    np.testing.assert_array_equal(backend.to_numpy(threaded), backend.to_numpy(tiled))
