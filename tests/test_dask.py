"""Dask: chunked inputs give a lazy graph whose tasks each hold one chunk pair at most.

Chunks over batch and heads are independent tasks, chunks along Lq stay
independent, and chunks along Lk are merged by the online softmax of the tiled
path. These tests use the local threaded scheduler; ``test_dask_distributed.py``
runs the same computation on worker processes with capped memory.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import randn
from portable_attn import scaled_dot_product_attention
from portable_attn._reference import reference_attention

pytestmark = pytest.mark.backends("dask", reason="Dask-only: chunked, lazy graphs")

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 64, 96, 8
Q_CHUNKS, K_CHUNKS = 16, 24


def _random(shape, chunks, seed):
    """A lazily generated Dask array and the same values in NumPy."""
    import dask.array as da

    lazy = da.random.default_rng(seed).standard_normal(shape, chunks=chunks)
    return lazy, lazy.compute()


class _LargestResult:
    """Record the largest array any task of a local-scheduler computation returned."""

    def __init__(self):
        from dask.callbacks import Callback

        self.largest = 0
        parent = self

        class _Watch(Callback):
            def _posttask(self, key, result, dsk, state, worker_id):
                # chunk keys are tuples; the final gather of the result is not a task's work
                if isinstance(key, tuple) and isinstance(result, np.ndarray):
                    parent.largest = max(parent.largest, result.nbytes)

        self.callback = _Watch()


def _problem(q_chunk: int, k_chunk: int):
    q, q_np = _random((B, HQ, LQ, D), (1, HQ, q_chunk, D), seed=1)
    k, k_np = _random((B, HKV, LK, D), (1, HKV, k_chunk, D), seed=2)
    v, v_np = _random((B, HKV, LK, D), (1, HKV, k_chunk, D), seed=3)
    return (q, k, v), (q_np, k_np, v_np)


class TestChunkPairs:
    def test_no_task_returns_more_than_one_chunk_pair(self, backend):
        (q, k, v), (q_np, k_np, v_np) = _problem(Q_CHUNKS, K_CHUNKS)
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        watch = _LargestResult()
        with watch.callback:
            result = out.compute(scheduler="sync")
        chunk_pair = 1 * HQ * Q_CHUNKS * K_CHUNKS * 8  # one batch item, all heads, float64
        assert 0 < watch.largest <= chunk_pair, (watch.largest, chunk_pair)
        expected = reference_attention(q_np, k_np, v_np, is_causal=True)
        np.testing.assert_allclose(result, expected, atol=1e-12, rtol=1e-10)

    def test_the_bound_catches_whole_rows(self, backend):
        """Control: with Lq and Lk unchunked, a task holds a full (Lq, Lk) block."""
        (q, k, v), _ = _problem(LQ, LK)
        watch = _LargestResult()
        with watch.callback:
            out = scaled_dot_product_attention(q, k, v, is_causal=True, block_size="dense")
            out.compute(scheduler="sync")
        assert watch.largest >= 1 * HQ * LQ * LK * 8

    def test_output_keeps_the_query_chunks(self, backend):
        import dask.array as da

        q_np = randn(B, HQ, LQ, D)
        q = da.from_array(q_np, chunks=(1, 2, (10, 30, 24), D))
        (_, k, v), (_, k_np, v_np) = _problem(Q_CHUNKS, K_CHUNKS)
        out = scaled_dot_product_attention(q, k, v)
        assert out.chunks[0] == (1, 1)
        assert out.chunks[-2] == (10, 30, 24)
        expected = reference_attention(q_np, k_np, v_np)
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)

    def test_every_feature_with_uneven_chunks(self, backend):
        import dask.array as da

        rng = np.random.default_rng(4)
        q_np = rng.standard_normal((B, HQ, LQ, D))
        k_np = rng.standard_normal((B, HKV, LK, D))
        v_np = rng.standard_normal((B, HKV, LK, D))
        mask_np = rng.random((LQ, LK)) < 0.8
        mask_np[5] = False  # a row no key may be seen by
        bias_np = rng.standard_normal((HQ, LQ, LK))
        kv_len_np = np.array([LK, 40])
        q_chunks, k_chunks = (1, 2, (10, 30, 24), D), (1, 1, (50, 20, 26), D)
        q = da.from_array(q_np, chunks=q_chunks)
        k, v = (da.from_array(a, chunks=k_chunks) for a in (k_np, v_np))
        kwargs = {"is_causal": True, "window": (30, None)}
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            mask=da.from_array(mask_np, chunks=(16, 32)),
            bias=da.from_array(bias_np, chunks=(2, 16, 32)),
            kv_lengths=da.from_array(kv_len_np, chunks=1),
            **kwargs,
        )
        expected = reference_attention(
            q_np, k_np, v_np, mask=mask_np, bias=bias_np, kv_lengths=kv_len_np, **kwargs
        )
        result = out.compute()
        np.testing.assert_allclose(result, expected, atol=1e-12, rtol=1e-10)
        assert np.all(result[:, :, 5] == 0)  # fully masked rows stay exactly zero


class TestOneSideChunked:
    @pytest.mark.parametrize("side", ["query", "key"])
    def test_only_one_sequence_axis_chunked(self, backend, side):
        import dask.array as da

        rng = np.random.default_rng(5)
        q_np = rng.standard_normal((B, HQ, LQ, D))
        k_np, v_np = (rng.standard_normal((B, HKV, LK, D)) for _ in range(2))
        q_chunks = (1, HQ, Q_CHUNKS if side == "query" else LQ, D)
        k_chunks = (1, HKV, K_CHUNKS if side == "key" else LK, D)
        q = da.from_array(q_np, chunks=q_chunks)
        k, v = (da.from_array(a, chunks=k_chunks) for a in (k_np, v_np))
        out = scaled_dot_product_attention(q, k, v, is_causal=True, window=(40, None))
        assert out.chunks[-2] == q.chunks[-2]
        expected = reference_attention(q_np, k_np, v_np, is_causal=True, window=(40, None))
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)
