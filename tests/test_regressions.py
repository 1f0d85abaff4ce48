"""Regressions from an adversarial review of the caches, fast lanes, block masks and the
traced loop (issue 36): one class per finding, named for the behaviour it pins.

Each failed before its fix; the cause is in the class docstring.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest

from _helpers import assert_close, qkv, randn
from portable_attn import (
    causal_mask,
    get_alibi_slopes,
    init_mha_params,
    kv_cache_init,
    scaled_dot_product_attention,
)
from portable_attn.block_mask import create_block_mask
from portable_attn.testing import reference_attention


def _oracle_mask(rule, lq, lk, batch=1, heads=1):
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    return np.broadcast_to(
        rule(b, h, np.arange(lq)[:, None], np.arange(lk)[None, :]), (batch, heads, lq, lk)
    )


@pytest.fixture
def loop_everywhere(monkeypatch):
    """JAX's traced loop for every tiled call, however short (as at L = 2048 and up)."""
    from portable_attn._lib import _cache, _route

    monkeypatch.setattr(_route, "LOOP_MIN_SCORE_BYTES", 0)
    _cache.forget()
    yield
    _cache.forget()


@pytest.mark.backends("jax", reason="the traced loop is JAX's")
class TestAMaskModBesideTheBandOnTheTracedLoop:
    """A ``mask_mod`` beside causal/window was dropped on the pairs the band shows in full.

    The loop marked a pair "full" from the band alone when the rule had no block
    states, and "full" dropped the mask. Now a pair is full only where every
    structured term, the ``mask_mod`` included, shows it all (``_lib/_blocks.py``).
    """

    def test_documents_inside_causal(self, backend, loop_everywhere):
        import jax

        n, doc = 96, 32
        q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=8, dv=8)
        args = [backend.asarray(a) for a in (q, k, v)]

        def docs(b, h, i, j):
            return i // doc == j // doc

        def call(q, k, v):
            return scaled_dot_product_attention(
                q, k, v, is_causal=True, mask_mod=docs, block_size=(16, 16)
            )

        expected = reference_attention(q, k, v, is_causal=True, mask=_oracle_mask(docs, n, n))
        assert_close(backend, call(*args), expected)
        assert_close(backend, jax.jit(call)(*args), expected)


@pytest.mark.backends("torch", reason="torch SDPA per query tile")
class TestANaNQueryOnThePerTileKernel:
    """A query's NaN reached the output as zeros: a tile's part of fewer than 16 keys.

    torch's CPU SDPA returns zeros for a NaN query row when it has fewer than 16 keys
    and no mask; ``NATIVE_MIN_KEYS`` guarded only whole calls. Now every kernel call
    over fewer keys than ``Native.min_keys`` gets a mask.
    """

    def test_the_nan_row_stays_nan(self, backend):
        n = 264  # segments split at 256: the second part has 8 keys
        q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=16, dv=16)
        q[0, :, 260] = np.nan
        ids = np.repeat([0, 1], [256, 8])[None]
        out = scaled_dot_product_attention(
            *(backend.asarray(a, "float32") for a in (q, k, v)),
            is_causal=True,
            q_segment_ids=backend.asarray(ids),
        )
        out = backend.to_numpy(out)
        assert np.isnan(out[0, :, 260]).all()
        assert np.isfinite(np.delete(out, 260, axis=2)).all()


class TestLengthsBeyondTheAxisAreRefused:
    """``kv_lengths`` past ``Lk`` changed a causal result by 3.9, silently.

    Lengths read on the host are checked: each in ``[0, L]`` of its axis.
    """

    @pytest.mark.kinds("numpy", "torch", reason="lengths read on the host")
    @pytest.mark.parametrize(
        ("name", "value"), [("kv_lengths", 8 + 64), ("q_lengths", 6), ("kv_lengths", -1)]
    )
    def test_a_length_past_its_axis_raises(self, backend, name, value):
        q, k, v = (backend.asarray(a) for a in qkv(lq=5, lk=8))
        with pytest.raises(ValueError, match=rf"`{name}` must hold valid prefix lengths"):
            scaled_dot_product_attention(
                q, k, v, is_causal=True, **{name: backend.asarray(np.array([3, value]))}
            )

    @pytest.mark.kinds("numpy", "torch", reason="lengths read on the host")
    def test_the_full_length_is_valid(self, backend):
        q, k, v = qkv(lq=5, lk=8)
        kw = {"kv_lengths": np.array([8, 0]), "q_lengths": np.array([5, 0])}
        out = scaled_dot_product_attention(
            *(backend.asarray(a) for a in (q, k, v)),
            is_causal=True,
            **{n: backend.asarray(x) for n, x in kw.items()},
        )
        assert_close(backend, out, reference_attention(q, k, v, is_causal=True, **kw))


_OWN_MODULES = {
    "numpy": "numpy",
    "torch": "torch",
    "jax": "jax.numpy",
    "array_api_strict": "array_api_strict",
    "dask": "dask.array",
    "cupy": "cupy",
}


class TestXpTakesTheLibrarysOwnModule:
    """``create_block_mask(..., xp=torch)`` failed ("module 'torch' has no attribute 'astype'").

    Every function that takes ``xp=`` now takes the library's own module and its
    compat namespace alike, and anything else is a TypeError naming ``xp``.
    """

    @pytest.mark.main_kinds
    def test_every_xp_function_takes_the_module(self, backend):
        module = importlib.import_module(_OWN_MODULES[backend.family])
        for xp in (module, backend.xp):
            bm = create_block_mask(
                lambda b, h, i, j: i >= j, None, None, 8, 8, block_size=4, xp=xp
            )
            assert bm.visible_fraction() == 0.75
            mask = causal_mask(4, 6, xp=xp)
            assert tuple(mask.shape) == (4, 6)
            assert tuple(get_alibi_slopes(4, xp=xp).shape) == (4,)
            cache = kv_cache_init(batch_shape=(1,), num_kv_heads=2, capacity=4, head_dim=3, xp=xp)
            assert tuple(cache.keys.shape) == (1, 2, 4, 3)
            params = init_mha_params(8, 2, xp=xp, seed=0)
            assert params

    @pytest.mark.parametrize("bad", ["torch", 3, object()], ids=["str", "int", "object"])
    def test_anything_else_is_a_type_error_naming_xp(self, bad):
        with pytest.raises(TypeError, match="`xp` must be an array namespace"):
            causal_mask(4, 6, xp=bad)
        with pytest.raises(TypeError, match="`xp` must be an array namespace"):
            create_block_mask(lambda b, h, i, j: i >= j, None, None, 8, 8, xp=bad)


@pytest.mark.backends("jax", reason="jax_enable_x64")
class TestFloat64SinksUnderJitWithX64:
    """Closed-over float64 sinks raised ``TracerBoolConversionError`` under ``jax.jit``.

    The range check of a wider sink dtype ran ``bool()`` on a traced array: operations
    on a closed-over array trace under ``jit``. It now reads the sinks on the host.
    """

    def test_jit_with_x64(self, backend):
        import jax
        import jax.numpy as jnp

        was = jax.config.read("jax_enable_x64")  # jax.enable_x64() is newer than 0.4.34
        jax.config.update("jax_enable_x64", True)
        try:
            sinks = jnp.asarray(np.array([0.5, -1.0, 0.0, 2.0]))
            assert sinks.dtype == jnp.float64
            q, k, v = (jnp.asarray(a, jnp.float32) for a in qkv())
            out = jax.jit(lambda q, k, v: scaled_dot_product_attention(q, k, v, sinks=sinks))(
                q, k, v
            )
        finally:
            jax.config.update("jax_enable_x64", was)
        expected = reference_attention(*qkv(), sinks=np.array([0.5, -1.0, 0.0, 2.0]))
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6)


@pytest.mark.backends("torch", reason="torch's tracers")
class TestHostReadsUnderTorchTracers:
    """Host reads of lengths were fixed into graphs by ``make_fx`` and ``export``.

    Rule 0 cut the keys at the largest host-read ``kv_lengths``: a traced graph kept
    the cut of the tracing call. Every torch tracer now counts as one (``_compat``):
    no value is read while it records. ``torch.jit.trace`` (sizes as tensors) could
    never trace the library: it is refused by name, not as a Dask array.
    """

    @staticmethod
    def _traced(tracer, fn, args):
        import torch
        from torch.fx.experimental.proxy_tensor import make_fx

        if tracer == "make_fx":
            return make_fx(fn)(*args)

        class Module(torch.nn.Module):
            def forward(self, *args):
                return fn(*args)

        return torch.export.export(Module(), args, strict=False).module()

    def test_jit_trace_is_refused_clearly(self, backend):
        """Its shapes are tensors: refused with the tracers to use (a Dask error before)."""
        import torch

        q, k, v = (backend.asarray(a, "float32") for a in qkv(lq=4, lk=24))
        with pytest.raises(TypeError, match=r"torch\.jit\.trace records shapes as tensors"):
            torch.jit.trace(
                lambda q, k, v: scaled_dot_product_attention(q, k, v), (q, k, v), check_trace=False
            )

    @pytest.mark.parametrize("tracer", ["make_fx", "export"])
    def test_a_traced_graph_follows_the_lengths_it_is_given(self, backend, tracer):
        import torch

        if backend.device_name != "cpu":
            pytest.skip("host reads are a CPU matter")
        q, k, v = (torch.as_tensor(a, dtype=torch.float32) for a in qkv(lq=4, lk=24))

        def fn(q, k, v, lengths):
            return scaled_dot_product_attention(q, k, v, is_causal=True, kv_lengths=lengths)

        graph = self._traced(tracer, fn, (q, k, v, torch.tensor([12, 7])))  # cut at 12?
        lengths = torch.tensor([24, 20])
        expected = reference_attention(
            *(x.double().numpy() for x in (q, k, v)), is_causal=True, kv_lengths=lengths.numpy()
        )
        np.testing.assert_allclose(graph(q, k, v, lengths).numpy(), expected, atol=2e-6)


@pytest.mark.backends("torch", reason="torch.compile")
class TestCompiledPlainCalls:
    """``torch.compile(dynamic=True)`` of a plain call crashed in the direct lane's bookkeeping.

    The cache ran inside the trace (a dataclass ``__eq__`` over a symbolic float). It
    now stays out of ``torch.compile``: a compiled graph has no Python to save.
    """

    @pytest.mark.parametrize("dynamic", [True, False])
    def test_compiled_twice_with_two_lengths(self, backend, dynamic):
        import torch

        f = torch.compile(scaled_dot_product_attention, dynamic=dynamic)
        for n in (32, 48):
            q, k, v = qkv(lq=n, lk=n)
            out = f(*(backend.asarray(a, "float32") for a in (q, k, v)), is_causal=True)
            assert_close(
                backend,
                out,
                reference_attention(q, k, v, is_causal=True),
                dtype="float32",
                atol=2e-6,
                rtol=1e-5,
            )


@pytest.mark.backends("torch", reason="torch.compile's inductor")
class TestCompiledDocumentMasks:
    """Under ``torch.compile`` a document ``mask_mod`` gave errors of 2.4 (or NaN) at L > 256.

    Inductor (torch 2.13, CPU) miscompiles a floor division of positions built in the
    graph: the per-tile route evaluated the rule there. Under ``torch.compile`` the
    rule is evaluated by an opaque operation (``_paths/_opaque.py``) with eager values.
    """

    @pytest.mark.parametrize(("n", "doc"), [(640, 300), (300, 64)])
    def test_matches_the_oracle(self, backend, n, doc):
        import torch

        if backend.device_name != "cpu":
            pytest.skip("the CPU inductor's bug")
        q, k, v = qkv(batch=(1,), hq=2, hkv=2, lq=n, lk=n, dk=16, dv=16)

        def docs(b, h, i, j):
            return (i // doc == j // doc) & (i >= j)

        f = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, mask_mod=docs))
        out = f(*(backend.asarray(a, "float32") for a in (q, k, v)))
        expected = reference_attention(q, k, v, mask=_oracle_mask(docs, n, n))
        assert_close(backend, out, expected, dtype="float32", atol=2e-6, rtol=1e-5)


class TestVmapOverAPerExampleMaskMod:
    """``vmap`` with a ``mask_mod`` closing over per-example data crashed.

    The states of a ``mask_mod`` were built on the host because the batch index was
    concrete, though the rule's values (the vmapped ids) are not. Now what the rule
    returns decides: values that cannot be read build no host states.
    """

    @pytest.mark.backends("torch", reason="torch.func.vmap")
    def test_torch_func_vmap(self, backend):
        import torch

        n = 300
        qs = torch.as_tensor(randn(3, 2, n, 8, seed=1), dtype=torch.float32)
        docs = torch.as_tensor(np.stack([np.arange(n) // d for d in (50, 100, 300)]))

        def one(q, d):
            return scaled_dot_product_attention(q, q, q, mask_mod=lambda b, h, i, j: d[i] == d[j])

        out = torch.func.vmap(one)(qs, docs).numpy()
        for e in range(3):
            d = docs[e].numpy()
            mask = d[:, None] == d[None, :]
            q = qs[e].double().numpy()
            expected = reference_attention(q, q, q, mask=mask)
            np.testing.assert_allclose(out[e], expected, rtol=1e-5, atol=1e-5)

    @pytest.mark.backends("jax", reason="jax.vmap")
    def test_jax_vmap_with_an_int_block_size(self, backend):
        import jax
        import jax.numpy as jnp

        n = 40
        qs = jnp.asarray(randn(3, 2, n, 8, seed=1))
        docs = jnp.asarray(np.stack([np.arange(n) // d for d in (5, 10, 40)]))

        def one(q, d):
            return scaled_dot_product_attention(
                q, q, q, block_size=16, mask_mod=lambda b, h, i, j: d[i] == d[j]
            )

        out = np.asarray(jax.vmap(one)(qs, docs))
        for e in range(3):
            d = np.asarray(docs[e])
            q = np.asarray(qs[e])
            expected = reference_attention(q, q, q, mask=d[:, None] == d[None, :])
            np.testing.assert_allclose(out[e], expected, atol=1e-12)


@pytest.mark.backends("torch", reason="torch.func")
class TestABlockMaskFirstUsedUnderATransform:
    """A torch ``BlockMask`` used first inside ``torch.func.grad`` crashed.

    Reading its states was allowed: the states are plain tensors, and an active
    transform around them was not seen. Every active ``torch.func`` transform now
    counts as a tracer.
    """

    def test_grad(self, backend):
        import torch

        n = 24
        bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, block_size=8, xp=torch)
        q = torch.as_tensor(randn(1, 2, n, 8, seed=3))
        g = torch.func.grad(lambda q: scaled_dot_product_attention(q, q, q, block_mask=bm).sum())(
            q
        )
        want = torch.func.grad(
            lambda q: scaled_dot_product_attention(q, q, q, is_causal=True).sum()
        )(q)
        np.testing.assert_allclose(g.numpy(), want.numpy(), atol=1e-12)


@pytest.mark.backends("jax", reason="JAX pytrees")
class TestPytreesMadeBeforeImportingJax:
    """A ``BlockMask`` or ``KVCache`` made before ``import jax`` was no pytree.

    Registration ran when an instance was made with JAX imported. The classes are now
    registered the moment JAX is imported (``_compat.register_pytree``).
    """

    def test_in_a_fresh_process(self, backend):
        script = """
import numpy as np
from portable_attn import kv_cache_init, scaled_dot_product_attention
from portable_attn.block_mask import create_block_mask
bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 8, 8, block_size=4)
cache = kv_cache_init(batch_shape=(1,), num_kv_heads=1, capacity=8, head_dim=4)
import jax, jax.numpy as jnp
q = jnp.ones((1, 1, 8, 4))
out = jax.jit(lambda q, bm: scaled_dot_product_attention(q, q, q, block_mask=bm))(q, bm)
assert out.shape == (1, 1, 8, 4)
assert len(jax.tree_util.tree_leaves(cache)) == 3
print("ok")
"""
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=False
        )
        assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.backends("jax", reason="the traced loop is JAX's")
class TestTheTracedLoopHidesItsOwnPadding:
    """With traced ``kv_lengths`` past ``Lk`` the loop attended to the keys padding its blocks.

    It hid its padding with a key length only when no ``kv_lengths`` was given. Its
    padded keys are now hidden by the mask whatever the lengths say.
    """

    def test_equals_the_dense_path(self, backend, loop_everywhere):
        import jax

        q, k, v = qkv(lq=13, lk=19)
        args = [backend.asarray(a) for a in (q, k, v)]

        def call(lengths, block_size):
            return scaled_dot_product_attention(
                *args, is_causal=True, kv_lengths=lengths, block_size=block_size
            )

        lengths = backend.asarray(np.array([19 + 5, 11]))  # traced: not checked
        loop = jax.jit(lambda n: call(n, (4, 5)))(lengths)
        dense = jax.jit(lambda n: call(n, "dense"))(lengths)
        assert_close(backend, loop, dense, rtol=1e-12, atol=1e-13)


class TestEmptyBatches:
    """B = 0 crashed: a ``mask_mod`` reading the batch index (``ZeroDivisionError``), and
    NumPy with an int ``block_size`` (``AttributeError``). A call with no sequence is now
    an empty call: zeros of its shape, nothing computed."""

    @pytest.mark.parametrize(
        "kw",
        [
            {"mask_mod": lambda b, h, i, j: (b + i) >= j},
            {"block_size": 4},
            {"block_size": 4, "is_causal": True},
            {},
        ],
        ids=["mask_mod", "block_size", "causal", "plain"],
    )
    def test_zero_sequences(self, backend, kw):
        q, k, v = (backend.asarray(a) for a in qkv(batch=(0,), lq=5, lk=7))
        out = scaled_dot_product_attention(q, k, v, **kw)
        assert tuple(out.shape) == (0, 4, 5, 6)


class TestKeysPastTheLengthsHoldingNaN:
    """Keys past a sequence's length holding NaN made its rows NaN on some paths.

    A key hidden by the lengths has weight 0, and ``0 · NaN`` is NaN in ``P @ V``. Keys
    and values past the lengths are now zeroed where a block holds some
    (``_scores.without_hidden_keys``), on every path, forward and backward.
    """

    @pytest.mark.parametrize("block_size", [None, "dense", 3], ids=["default", "dense", "tiled"])
    def test_results_and_gradients_finite(self, backend, block_size):
        q, k, v = qkv(lq=5, lk=24, dk=16, dv=16)
        lengths = np.array([20, 9])
        k_nan, v_nan = k.copy(), v.copy()
        for b, n in enumerate(lengths):
            k_nan[b, :, n:] = np.nan
            v_nan[b, :, n:] = np.inf
        args = [backend.asarray(a) for a in (q, k_nan, v_nan)]
        kw = {"is_causal": True, "kv_lengths": backend.asarray(lengths), "block_size": block_size}
        out = scaled_dot_product_attention(*args, **kw)
        expected = reference_attention(q, k, v, is_causal=True, kv_lengths=lengths)
        assert_close(
            backend, out, expected, rtol=1e-9, atol=1e-10 if backend.family != "torch" else 1e-6
        )
        if backend.has_autodiff:
            xp = backend.xp
            grads = backend.grad(
                lambda q, k, v: xp.sum(scaled_dot_product_attention(q, k, v, **kw)), *args
            )
            assert all(np.isfinite(backend.to_numpy(g)[:, :, :5]).all() for g in grads[:1])
            for b, n in enumerate(lengths):  # finite, and zero, for the hidden keys
                for g in grads[1:]:
                    part = backend.to_numpy(g)[b, :, n:]
                    assert np.all(part == 0), part


@pytest.mark.backends("torch", reason="torch.autocast")
class TestTheLseUnderAutocast:
    """Under ``torch.autocast(bfloat16)`` the returned lse was bfloat16, not the compute dtype."""

    def test_float32_lse(self, backend):
        import torch

        if backend.device_name != "cpu":
            pytest.skip("CPU autocast")
        q, k, v = (backend.asarray(a, "float32") for a in qkv())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, lse = scaled_dot_product_attention(q, k, v, return_lse=True)
        assert lse.dtype == torch.float32
        assert out.dtype == torch.float32


class TestBlockMaskAxesThatDiffer:
    """``create_block_mask(batch=None)`` with a rule of the batch index skipped wrongly.

    Its states were built for index 0 alone. The first block is now checked for
    indices 0 and 1 of each axis given as None.
    """

    @pytest.mark.parametrize("axis", ["batch", "heads"])
    def test_a_rule_that_differs_there_raises(self, axis):
        if axis == "batch":
            rule = lambda b, h, i, j: (i + b) >= j  # noqa: E731
        else:
            rule = lambda b, h, i, j: (i + h) >= j  # noqa: E731
        with pytest.raises(ValueError, match=f"`{axis}` is None"):
            create_block_mask(rule, None, None, 8, 8, block_size=4)
        kw = {"batch": 2, "heads": None} if axis == "batch" else {"batch": None, "heads": 2}
        create_block_mask(rule, kw["batch"], kw["heads"], 8, 8, block_size=4)  # said: fine
