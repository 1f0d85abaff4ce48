"""The router's rows per (library, device kind), decided as data on any machine.

A GPU row given to the router (``route(..., row=...)``) routes a call of CPU arrays as
it would route the same call on that device: the decision is the table's, not the
device's. Where a GPU kernel also runs on a CPU (torch's flex_attention forward, uncompiled),
the route runs and is checked against the oracle; the suite's ``flex`` route
(``tests/_helpers.py``) runs every feature test through it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _helpers import FLEX_ON_CPU, set_rows
from portable_attn import scaled_dot_product_attention
from portable_attn._lib import _route
from portable_attn._lib._call import prepare
from portable_attn._lib._path import Dense, Native, Tiled
from portable_attn._paths import run
from portable_attn.block_mask import chunked_mask_mod
from portable_attn.testing import reference_attention

TORCH_CUDA = _route.LIBRARIES[("torch", "cuda")]
JAX_GPU = _route.LIBRARIES[("jax", "gpu")]
CUPY = _route.LIBRARIES[("cupy", "cuda")]


def _qkv(backend, dtype="float32", *, lq=256, lk=256, d=64, dv=None, h=2):
    rng = np.random.default_rng(0)
    shapes = ((1, h, lq, d), (1, h, lk, d), (1, h, lk, dv or d))
    return [backend.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _path(row, arrays, *, return_lse=False, implementation=None, **kw):
    call = prepare(*arrays, **kw)
    if return_lse == "max":
        call, return_lse = call.with_row_max(), True
    return _route.route(call, None, implementation, return_lse=return_lse, row=row).path


def _rel(scores, b, h, q_idx, kv_idx):
    return scores + 0.01 * (q_idx - kv_idx)


@pytest.mark.backends("torch", reason="the torch rows")
class TestTorchCuda:
    """SDPA where it expresses the call; flex for what it does not; the portable path last."""

    def test_sdpa_takes_what_it_expresses_in_half_precision_as_it_is(self, backend):
        path = _path(TORCH_CUDA, _qkv(backend, "float16"), is_causal=True)
        assert path == Native("sdpa", upcast=False)

    @pytest.mark.parametrize(
        ("kw", "stats"),
        [
            ({"score_mod": _rel}, False),
            ({"mask_mod": lambda b, h, q, k: q >= k}, False),
            ({"softcap": 30.0}, False),
            ({"sinks": "sinks"}, False),
            ({"alibi_slopes": "slopes"}, False),
            ({}, True),
            ({}, "max"),
            ({"is_causal": True, "window": (32, 0)}, False),  # SDPA leaves it: tiles win
        ],
        ids=["score_mod", "mask_mod", "softcap", "sinks", "alibi", "lse", "max_logit", "window"],
    )
    def test_flex_takes_what_sdpa_cannot_express(self, backend, kw, stats):
        given = {"sinks": backend.asarray(np.zeros(2)), "slopes": backend.asarray(np.ones(2))}
        kw = {n: given.get(a, a) if isinstance(a, str) else a for n, a in kw.items()}
        arrays = _qkv(backend, "bfloat16", lq=2048, lk=2048)
        path = _path(TORCH_CUDA, arrays, return_lse=stats, **kw)
        assert isinstance(path, Native), path
        assert path.kernel == "flex"
        assert path.compiled
        assert not path.upcast
        user = "score_mod" in kw or "mask_mod" in kw
        assert (path.fallback is not None) == user  # the portable route, if flex cannot trace

    @pytest.mark.parametrize(
        ("dtype", "shape", "kw"),
        [
            ("float64", {}, {"softcap": 30.0}),  # a dtype flex does not take here
            ("float32", {"dv": 32}, {"softcap": 30.0}),  # Dv != Dk
            ("float32", {"d": 48}, {"softcap": 30.0}),  # not a power of two
            ("float32", {}, {"dropout_p": 0.5, "dropout_mask": "keep"}),  # no kernel drops
        ],
        ids=["float64", "Dv!=Dk", "head dim 48", "dropout"],
    )
    def test_what_no_kernel_takes_runs_the_portable_path_sized_for_a_gpu(
        self, backend, dtype, shape, kw
    ):
        arrays = _qkv(backend, dtype, lq=8192, lk=8192, **shape)
        if "dropout_mask" in kw:
            kw["dropout_mask"] = backend.asarray(np.ones((8192, 8192), bool))
        path = _path(TORCH_CUDA, arrays, **kw)
        # 2 x 8192^2 scores fit the GPU's dense limit; the CPU row tiles them
        assert isinstance(path, Dense), path
        assert isinstance(_path(_route.LIBRARIES[("torch", "cpu")], arrays, **kw), Tiled)

    def test_long_portable_calls_take_the_gpu_tiles(self, backend):
        arrays = _qkv(backend, "float64", lq=32768, lk=32768, h=8, d=16)
        path = _path(TORCH_CUDA, arrays, softcap=30.0)
        assert isinstance(path, Tiled)
        assert (path.block_q, path.block_k) == _route.GPU_TILES

    def test_implementation_native_names_each_kernels_reason(self, backend):
        arrays = _qkv(backend, "float64")
        with pytest.raises(ValueError, match=r"sdpa: .*softcap.*; flex: .*takes"):
            _path(TORCH_CUDA, arrays, softcap=30.0, implementation="native")


@pytest.mark.backends("jax", reason="the JAX rows")
class TestJaxGpu:
    """cuDNN by default where it takes the call; the portable path sized for a GPU else."""

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_cudnn_takes_half_precision_by_default(self, backend, dtype):
        path = _path(JAX_GPU, _qkv(backend, dtype), is_causal=True)
        assert path == Native("jax_nn", upcast=False, implementation="cudnn")

    @pytest.mark.parametrize(
        ("dtype", "shape", "kw"),
        [
            ("float32", {}, {}),
            ("bfloat16", {"d": 256}, {}),
            ("bfloat16", {"d": 12}, {}),
            ("bfloat16", {"dv": 32}, {}),
            ("bfloat16", {}, {"softcap": 30.0}),
        ],
        ids=["float32", "head dim 256", "head dim 12", "Dv!=Dk", "softcap"],
    )
    def test_what_cudnn_does_not_take_is_portable(self, backend, dtype, shape, kw):
        path = _path(JAX_GPU, _qkv(backend, dtype, **shape), **kw)
        assert not isinstance(path, Native), path

    def test_the_traced_loop_takes_the_gpu_tiles(self, backend):
        arrays = _qkv(backend, "float32", lq=32768, lk=32768, h=8, d=16)
        path = _path(JAX_GPU, arrays)
        assert isinstance(path, Tiled)
        assert path.walk == "loop"
        assert (path.block_q, path.block_k) == _route.GPU_LOOP_TILES

    def test_the_jax_cpu_row_takes_no_kernel_by_default(self, backend):
        path = _path(_route.LIBRARIES[("jax", "cpu")], _qkv(backend, "bfloat16"))
        assert not isinstance(path, Native)

    def test_cudnn_is_asked_for_by_name(self, backend, monkeypatch):
        """The route's kernel call names cuDNN (run here with XLA's, which a CPU has)."""
        import jax

        original, seen = jax.nn.dot_product_attention, []

        def recording(*args, implementation=None, **kw):
            seen.append(implementation)
            return original(*args, implementation=None, **kw)

        monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
        arrays = _qkv(backend, "bfloat16", lq=16, lk=16, d=8)
        call = prepare(*arrays, is_causal=True)
        route = _route.route(call, None, None, row=JAX_GPU)
        out, _ = run(call, route)
        assert seen == ["cudnn"]
        want = reference_attention(*(backend.to_numpy(a) for a in arrays), is_causal=True)
        np.testing.assert_allclose(backend.to_numpy(out).astype(np.float64), want, atol=0.05)


@pytest.mark.backends("numpy", reason="the CuPy row, routed for NumPy arrays")
def test_cupy_takes_the_gpu_dense_limit_and_tiles(backend):
    small = _path(CUPY, _qkv(backend, lq=4096, lk=4096))
    assert isinstance(small, Dense)  # 128 MiB of scores: dense on a GPU, tiled on a CPU
    big = _path(CUPY, _qkv(backend, lq=32768, lk=32768, h=8, d=16))
    assert isinstance(big, Tiled)
    assert (big.block_q, big.block_k) == _route.GPU_TILES


@pytest.mark.backends("torch", reason="torch's flex_attention")
def test_a_score_mod_flex_cannot_trace_takes_the_portable_route(backend, monkeypatch):
    """A ``score_mod`` written for the portable path's blocks (it reshapes its indices)
    fails under flex's ``vmap`` of scalar indices: the call runs its portable route."""
    import torch

    set_rows(monkeypatch, "torch", kernels=(FLEX_ON_CPU,))
    table = np.linspace(-1.0, 1.0, 64)

    def rel(xp, t):
        def mod(scores, b, h, q_idx, kv_idx):
            idx = q_idx - kv_idx + 32
            flat = xp.take(t, xp.reshape(idx, (-1,)), axis=0)
            return scores + xp.reshape(flat, idx.shape)

        return mod

    arrays = _qkv(backend, "float64", lq=24, lk=24, d=8)
    mod = rel(backend.xp, backend.asarray(table))
    call = prepare(*arrays, score_mod=mod, is_causal=True)
    with torch.no_grad():
        path = _route.route(call, None, None).path
        assert path.kernel == "flex"
        assert path.fallback is not None
        out = scaled_dot_product_attention(*arrays, score_mod=mod, is_causal=True)
    numpy_arrays = [backend.to_numpy(a) for a in arrays]
    want = reference_attention(*numpy_arrays, score_mod=rel(np, table), is_causal=True)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-10, atol=1e-12)


@pytest.mark.backends("torch", reason="torch's flex_attention")
def test_flex_under_torch_func_and_with_grad_goes_elsewhere(backend, monkeypatch):
    """A kernel without a backward (flex on a CPU) or outside torch.func is routed around."""
    import torch

    arrays = _qkv(backend, "float32", lq=32, lk=32, d=8)
    row = dataclasses.replace(TORCH_CUDA, kernels=(FLEX_ON_CPU,))
    assert _path(row, arrays, softcap=5.0).kernel == "flex"
    grad = [a.detach().requires_grad_(True) for a in arrays]
    assert not isinstance(_path(row, grad, softcap=5.0), Native)
    with torch.no_grad():  # a user function may capture a tensor that requires grad
        assert _path(row, arrays, score_mod=_rel).kernel == "flex"
    assert not isinstance(_path(row, arrays, score_mod=_rel), Native)

    def one(q):
        return _path(row, [q[None], *arrays[1:]], softcap=5.0)

    seen = []
    torch.func.vmap(lambda q: seen.append(one(q)) or q)(arrays[0])
    assert not isinstance(seen[0], Native)  # flex does not run under torch.func's vmap


@pytest.mark.backends("torch", reason="torch CUDA's sync debug mode")
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"is_causal": True},
        {"softcap": 30.0, "is_causal": True},
        {"score_mod": _rel},
        {"mask_mod": "rule"},  # a ready rule: its states by arithmetic, no host read
        {"sinks": "sinks", "return_lse": True},
        {"implementation": "portable", "block_size": 128, "is_causal": True},
        {"implementation": "portable", "is_causal": True},
    ],
    ids=["plain", "causal", "softcap", "score_mod", "mask_mod", "sinks", "tiled", "dense"],
)
def test_a_gpu_route_does_not_synchronise_with_the_host(backend, kw):
    """Every GPU route that reads no lengths runs without a host synchronisation."""
    import torch

    if backend.device_name == "cpu":
        pytest.skip("CUDA's sync debug mode (a GPU route)")
    given = {
        "rule": chunked_mask_mod(128),
        "sinks": backend.asarray(np.zeros(2), "float32"),
    }
    kw = {n: given.get(a, a) if isinstance(a, str) else a for n, a in kw.items()}
    arrays = _qkv(backend, "bfloat16", lq=512, lk=512)
    scaled_dot_product_attention(*arrays, **kw)  # compiles, builds what a call keeps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaled_dot_product_attention(*arrays, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.backends("torch", reason="the paged walk's chunks per row")
def test_the_paged_walk_takes_the_rows_chunks(backend, monkeypatch):
    """``Library.chunk_keys`` sets the paged walk's chunks; any chunk gives the same result."""
    from portable_attn import ragged_paged_attention
    from portable_attn._paths import _paged

    rng = np.random.default_rng(1)
    page, pages, hq, hkv, d = 4, 16, 4, 2, 8
    kp, vp = (backend.asarray(rng.standard_normal((pages, page, hkv, d))) for _ in range(2))
    table = backend.asarray(np.arange(pages).reshape(2, 8), "int32")
    lengths = backend.asarray(np.array([29, 17]), "int32")
    starts = backend.asarray(np.array([0, 3, 5]), "int32")
    q = backend.asarray(rng.standard_normal((5, hq, d)))
    seen = []
    original = _paged.PagedProblem

    def spy(**kw):
        seen.append(kw["keys_per_chunk"])
        return original(**kw)

    monkeypatch.setattr(_paged, "PagedProblem", spy)
    outs = []
    for keys in (_route.GPU_CHUNK_KEYS, page):
        set_rows(monkeypatch, "torch", chunk_keys=keys)
        outs.append(backend.to_numpy(ragged_paged_attention(q, kp, vp, table, lengths, starts)))
    assert seen == [_route.GPU_CHUNK_KEYS, page]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)


@pytest.mark.backends("torch", reason="torch's flex_attention, as a CPU runs it")
class TestFlexContract:
    """What the flex route must keep of the contract (found in review)."""

    @pytest.fixture(autouse=True)
    def _flex_row(self, monkeypatch):
        set_rows(monkeypatch, "torch", kernels=(FLEX_ON_CPU,))

    @pytest.mark.parametrize(
        ("shapes", "kw"),
        [
            (((2, 4, 8, 16), (1, 2, 8, 16)), {"softcap": 5.0}),
            (((2, 4, 8, 16), (2, 8, 16)), {"softcap": 5.0, "is_causal": True}),
            (((1, 4, 8, 16), (2, 2, 8, 16)), {"return_lse": True}),
        ],
        ids=["kv batch 1", "kv without heads", "q batch 1"],
    )
    def test_batch_axes_that_broadcast(self, backend, shapes, kw):
        """flex takes one batch size: broadcast batch axes are expanded for it."""
        import torch

        rng = np.random.default_rng(2)
        q, kv = (rng.standard_normal(s) for s in shapes)
        arrays = [backend.asarray(x) for x in (q, kv, kv * 0.5)]
        with torch.no_grad():
            path = _route.route(prepare(*arrays, softcap=kw.get("softcap")), None, None).path
            assert path.kernel == "flex"
            got = scaled_dot_product_attention(*arrays, **kw)
            want = scaled_dot_product_attention(*arrays, implementation="portable", **kw)
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)), strict=True):
            np.testing.assert_allclose(backend.to_numpy(g), backend.to_numpy(w), atol=1e-12)

    def test_a_sink_of_minus_inf_on_a_row_without_keys_is_zeros(self, backend):
        import torch

        arrays = _qkv(backend, "float64", lq=4, lk=6, d=8)
        kw = {
            "sinks": backend.asarray(np.array([-np.inf, 0.5])),
            "kv_lengths": backend.asarray(np.array([0])),
            "return_lse": True,
        }
        with torch.no_grad():
            out, lse = scaled_dot_product_attention(*arrays, **kw)
        assert np.array_equal(backend.to_numpy(out), np.zeros((1, 2, 4, 8)))
        assert np.array_equal(backend.to_numpy(lse)[0, 1], np.full(4, 0.5))
        assert np.all(backend.to_numpy(lse)[0, 0] == -np.inf)

    def test_a_rule_aligned_by_the_lengths_is_not_flexs(self, backend, monkeypatch):
        """Its per-sequence arrays are not flex's scalars: the call stays portable."""
        import torch

        import portable_attn._paths as paths

        calls = []
        original = paths.flex_attention
        monkeypatch.setattr(
            paths, "flex_attention", lambda *a, **k: calls.append(1) or original(*a, **k)
        )

        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((2, 2, n, 8)) for n in (24, 40, 40))
        arrays = [backend.asarray(x) for x in (q, k, v)]
        lengths = {
            "q_lengths": backend.asarray(np.array([24, 10])),
            "kv_lengths": backend.asarray(np.array([40, 30])),
        }
        rule = chunked_mask_mod(8)
        with torch.no_grad():
            out = scaled_dot_product_attention(*arrays, mask_mod=rule, **lengths)
        assert not calls  # lowered, the rule reads the lengths per sequence
        want = scaled_dot_product_attention(*arrays, mask_mod=rule, block_size=8, **lengths)
        np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(want), atol=1e-12)

    def test_segments_over_a_value_that_is_not_finite_take_the_portable_route(
        self, backend, monkeypatch
    ):
        """Another document's NaN never reaches a row, even where values are read on a GPU."""
        import torch

        from portable_attn._paths import _flex

        monkeypatch.setattr(_flex, "has_concrete_values", lambda x: True)
        seen = []
        original = _flex.values_finite
        monkeypatch.setattr(_flex, "values_finite", lambda c: seen.append(1) or original(c))
        q, k, v = (backend.to_numpy(a) for a in _qkv(backend, "float64", lq=16, lk=16, d=8))
        v[0, :, 12] = np.nan  # a key of the second document
        ids = backend.asarray((np.arange(16) >= 8).astype(np.int32)[None])
        arrays = [backend.asarray(x) for x in (q, k, v)]
        with torch.no_grad():
            out = scaled_dot_product_attention(
                *arrays, q_segment_ids=ids, kv_segment_ids=ids, softcap=30.0
            )
        got = backend.to_numpy(out)
        assert seen
        assert np.all(np.isfinite(got[0, :, :8]))  # the first document never sees it
        assert np.all(np.isnan(got[0, :, 8:]))


@pytest.mark.backends("torch", reason="a torch device kind with no row")
def test_a_device_kind_without_a_row_keeps_the_guards(backend):
    """torch's ``meta`` (as ``mps``, ``xpu``): the CPU row with nothing measured of its kernels."""
    import torch

    row = _route.library(torch.empty(1, device="meta"))
    (kernel,) = row.kernels
    assert kernel.name == "sdpa"
    assert kernel.zeroes_empty_rows is None  # the guard around rows without keys
    assert not kernel.own_half


@pytest.mark.backends("jax", reason="the JAX GPU row")
def test_jax_gpu_native_runs_xla_where_cudnn_does_not_take_the_call(backend):
    arrays = _qkv(backend, "float32")
    path = _path(JAX_GPU, arrays, implementation="native")
    assert path == Native("jax_nn", upcast=True, implementation=None)
    learned = _qkv(backend, "bfloat16")
    scale = backend.asarray(np.float32(0.125))
    assert not isinstance(_path(JAX_GPU, learned, scale=scale), Native)  # cuDNN: no float32
    odd = _qkv(backend, "bfloat16", lq=255, lk=255)
    assert not isinstance(_path(JAX_GPU, odd, is_causal=True), Native)  # even lengths
