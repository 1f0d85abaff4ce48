"""Dask: one task per (query chunk, key chunk) pair, its partials merged by a tree.

Chunks over batch and heads are independent tasks, chunks along Lq stay
independent, and the partials of the key chunks of one query chunk are merged
by the exact online softmax. These tests use the local schedulers;
``test_dask_distributed.py`` runs the same computation on worker processes.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from _helpers import randn
from portable_attn import scaled_dot_product_attention
from portable_attn.testing import reference_attention

pytestmark = pytest.mark.backends("dask", reason="Dask-only: chunked, lazy graphs")

B, HQ, HKV, LQ, LK, D = 2, 4, 2, 64, 96, 8
Q_CHUNKS, K_CHUNKS = 16, 24


def _random(shape, chunks, seed):
    """A lazily generated Dask array and the same values in NumPy."""
    import dask.array as da

    lazy = da.random.default_rng(seed).standard_normal(shape, chunks=chunks)
    return lazy, lazy.compute()


def _problem(q_chunk: int, k_chunk: int, lq: int = LQ, lk: int = LK):
    q, q_np = _random((B, HQ, lq, D), (1, HQ, q_chunk, D), seed=1)
    k, k_np = _random((B, HKV, lk, D), (1, HKV, k_chunk, D), seed=2)
    v, v_np = _random((B, HKV, lk, D), (1, HKV, k_chunk, D), seed=3)
    return (q, k, v), (q_np, k_np, v_np)


def _attention_tasks(out) -> int:
    """Tasks of the call's own layer (the inputs' layers are not the call's work)."""
    return len(out.__dask_graph__().layers[out.name])


class _PeakPerTask:
    """The largest memory (traced by tracemalloc) any one task allocated at once.

    Use with the synchronous scheduler: the tasks then run one after another.
    """

    def __init__(self):
        from dask.callbacks import Callback

        self.largest = 0
        parent = self

        class _Watch(Callback):
            def _pretask(self, key, dsk, state):
                tracemalloc.reset_peak()
                self.start = tracemalloc.get_traced_memory()[0]

            def _posttask(self, key, result, dsk, state, worker_id):
                peak = tracemalloc.get_traced_memory()[1] - self.start
                parent.largest = max(parent.largest, peak)

        self.callback = _Watch()

    def __enter__(self):
        tracemalloc.start()
        self.callback.__enter__()
        return self

    def __exit__(self, *exc):
        self.callback.__exit__(*exc)
        tracemalloc.stop()


class TestChunkPairs:
    # L = 256 in chunks of 64: the scores of a chunk pair (128 KiB) outweigh its Q, K, V
    def test_no_task_allocates_more_than_a_few_chunk_pairs(self, backend):
        (q, k, v), (q_np, k_np, v_np) = _problem(64, 64, lq=256, lk=256)
        out = scaled_dot_product_attention(q, k, v, is_causal=True, block_size="dense")
        out.compute(scheduler="sync")  # warm-up: first calls fill caches
        with _PeakPerTask() as watch:
            result = out.compute(scheduler="sync")
        chunk_pair = 1 * HQ * 64 * 64 * 8  # one batch item, all heads, float64
        # logits, masked scores and their exp: about 3 chunk pairs at once
        assert 0 < watch.largest <= 4 * chunk_pair, (watch.largest, chunk_pair)
        expected = reference_attention(q_np, k_np, v_np, is_causal=True)
        np.testing.assert_allclose(result, expected, atol=1e-12, rtol=1e-10)

    def test_the_bound_catches_whole_rows(self, backend):
        """Control: with Lq and Lk unchunked and one block, a task holds a full (Lq, Lk) block."""
        (q, k, v), _ = _problem(256, 256, lq=256, lk=256)
        out = scaled_dot_product_attention(q, k, v, is_causal=True, block_size="dense")
        with _PeakPerTask() as watch:
            out.compute(scheduler="sync")
        assert watch.largest >= 1 * HQ * 256 * 256 * 8  # 16 chunk pairs of the test above

    def test_inside_a_large_chunk_pair_the_tiles_bound_memory(self, backend):
        """The default tiles a chunk pair with EAGER_TILES: no task holds its whole scores."""
        import dask.array as da

        rng = np.random.default_rng(0)
        q, k, v = (
            da.from_array(rng.standard_normal((1, 2, 1024, 8)), chunks=(1, 2, 1024, 8))
            for _ in range(3)
        )
        with _PeakPerTask() as watch:
            scaled_dot_product_attention(q, k, v).compute(scheduler="sync")
        whole_pair = 2 * 1024 * 1024 * 8  # 16 MiB of float64 scores
        assert watch.largest < whole_pair / 4, watch.largest

    def test_output_keeps_the_query_chunks(self, backend):
        import dask.array as da

        q_np = randn(B, HQ, LQ, D)
        q = da.from_array(q_np, chunks=(1, 1, (10, 30, 24), D))
        (_, k, v), (_, k_np, v_np) = _problem(Q_CHUNKS, K_CHUNKS)
        out = scaled_dot_product_attention(q, k, v)
        assert out.chunks[0] == (1, 1)
        assert out.chunks[1] == (2, 2)  # widened to whole groups of G = 2 query heads
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

    @pytest.mark.parametrize("with_score_mod", [False, True])
    def test_model_building_arguments_use_absolute_positions(self, backend, with_score_mod):
        """ALiBi, softcap, score_mod, dropout, q_lengths, a broadcast padding mask, per chunk.

        Without a score_mod the head chunks are single heads (widened to the groups of 2);
        a score_mod sees every batch item and head of its block, as documented.
        """
        import dask.array as da

        rng = np.random.default_rng(6)
        q_np = rng.standard_normal((B, HQ, LQ, D))
        k_np, v_np = (rng.standard_normal((B, HKV, LK, D)) for _ in range(2))
        pad_np = rng.random((B, 1, 1, LK)) < 0.9  # broadcast over heads and queries
        keep_np = rng.random((B, HQ, LQ, LK)) < 0.8
        slopes_np = np.array([0.5, 0.25, 0.125, 0.0625])
        q_len_np, kv_len_np = np.array([LQ, 50]), np.array([70, LK])

        def score_mod(s, b, h, qi, ki):  # depends on every index: placement must be absolute
            return s + 0.01 * (qi - ki) * (h + 1) - 0.1 * b

        kwargs = {"is_causal": True, "softcap": 4.0, "dropout_p": 0.2}
        if with_score_mod:
            kwargs["score_mod"] = score_mod
        q = da.from_array(q_np, chunks=(1, 1, (10, 30, 24), D))
        k, v = (da.from_array(a, chunks=(1, 1, (50, 20, 26), D)) for a in (k_np, v_np))
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            mask=da.from_array(pad_np, chunks=(1, 1, 1, 32)),
            dropout_mask=da.from_array(keep_np, chunks=(1, 2, 16, 48)),
            alibi_slopes=da.from_array(slopes_np, chunks=2),
            q_lengths=da.from_array(q_len_np, chunks=1),
            kv_lengths=da.from_array(kv_len_np, chunks=1),
            **kwargs,
        )
        expected = reference_attention(
            q_np,
            k_np,
            v_np,
            mask=pad_np,
            dropout_mask=keep_np,
            alibi_slopes=slopes_np,
            q_lengths=q_len_np,
            kv_lengths=kv_len_np,
            **kwargs,
        )
        result = out.compute()
        np.testing.assert_allclose(result, expected, atol=1e-12, rtol=1e-10)
        assert np.all(result[1, :, 50:] == 0)  # queries past q_lengths are zero rows

    def test_query_chunks_that_see_no_key_are_zero(self, backend):
        """Bottom-right causal with Lq > Lk: the first query chunks see no key at all."""
        (q, k, v), (q_np, k_np, v_np) = _problem(16, 16, lq=64, lk=24)
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        result = out.compute()
        np.testing.assert_array_equal(result[:, :, :40], 0.0)
        expected = reference_attention(q_np, k_np, v_np, is_causal=True)
        np.testing.assert_allclose(result, expected, atol=1e-12, rtol=1e-10)

    def test_two_dimensional_float32_inputs(self, backend):
        import dask.array as da

        rng = np.random.default_rng(7)
        q_np, k_np, v_np = (rng.standard_normal((40, 8), dtype=np.float32) for _ in range(3))
        q, k, v = (da.from_array(a, chunks=(16, 8)) for a in (q_np, k_np, v_np))
        out = scaled_dot_product_attention(q, k, v, window=(5, 5))
        assert out.shape == (40, 8)
        assert out.dtype == np.float32
        expected = reference_attention(q_np, k_np, v_np, window=(5, 5))
        np.testing.assert_allclose(out.compute(), expected, atol=1e-5, rtol=1e-5)


class TestTasks:
    @pytest.fixture(autouse=True)
    def _a_task_per_pair(self, monkeypatch):
        """Pairs share no task here (TestRuns covers the runs)."""
        from portable_attn._lib import _route

        monkeypatch.setattr(_route, "DASK_TASK_SCORES", 0)

    def test_tasks_are_a_small_multiple_of_the_chunk_pairs(self, backend):
        """No causal structure: every pair is a task, plus one merge per query chunk."""
        (q, k, v), (q_np, k_np, v_np) = _problem(16, 24)  # 4 x 4 chunk pairs per batch item
        out = scaled_dot_product_attention(q, k, v, softcap=5.0)
        pairs = B * 4 * 4
        assert _attention_tasks(out) == pairs + B * 4  # pairs, and a merge per query chunk
        expected = reference_attention(q_np, k_np, v_np, softcap=5.0)
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)

    def test_hidden_chunk_pairs_are_no_tasks(self, backend):
        """Causal over 4 x 4 square chunks: 10 visible pairs, a merge for 3 query chunks."""
        (q, k, v), (q_np, k_np, v_np) = _problem(16, 16, lq=64, lk=64)
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        assert _attention_tasks(out) == B * (10 + 3)
        expected = reference_attention(q_np, k_np, v_np, is_causal=True)
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)

    def test_many_key_chunks_merge_as_a_tree(self, backend):
        """9 key chunks: merges of at most DASK_MERGE_FAN_IN, in two levels."""
        from portable_attn._lib._route import DASK_MERGE_FAN_IN

        (q, k, v), (q_np, k_np, v_np) = _problem(64, 8, lq=64, lk=72)
        out = scaled_dot_product_attention(q, k, v)
        from portable_attn._paths._dask import _merge_task

        graph = dict(out.__dask_graph__().layers[out.name])
        merges = [task for task in graph.values() if task[0] is _merge_task]
        assert len(merges) == B * 3  # (4 + 4) partials, then 2 merged + 1 partial at the root
        assert all(len(task[2]) <= DASK_MERGE_FAN_IN for task in merges)
        assert _attention_tasks(out) == B * (9 + 3)
        expected = reference_attention(q_np, k_np, v_np)
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)

    def test_the_call_computes_nothing(self, backend):
        from dask.callbacks import Callback

        (q, k, v), _ = _problem(Q_CHUNKS, K_CHUNKS)
        ran = []

        class _Count(Callback):
            def _pretask(self, key, dsk, state):
                ran.append(key)

        with _Count():
            lengths = (abs(k[:, 0, 0, 0]) * 10).astype("int64")  # lazy: values unknown
            out = scaled_dot_product_attention(q, k, v, is_causal=True, kv_lengths=lengths)
        assert ran == []
        assert type(out).__module__.startswith("dask")


class TestRuns:
    """Small chunk pairs of a query chunk share a task, which merges them (DASK_TASK_SCORES)."""

    def test_small_pairs_share_one_task_per_query_chunk(self, backend):
        (q, k, v), (q_np, k_np, v_np) = _problem(16, 16, lq=64, lk=64)
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        assert _attention_tasks(out) == B * 4  # 10 visible pairs, no merge task
        expected = reference_attention(q_np, k_np, v_np, is_causal=True)
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)

    @pytest.mark.parametrize("sinks", [False, True])
    def test_runs_reach_the_threshold_then_merge(self, backend, monkeypatch, sinks):
        """A threshold of two pairs: 4 visible key chunks are 2 runs and a merge."""
        import dask.array as da

        from portable_attn._lib import _route

        sink_logits = np.array([0.5, -1.0, 2.0, -np.inf])
        kw = {"sinks": da.from_array(sink_logits)} if sinks else {}
        (q, k, v), (q_np, k_np, v_np) = _problem(16, 16, lq=64, lk=64)
        pair = HQ * 16 * 16  # scores of one pair of a batch item
        monkeypatch.setattr(_route, "DASK_TASK_SCORES", 2 * pair)
        out = scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        # query chunks see 1, 2, 3, 4 key chunks: runs 1, 1, 2 (+ merge), 2 (+ merge)
        assert _attention_tasks(out) == B * (1 + 1 + 3 + 3)
        oracle = {"sinks": sink_logits} if sinks else {}
        expected = reference_attention(q_np, k_np, v_np, is_causal=True, **oracle)
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)


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

    def test_one_chunk_per_sequence_is_one_task_per_sequence(self, backend):
        (q, k, v), (q_np, k_np, v_np) = _problem(LQ, LK)
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        assert _attention_tasks(out) == B
        expected = reference_attention(q_np, k_np, v_np, is_causal=True)
        np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)
