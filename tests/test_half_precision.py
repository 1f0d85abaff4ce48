"""Half precision (float16, bfloat16): accumulated in float32, without needless float32 copies.

The contract: a half-precision result is within :func:`half_precision_bound` of the
float64 oracle on the same (representable) inputs, on every route. Which route a call
takes is the router's (``Kernel.own_half``, ``Library.half_flash``): a native kernel
that accumulates in float32 itself receives Q, K, V in their own dtype where that was
measured faster, and the dense path of JAX takes FlashAttention's form.
"""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import half_precision_bound, qkv, randn, representable, set_rows
from portable_attn import scaled_dot_product_attention
from portable_attn._lib import _cache, _route
from portable_attn._lib._cpu import has_half_arithmetic
from portable_attn.testing import reference_attention

_KV_LENGTHS = np.array([48, 29])[:, None, None, None]
CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "padding": {"mask": np.arange(48)[None, None, None, :] < _KV_LENGTHS},
    "bias": {"bias": randn(4, 32, 48, seed=7)},
}


def _half_problem(backend, dtype, name, **shape):
    """Q, K, V (and the case's mask/bias) rounded to `dtype`, as NumPy and backend arrays."""
    q, k, v = qkv(lq=32, lk=48, dk=32, dv=32, **shape)
    host = {n: representable(backend, a, dtype) for n, a in zip("qkv", (q, k, v), strict=True)}
    kw = dict(CASES[name])
    args = dict(kw)
    if "bias" in kw:  # a bias in the inputs' dtype: the own-dtype route takes it
        kw["bias"] = representable(backend, kw["bias"], dtype)
        args["bias"] = backend.asarray(kw["bias"], dtype)
    if "mask" in kw:
        args["mask"] = backend.asarray(kw["mask"])
    arrays = [backend.asarray(host[n], dtype) for n in "qkv"]
    return host, kw, arrays, args


@pytest.mark.dtypes("float16", "bfloat16")
class TestDefaultRouteWithinBound:
    @pytest.mark.parametrize("name", list(CASES))
    @pytest.mark.parametrize("block_size", [None, "dense"])
    def test_error_against_float64(self, backend, dtype, name, block_size):
        host, kw, (q, k, v), args = _half_problem(backend, dtype, name)
        expected = reference_attention(host["q"], host["k"], host["v"], **kw)
        out = scaled_dot_product_attention(q, k, v, block_size=block_size, **args)
        assert out.dtype == backend.dtype(dtype)
        err = float(np.abs(backend.to_numpy(out) - expected).max())
        bound = half_precision_bound(backend, expected, dtype)
        assert err <= bound, (err, bound)

    @pytest.mark.parametrize("block_size", [None, "dense", 64])
    def test_as_close_as_rounding_the_exact_result(self, backend, dtype, block_size):
        # FlashAttention's form rounds P to the half dtype for P @ V. Undivided, every
        # row's largest weight is exactly 1 and stays exact; dividing first rounds it
        # too, which on JAX's dense path took the mean of these ratios well past 1.15
        # (the weights form of history/half-jax-23f1316.json).
        ratios = []
        for seed in range(6):
            q, k, v = (randn(1, 4, 256, 64, seed=10 * seed + i) for i in range(3))
            host = [representable(backend, a, dtype) for a in (q, k, v)]
            expected = reference_attention(*host)
            arrays = (backend.asarray(a, dtype) for a in host)
            out = scaled_dot_product_attention(*arrays, block_size=block_size)
            rounded = backend.to_numpy(backend.asarray(expected.astype(np.float32), dtype))
            once = float(np.abs(rounded - expected).max())
            ratios.append(float(np.abs(backend.to_numpy(out) - expected).max()) / once)
        assert np.mean(ratios) <= 1.15, ratios

    def test_float16_logits_beyond_float16_range_on_every_route(self, backend, dtype):
        # |q.k| = 64 * 40 * 40 = 102400 > float16 max: the products are summed in float32
        q = np.full((1, 2, 64), 40.0)
        k = np.stack([np.full(64, 40.0), np.full(64, -40.0)])[None]
        v = np.array([[[1.0], [2.0]]])
        for block_size in (None, "dense"):
            qb, kb, vb = (backend.asarray(a, dtype) for a in (q, k, v))
            out = scaled_dot_product_attention(qb, kb, vb, scale=1.0, block_size=block_size)
            np.testing.assert_allclose(backend.to_numpy(out), [[[1.0], [1.0]]])


@pytest.mark.backends("torch")
@pytest.mark.dtypes("float16", "bfloat16")
class TestTorchKernelDtype:
    """What SDPA is given: the input dtype where it accumulates in float32 and is faster."""

    @staticmethod
    def _record(monkeypatch):
        import torch.nn.functional as F

        seen = []
        original = F.scaled_dot_product_attention

        def recording(q, k, v, attn_mask=None, **kw):
            mask_dtype = None if attn_mask is None else attn_mask.dtype
            seen.append((q.dtype, k.dtype, v.dtype, mask_dtype))
            return original(q, k, v, attn_mask=attn_mask, **kw)

        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
        return seen

    @staticmethod
    def _expected(backend, dtype):
        # CPU float16: SDPA in float16 is slower than its float32 route (benchmarks/half.py)
        # unless the CPU has float16 arithmetic
        if dtype == "float16" and backend.device_name == "cpu" and not has_half_arithmetic(dtype):
            return backend.dtype("float32")
        return backend.dtype(dtype)

    @pytest.mark.parametrize("arithmetic", [True, False])
    def test_cpu_float16_route_follows_the_cpus_float16_arithmetic(
        self, backend, dtype, arithmetic, monkeypatch
    ):
        if backend.device_name != "cpu":
            pytest.skip("a CPU route")
        monkeypatch.setattr(_route, "has_half_arithmetic", lambda dtype: arithmetic)
        seen = self._record(monkeypatch)
        _, _, (q, k, v), args = _half_problem(backend, dtype, "causal")
        scaled_dot_product_attention(q, k, v, **args)
        keeps = dtype == "bfloat16" or arithmetic
        assert seen[0][0] == backend.dtype(dtype if keeps else "float32"), seen

    @pytest.mark.parametrize("name", list(CASES))
    def test_default_call_reaches_sdpa_in_its_dtype(self, backend, dtype, name, monkeypatch):
        seen = self._record(monkeypatch)
        _, _, (q, k, v), args = _half_problem(backend, dtype, name)
        out = scaled_dot_product_attention(q, k, v, **args)
        assert out.dtype == backend.dtype(dtype)
        assert len(seen) == 1, seen
        want = self._expected(backend, dtype)
        q_dt, k_dt, v_dt, mask_dt = seen[0]
        assert (q_dt, k_dt, v_dt) == (want, want, want), seen
        if name == "bias":
            assert mask_dt == want  # the bias is the float mask, in the kernel's dtype

    def test_float32_bias_keeps_the_float32_route(self, backend, dtype, monkeypatch):
        # SDPA would round a float32 bias to the inputs' dtype: the float32 route keeps it
        seen = self._record(monkeypatch)
        _, _, (q, k, v), _ = _half_problem(backend, dtype, "plain")
        bias = backend.asarray(randn(4, 32, 48, seed=7), "float32")
        scaled_dot_product_attention(q, k, v, bias=bias)
        assert seen[0][:3] == (backend.dtype("float32"),) * 3

    def test_inputs_unchanged(self, backend, dtype):
        _, _, (q, k, v), _ = _half_problem(backend, dtype, "causal")
        before = [x.clone() for x in (q, k, v)]
        scaled_dot_product_attention(q, k, v, is_causal=True)
        for x, y in zip((q, k, v), before, strict=True):
            assert x.dtype == y.dtype
            assert bool((x == y).all())


@pytest.mark.backends("jax")
@pytest.mark.dtypes("float16", "bfloat16")
class TestJaxForms:
    @pytest.fixture(autouse=True)
    def _traced_anew(self):
        """Eager calls run compiled programs: a program of an earlier test would not trace."""
        import jax

        jax.clear_caches()

    def test_native_kernel_gets_the_input_dtype(self, backend, dtype, monkeypatch):
        import jax

        seen = []
        original = jax.nn.dot_product_attention

        def recording(q, k, v, **kw):
            seen.append((q.dtype, k.dtype, v.dtype))
            return original(q, k, v, **kw)

        monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
        _, _, (q, k, v), _ = _half_problem(backend, dtype, "causal")
        scaled_dot_product_attention(q, k, v, is_causal=True, implementation="native")
        kept = dtype in _route.library(q).kernels[0].own_half  # CPU float16: upcast
        assert seen == [((backend.dtype(dtype) if kept else jax.numpy.float32),) * 3]

    def test_dense_path_takes_half_products(self, backend, dtype, monkeypatch):
        # FlashAttention's form: the matmuls see the half inputs, accumulate in float32
        import jax.numpy as jnp

        seen = []
        original = jnp.matmul

        def recording(a, b, **kw):
            seen.append((a.dtype, b.dtype, kw.get("preferred_element_type")))
            return original(a, b, **kw)

        monkeypatch.setattr(jnp, "matmul", recording)
        _, _, (q, k, v), _ = _half_problem(backend, dtype, "plain")
        # the form on every device (the table says where it is the default)
        set_rows(monkeypatch, "jax", half_flash=True)
        monkeypatch.setattr(_route, "has_half_arithmetic", lambda dtype: True)
        _cache.forget()
        scaled_dot_product_attention(q, k, v, block_size="dense")
        half, f32 = backend.dtype(dtype), jnp.float32
        assert seen == [(half, half, f32), (half, half, f32)], seen

    @pytest.mark.parametrize("arithmetic", [True, False])
    def test_cpu_dense_form_follows_the_cpus_half_arithmetic(
        self, backend, dtype, arithmetic, monkeypatch
    ):
        # FlashAttention's form on a CPU only with AMX: elsewhere float32 copies were faster
        if backend.device_name != "cpu":
            pytest.skip("a CPU route")
        from portable_attn._lib._call import prepare
        from portable_attn._lib._path import Dense

        monkeypatch.setattr(_route, "has_half_arithmetic", lambda dtype: arithmetic)
        _, _, (q, k, v), _ = _half_problem(backend, dtype, "plain")
        path = _route.route(prepare(q, k, v), None, None).path
        assert isinstance(path, Dense), path
        assert path.flash is arithmetic


@pytest.mark.autodiff
@pytest.mark.dtypes("float16", "bfloat16")
class TestGradients:
    @pytest.mark.parametrize("name", ["plain", "causal", "bias"])
    def test_gradients_match_float64(self, backend, xp, dtype, name):
        host, _, (q, k, v), args = _half_problem(backend, dtype, name)
        w = randn(2, 4, 32, 32, seed=11)
        bias = args.pop("bias", None)

        def loss_with(weights):
            def loss(q, k, v, *b):
                out = scaled_dot_product_attention(q, k, v, bias=b[0] if b else None, **args)
                return xp.sum(xp.astype(out, weights.dtype) * weights)

            return loss

        inputs = (q, k, v) + ((bias,) if bias is not None else ())
        grads = backend.grad(loss_with(backend.asarray(w, "float32")), *inputs)
        exact = [backend.asarray(host[n]) for n in "qkv"]
        if bias is not None:
            exact.append(backend.asarray(backend.to_numpy(bias).astype(np.float64)))
        expected = backend.grad(loss_with(backend.asarray(w)), *exact)
        for g, e in zip(grads, expected, strict=True):
            assert g.dtype == backend.dtype(dtype)
            e = backend.to_numpy(e)
            err = float(np.abs(backend.to_numpy(g) - e).max())
            # the backward rounds dO, dP and dS to `dtype` on the way, as the fused kernels
            # do: four times the forward's bound (measured up to 1.8x of one bound)
            bound = 4 * half_precision_bound(backend, e, dtype)
            assert err <= bound, (err, bound)


def test_half_arithmetic_is_read_from_the_cpu_flags(monkeypatch):
    from portable_attn._lib import _cpu

    sapphire = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16\n"
    ice_lake = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n"
    zen4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    granite = "processor\t: 0\nflags\t: amx_fp16\n\nprocessor\t: 1\nflags\t: avx2 amx_bf16\n"
    cases = {  # (float16, bfloat16)
        sapphire: (True, True),
        ice_lake: (False, False),
        zen4: (False, False),  # AVX512-BF16 alone: bfloat16 products no faster than float32
        "": (False, False),
        granite: (True, False),  # the first processor's flags alone
    }
    for text, has in cases.items():
        monkeypatch.setattr(_cpu, "cpuinfo", lambda t=text: _cpu.cpuinfo_fields(t))
        assert (_cpu.has_half_arithmetic("float16"), _cpu.has_half_arithmetic("bfloat16")) == has


@pytest.mark.backends("jax", reason="FlashAttention's form of the dense path: JAX's half matmul")
def test_flash_form_gradients_are_taken_in_float32(backend, monkeypatch):
    # jax's own bias-gradient test (q = k = v = x, cotangent x, bf16): JAX's rule for a half
    # matmul rounds the cotangents dP and dS to bf16; 0.257 off float64 in dbias, where the
    # float32 form is 0.031 off (as jax.nn)
    import jax
    import jax.numpy as jnp

    x = backend.asarray(randn(1, 4, 128, 64, seed=5), "bfloat16")  # (B, H, L, D)
    bias = backend.asarray(randn(1, 4, 128, 128, seed=6), "bfloat16")
    set_rows(monkeypatch, "jax", half_flash=True)
    monkeypatch.setattr(_route, "has_half_arithmetic", lambda dtype: True)

    def grads(x, bias):
        def attend(x, bias):
            return scaled_dot_product_attention(x, x, x, bias=bias, block_size="dense")

        _, vjp = jax.vjp(attend, x, bias)
        return vjp(x.astype(attend(x, bias).dtype))

    errors = {}
    for flash in (True, False):
        set_rows(monkeypatch, "jax", half_flash=flash)
        _cache.forget()
        got = jax.jit(lambda x, bias: grads(x, bias))(x, bias)  # traced anew: this form
        want = grads(x.astype(jnp.float64), bias.astype(jnp.float64))  # the fixture's x64
        errors[flash] = [
            float(jnp.max(jnp.abs(g.astype(jnp.float64) - w)))
            for g, w in zip(got, want, strict=True)
        ]
    for flash_error, float32_error in zip(errors[True], errors[False], strict=True):
        assert flash_error <= 1.5 * float32_error, errors
