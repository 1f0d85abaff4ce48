"""Every routing decision of ``portable_attn._lib._route``, pinned (not its timing).

Each test asks :func:`route` which path a call takes, on every backend, and checks
the values of the routed call against the float64 oracle where the decision
matters for what is computed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import portable_attn._lib._route as policy
from _helpers import set_kernels, set_rows
from portable_attn import scaled_dot_product_attention
from portable_attn._lib._call import prepare
from portable_attn._lib._compat import reads_host_values
from portable_attn._lib._path import DaskGrid, Dense, Empty, Native, Tiled
from portable_attn._lib._route import LIBRARIES, default_tiles
from portable_attn.testing import reference_attention


@pytest.fixture(autouse=True)
def _small_calls_take_the_kernel(monkeypatch):
    """The 9-token calls below would take no kernel (``Kernel.min_keys``, tested alone)."""
    set_kernels(monkeypatch, min_keys=0)


def choose_path(call, block_size, implementation):
    return policy.route(call, block_size, implementation).path


def _no_dense_limit(monkeypatch, *names):
    """Every library (or those named) tiles whatever its size."""
    for name in names or (None,):
        set_rows(monkeypatch, name, dense_limit=0)


def _tiles(name):
    return LIBRARIES[(name, "cpu")]


def _arrays(backend, *, hq=2, hkv=2, lq=9, lk=9, d=4, dv=4, seed=0):
    rng = np.random.default_rng(seed)
    data = [
        rng.standard_normal((1, hq, lq, d)),
        rng.standard_normal((1, hkv, lk, d)),
        rng.standard_normal((1, hkv, lk, dv)),
    ]
    return data, [backend.asarray(a) for a in data]


def _route(path):
    """The route of a path, without the decisions pinned by their own tests: folding,
    the walk, the backward and its exp, the native kernel's guard and minimum of keys."""
    if isinstance(path, Tiled):
        walk = "loop" if path.walk == "loop" else "python"
        return dataclasses.replace(path, fold=False, walk=walk, backward=None, exp2=False)
    if isinstance(path, Dense):
        return dataclasses.replace(path, fold=False)
    if isinstance(path, Native):
        return Native(tiles=path.tiles)
    if isinstance(path, DaskGrid):
        return dataclasses.replace(path, inner=_route(path.inner))
    return path


def _path(backend, *, block_size=None, implementation=None, shape=None, **kwargs):
    _, (q, k, v) = _arrays(backend, **(shape or {}))
    return _route(choose_path(prepare(q, k, v, **kwargs), block_size, implementation))


def _halves(n):
    return ((n + 1) // 2, n // 2)  # the Dask test arrays' chunks along an axis of n


def _dask(lq=9, lk=9, inner="auto"):
    """The Dask path: one task per (Lq chunk, Lk chunk) pair, `inner` tiles inside it.

    By default the NumPy chunk pairs' tiles (:func:`policy.buffered_tiles`).
    """
    if inner == "auto":
        inner = policy.buffered_tiles(max(_halves(lq)), max(_halves(lk)))
    inner = Dense() if inner is None else Tiled(*inner)
    return DaskGrid(
        _halves(lq), _halves(lk), inner, policy.DASK_MERGE_FAN_IN, policy.DASK_TASK_SCORES
    )


def _portable(backend, lq=9, lk=9):
    """The portable path of a call with block_size None: Dask follows its Lq/Lk chunks."""
    if backend.family == "dask":
        return _dask(lq, lk)
    return Dense(weights_first=backend.family == "jax")  # XLA fuses (P / l) @ V


def _fused(backend):
    return backend.family == "torch"  # the one library whose native kernel is fused by default


class TestDefaultRoute:
    def test_plain_and_square_causal_go_to_a_fused_native_kernel(self, backend):
        expected = Native() if _fused(backend) else _portable(backend)
        assert _path(backend) == expected
        assert _path(backend, is_causal=True) == expected

    def test_masks_bias_lengths_and_windows_go_native_on_a_fused_kernel(self, backend):
        bias = backend.asarray(np.zeros((9, 9)))
        mask = backend.asarray(np.ones((9, 9), dtype=bool))
        lengths = backend.asarray(np.array([5]))
        expected = Native() if _fused(backend) else _portable(backend)
        assert _path(backend, bias=bias) == expected
        assert _path(backend, mask=mask) == expected
        assert _path(backend, kv_lengths=lengths) == expected
        assert _path(backend, window=(2, 0)) == expected
        # bottom-right causal with Lq != Lk goes to the kernel as a mask
        lq4 = Native() if _fused(backend) else _portable(backend, lq=4)
        assert _path(backend, is_causal=True, shape={"lq": 4}) == lq4

    def test_ragged_host_lengths_run_the_kernel_once_per_sequence(self, backend):
        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((3, 2, n, 4)) for n in (1, 9, 9))
        lengths = np.array([3, 9, 6])
        args = [backend.asarray(a) for a in (q, k, v)]
        kw = {"is_causal": True, "kv_lengths": backend.asarray(lengths)}
        path = choose_path(prepare(*args, **kw), None, None)
        read = reads_host_values(kw["kv_lengths"])  # differing lengths read on the host
        assert isinstance(path, Native) is _fused(backend)
        assert getattr(path, "per_sequence", False) is (_fused(backend) and read)
        equal = {**kw, "kv_lengths": backend.asarray(np.array([6, 6, 6]))}
        assert not getattr(choose_path(prepare(*args, **equal), None, None), "per_sequence", 0)
        out = scaled_dot_product_attention(*args, **kw)
        expected = reference_attention(q, k, v, is_causal=True, kv_lengths=lengths)
        np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-5, atol=1e-6)

    def test_too_few_keys_for_the_kernel_stay_portable(self, backend, monkeypatch):
        set_kernels(monkeypatch, ("torch", "cpu"), min_keys=16)
        few, enough = {"lq": 4, "lk": 15}, {"lq": 4, "lk": 16}
        on_cpu = _fused(backend) and backend.device_name == "cpu"
        assert (_path(backend, shape=few) == Native()) == (_fused(backend) and not on_cpu)
        assert (_path(backend, shape=enough) == Native()) == _fused(backend)
        if _fused(backend):  # asked for, the kernel runs as it is
            assert _path(backend, shape=few, implementation="native") == Native()

    @pytest.mark.parametrize(
        "kw",
        [{"softcap": 5.0}, {"score_mod": lambda s, b, h, i, j: s}, {"alibi_slopes": [0.5, 0.25]}],
        ids=["softcap", "score_mod", "alibi"],
    )
    def test_what_no_kernel_can_express_stays_portable(self, backend, kw):
        kw = {
            n: backend.asarray(np.asarray(x)) if isinstance(x, list) else x for n, x in kw.items()
        }
        assert _path(backend, **kw) == _portable(backend)

    def test_a_narrow_window_over_a_long_sequence_runs_the_kernel_per_tile(self, backend):
        """88% of the tile pairs are skipped: the kernel per query tile, over its span only."""
        long = {"lq": 4096, "lk": 4096, "hq": 1, "hkv": 1}
        path = _path(backend, shape=long, is_causal=True, window=(256, 0))
        if _fused(backend):
            assert path == Native(tiles=policy.NATIVE_TILE)
        # packed documents too, where their ids are read on the host without a sync
        ids = backend.asarray(np.repeat(np.arange(4), 1024))
        path = _path(backend, shape=long, is_causal=True, q_segment_ids=ids)
        if _fused(backend) and reads_host_values(ids):
            assert path == Native(tiles=policy.NATIVE_TILE)
        # causal alone skips under half the pairs: the fused causal kernel stays
        assert (_path(backend, shape=long, is_causal=True) == Native()) == _fused(backend)

    def test_skipped_fraction(self, backend):
        def frac(lq, **kw):
            q = backend.asarray(np.zeros((1, 1, lq, 4)))
            return policy.skipped_fraction(prepare(q, q, q, **kw), 128, 256)

        assert frac(4096, is_causal=True, window=(256, 0)) == 1 - 62 / 512
        assert frac(1024, is_causal=True) == 0.375
        assert frac(1024) == 0.0
        # a band aligned by lengths decides nothing (rule 0 cuts what lengths hide)
        assert frac(1024, is_causal=True, kv_lengths=backend.asarray(np.array([9]))) == 0.0

    def test_portable_never_routes(self, backend):
        assert _path(backend, implementation="portable") == _portable(backend)

    def test_dense_forces_the_one_block_path(self, backend):
        dense = _dask(inner=None) if backend.family == "dask" else _portable(backend)  # per pair
        assert _path(backend, block_size="dense") == dense
        assert _path(backend, block_size="dense", is_causal=True) == dense
        with pytest.raises(ValueError, match="implementation='native'"):
            _path(backend, block_size="dense", implementation="native")

    def test_an_explicit_block_size_is_the_tiled_path(self, backend):
        def tiled(tiles):  # Dask: those tiles inside each chunk pair; JAX: a traced loop
            if backend.family == "dask":
                return _dask(inner=tiles)
            return Tiled(*tiles)  # JAX: unrolled below LOOP_MIN_SCORE_BYTES

        assert _path(backend, block_size=4) == tiled((4, 4))
        assert _path(backend, block_size=(2, 3)) == tiled((2, 3))
        assert _path(backend, block_size=4, implementation="portable") == tiled((4, 4))

    def test_numpy_tiles_are_buffered(self, backend):
        """NumPy, and Dask of NumPy chunks, run the tiled loop in reused buffers: no other."""
        _, (q, k, v) = _arrays(backend)
        path = choose_path(prepare(q, k, v), 4, None)
        tiled = path.inner if isinstance(path, DaskGrid) else path
        assert (tiled.walk == "buffered") == (backend.family in ("numpy", "dask"))

    def test_the_backward_follows_the_library(self, backend):
        """The recomputing backward of torch and JAX, with a score_mod too."""
        _, (q, k, v) = _arrays(backend)
        path = choose_path(prepare(q, k, v), 4, None)
        tiled = path.inner if isinstance(path, DaskGrid) else path
        family = {"torch": "torch", "jax": "jax"}.get(backend.family)
        assert tiled.backward == family
        modded = choose_path(prepare(q, k, v, score_mod=lambda s, b, h, i, j: s), 4, None)
        modded = modded.inner if isinstance(modded, DaskGrid) else modded
        assert modded.backward == family

    def test_the_python_walk_takes_exp2_where_the_library_row_says(self, backend):
        """torch's Python walk computes exp as exp2 (Library.exp2); no other walk does."""
        _, (q, k, v) = _arrays(backend)
        path = choose_path(prepare(q, k, v), 4, None)
        tiled = path.inner if isinstance(path, DaskGrid) else path
        assert tiled.exp2 == (backend.family == "torch")
        assert not tiled.exp2 or tiled.walk == "python"

    def test_no_query_or_no_key_is_empty(self, backend):
        assert _path(backend, shape={"lq": 0}) == Empty()
        assert _path(backend, shape={"lk": 0}, block_size=4) == Empty()


class TestAuto:
    def test_none_and_auto_are_the_same_choice(self, backend):
        for kw in ({}, {"is_causal": True}, {"softcap": 5.0}):
            assert _path(backend, block_size="auto", **kw) == _path(backend, **kw)

    def test_small_portable_calls_stay_dense(self, backend):
        assert _path(backend, softcap=5.0) == _portable(backend)

    def test_above_the_limit_tiles(self, backend, monkeypatch):
        _no_dense_limit(monkeypatch)
        data, (q, k, v) = _arrays(backend)
        mask_np = np.random.default_rng(1).random((9, 9)) < 0.7
        mask = backend.asarray(mask_np)
        path = _route(choose_path(prepare(q, k, v, mask=mask, softcap=5.0), None, None))
        if backend.family == "dask":  # chunk pairs of 5 x 5 scores, tiled inside
            assert path == _portable(backend)
        elif backend.family == "jax":
            assert path == Tiled(*default_tiles(_tiles("jax"), 9, 9))  # short: unrolled
        elif backend.family == "numpy":  # in reused buffers
            assert path == Tiled(*policy.buffered_tiles(9, 9))
        else:
            assert path == Tiled(*policy.EAGER_TILES)
        out = scaled_dot_product_attention(q, k, v, mask=mask, softcap=5.0)
        expected = reference_attention(*data, mask=mask_np, softcap=5.0)
        np.testing.assert_allclose(backend.to_numpy(out), expected, atol=1e-12, rtol=1e-10)

    def test_the_torch_limit_applies_to_torch_only(self, backend, monkeypatch):
        _no_dense_limit(monkeypatch, "torch")
        path = _path(backend, softcap=5.0)
        if backend.family == "torch":
            assert path == Tiled(*policy.EAGER_TILES)
        else:
            assert path == _portable(backend)

    def test_plain_auto_calls_still_take_the_fused_kernel(self, backend, monkeypatch):
        _no_dense_limit(monkeypatch)
        path = _path(backend, block_size="auto", is_causal=True)
        assert (path == Native()) == _fused(backend)


class TestTracedTiles:
    @pytest.mark.parametrize(
        ("length", "block"),
        [(9, 256), (2048, 256), (4096, 256), (8192, 512), (32768, 2048)],
    )
    def test_unrolled_at_least_the_minimum_block_and_at_most_the_maximum_count(
        self, length, block
    ):
        bq, bk = default_tiles(_tiles("jax"), length, length)
        assert bq == bk == block
        assert bq >= policy.TRACED_MIN_BLOCK
        assert -(-length // bq) <= policy.TRACED_MAX_BLOCKS

    @pytest.mark.parametrize(("length", "block"), [(9, 9), (2048, 512), (65536, 512)])
    def test_the_loop_tiles_clipped_to_the_lengths(self, length, block):
        bq, bk = default_tiles(_tiles("jax"), length, length, loop=True)
        assert bq == bk == block == min(length, policy.LOOP_TILES[0])
        windowed = default_tiles(_tiles("jax"), length, length, loop=True, windowed=True)
        assert windowed == (min(length, policy.LOOP_WINDOW_TILES[0]),) * 2

    @pytest.mark.backends("jax", reason="JAX: the traced loop's tiles")
    def test_a_windowed_long_call_loops_in_window_tiles(self, backend, monkeypatch):
        monkeypatch.setattr(policy, "LOOP_MIN_SCORE_BYTES", 0)
        _no_dense_limit(monkeypatch)
        _, (q, k, v) = _arrays(backend, lq=600, lk=600)
        for window, tiles in ((None, policy.LOOP_TILES), ((3, 0), policy.LOOP_WINDOW_TILES)):
            path = choose_path(prepare(q, k, v, window=window), "auto", "portable")
            assert _route(path) == Tiled(*tiles, walk="loop")

    def test_jax_runs_long_calls_as_a_loop(self, backend, monkeypatch):
        call = prepare(*_arrays(backend)[1])

        def loops(path):
            return getattr(path, "walk", None) == "loop"

        assert not loops(choose_path(call, 4, None))  # short: unrolled
        monkeypatch.setattr(policy, "LOOP_MIN_SCORE_BYTES", 0)
        assert loops(choose_path(call, 4, None)) == (backend.family == "jax")
        _no_dense_limit(monkeypatch)
        assert loops(choose_path(call, None, "portable")) == (backend.family == "jax")

    def test_eager_libraries_get_the_eager_tiles(self):
        assert default_tiles(_tiles("torch"), 32768, 32768) == policy.EAGER_TILES

    @pytest.mark.parametrize(
        ("lq", "lk", "tiles"),
        [
            (32768, 32768, (256, 256)),
            (100, 4096, (100, 655)),
            (1, 4096, (1, 4096)),
            (1, 3, (1, 3)),
        ],
    )
    def test_buffered_tiles_hold_a_block_of_scores(self, lq, lk, tiles):
        """Query tiles of 256 rows; key tiles widen while the query tile is shorter."""
        assert default_tiles(_tiles("numpy"), lq, lk) == tiles


class TestNative:
    def test_native_is_taken_or_refused_with_the_reason(self, backend):
        if backend.family in ("torch", "jax"):
            assert _path(backend, implementation="native") == Native()
            assert _path(backend, implementation="native", block_size="auto") == Native()
            with pytest.raises(ValueError, match=r"explicit block_size \(a portable path\)"):
                _path(backend, implementation="native", block_size=4)
            with pytest.raises(ValueError, match="cannot express softcap"):
                _path(backend, implementation="native", softcap=2.0)
        else:
            with pytest.raises(ValueError, match="no native attention kernel"):
                _path(backend, implementation="native")

    def test_native_takes_auto_block_size_above_the_limit(self, backend, monkeypatch):
        """block_size="auto" leaves the choice to the library: "native" must not refuse it."""
        _no_dense_limit(monkeypatch)
        data, args = _arrays(backend, dv=4)
        if backend.family not in ("torch", "jax"):
            with pytest.raises(ValueError, match="no native attention kernel"):
                scaled_dot_product_attention(
                    *args, is_causal=True, block_size="auto", implementation="native"
                )
            return
        out = scaled_dot_product_attention(
            *args, is_causal=True, block_size="auto", implementation="native"
        )
        expected = reference_attention(*data, is_causal=True)
        np.testing.assert_allclose(backend.to_numpy(out), expected, atol=2e-6, rtol=1e-6)


class TestBadChoices:
    @pytest.mark.parametrize(
        ("block_size", "error"),
        [
            (0, ValueError),
            (-1, ValueError),
            ((2, 0), ValueError),
            ("big", TypeError),
            (1.5, TypeError),
            (True, TypeError),
            ((1, 2, 3), TypeError),
        ],
    )
    def test_block_size(self, backend, block_size, error):
        with pytest.raises(
            error, match=r"`block_size` must be None, 'auto', 'dense', a positive integer"
        ):
            _path(backend, block_size=block_size)

    def test_implementation(self, backend):
        with pytest.raises(ValueError, match="`implementation` must be None, 'portable'"):
            _path(backend, implementation="fast")


@pytest.mark.backends("dask", reason="chunked Dask arrays")
class TestDaskChunkTiles:
    def test_the_tasks_follow_the_chunks_and_tile_inside_them(self, backend, monkeypatch):
        import dask.array as da

        rng = np.random.default_rng(0)
        data = [rng.standard_normal((1, 2, n, 4)) for n in (64, 96, 96)]
        q, k, v = (
            da.from_array(a, chunks=(1, 2, c, 4)) for a, c in zip(data, (16, 24, 24), strict=True)
        )
        call = prepare(q, k, v, is_causal=True)
        grid = ((16,) * 4, (24,) * 4)
        fan_in = policy.DASK_MERGE_FAN_IN, policy.DASK_TASK_SCORES
        assert _route(choose_path(call, None, None)) == DaskGrid(
            *grid, Tiled(*policy.buffered_tiles(16, 24)), *fan_in
        )
        monkeypatch.setattr(policy, "BUFFERED_TILE", 8)
        monkeypatch.setattr(policy, "BUFFERED_BLOCK_SCORES", 8 * 16)
        # the tasks keep the chunks; the tiles inside a NumPy chunk pair are buffered_tiles
        assert _route(choose_path(call, None, None)) == DaskGrid(*grid, Tiled(8, 16), *fan_in)
        assert _route(choose_path(call, "auto", None)) == DaskGrid(*grid, Tiled(8, 16), *fan_in)
        assert _route(choose_path(call, 4, None)) == DaskGrid(*grid, Tiled(4, 4), *fan_in)
        assert _route(choose_path(call, "dense", None)) == DaskGrid(*grid, Dense(), *fan_in)
        expected = reference_attention(*data, is_causal=True)
        for block_size in (None, "auto"):
            out = scaled_dot_product_attention(q, k, v, is_causal=True, block_size=block_size)
            np.testing.assert_allclose(out.compute(), expected, atol=1e-12, rtol=1e-10)


class TestThreads:
    def test_numpy_runs_large_tiled_calls_in_threads(self, backend):
        from portable_attn._lib._cpu import available_workers, can_limit_blas

        big = {"lq": 2048, "lk": 2048, "hq": 8, "hkv": 8, "d": 2, "dv": 2}
        path = _path(backend, shape=big, softcap=5.0)  # 128 MiB of float64 scores
        threads = backend.family == "numpy" and can_limit_blas() and available_workers() > 1
        assert getattr(path, "workers", 1) == (available_workers() if threads else 1)
        small = _path(backend, shape={**big, "hq": 1, "hkv": 1}, softcap=5.0)
        assert getattr(small, "workers", 1) == 1  # under THREADS_MIN_SCORE_BYTES (or dense)
