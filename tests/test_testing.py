"""The public check tools, :mod:`portable_attn.testing`: the table, the oracle, `assert_close`."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from _helpers import randn
from portable_attn import scaled_dot_product_attention, testing
from portable_attn.testing import assert_close


def test_importing_it_imports_no_optional_library():
    code = (
        "import sys, portable_attn.testing as t; "
        "print(sorted({'torch', 'jax', 'cupy', 'dask', 'array_api_strict'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_is_documented():
    for name in testing.__all__:
        obj = getattr(testing, name)
        if callable(obj):
            assert obj.__doc__, name


class TestTable:
    def test_every_kind_has_one_family(self):
        assert len(set(testing.ALL_KINDS)) == len(testing.ALL_KINDS)
        for kind in testing.ALL_KINDS:
            assert kind in testing.FAMILIES[testing.family_of(kind)]
        assert set(testing.GPU_KINDS) <= set(testing.ALL_KINDS)
        assert set(testing.TEST_ONLY_KINDS) <= set(testing.ALL_KINDS)

    def test_unknown_names_are_value_errors(self):
        with pytest.raises(ValueError, match=r"unknown backend kind 'mxnet'"):
            testing.family_of("mxnet")
        with pytest.raises(ValueError, match=r"unknown dtype 'float8'"):
            testing.kind_supports("numpy", "float8")

    def test_a_backend_says_what_the_table_says(self, backend):
        assert backend.has_autodiff == testing.has_autodiff(backend.kind)
        for dtype in testing.DTYPES:
            assert backend.supports(dtype) == testing.kind_supports(backend.kind, dtype)
        x = backend.asarray(randn(2, 3))
        assert_close(x, randn(2, 3), xp=backend.xp, device=backend.device, rtol=0)

    def test_the_device_proxy_puts_inputs_off_the_default_device(self):
        b = testing.make_backend("array_api_strict:device1")
        xp = b.xp
        assert b.device == xp.Device("device1") != xp.__array_namespace_info__().default_device()
        assert b.asarray(randn(3)).device == b.device
        with pytest.raises(ValueError, match="different devices"):
            b.asarray(randn(3)) + xp.asarray(randn(3))  # what a GPU would refuse too


class TestAssertClose:
    def test_equal_values_pass_on_every_backend(self, backend):
        a = randn(2, 4, 3)
        assert_close(backend.asarray(a), backend.asarray(a))
        assert_close(backend.asarray(a), a, xp=backend.xp, device=backend.device)
        q, k, v = (backend.asarray(randn(2, 3, 4, seed=s)) for s in range(3))
        out = scaled_dot_product_attention(q, k, v)
        q_np, k_np, v_np = (randn(2, 3, 4, seed=s) for s in range(3))
        expected = testing.reference_attention(q_np, k_np, v_np)
        assert_close(out, expected, xp=backend.xp, device=backend.device, rtol=1e-10)

    def test_different_values_fail(self, backend):
        a = randn(2, 3)
        with pytest.raises(AssertionError, match=r"values differ \(case 7\)"):
            assert_close(backend.asarray(a), backend.asarray(a + 1e-3), err_msg="case 7")
        with pytest.raises(AssertionError, match="values differ"):
            assert_close(backend.asarray(a), a + 1e-3, xp=backend.xp)
        assert_close(backend.asarray(a), backend.asarray(a + 1e-3), atol=2e-3)

    def test_shape_mismatch_fails_first(self, backend):
        with pytest.raises(AssertionError, match=r"shape mismatch.*\(2, 3\), expected \(3, 2\)"):
            assert_close(backend.asarray(randn(2, 3)), backend.asarray(randn(3, 2)))
        with pytest.raises(AssertionError, match=r"shape mismatch.*\(2, 3\), expected \(6,\)"):
            assert_close(backend.asarray(randn(2, 3)), randn(6), xp=backend.xp)

    def test_dtype_mismatch_fails(self, backend):
        a = randn(2, 3)
        f32 = backend.asarray(a, "float32")
        with pytest.raises(AssertionError, match=r"dtype mismatch.*float32, expected float64"):
            assert_close(f32, backend.asarray(a))
        with pytest.raises(AssertionError, match=r"dtype mismatch.*float32, expected float64"):
            assert_close(f32, a, xp=backend.xp)  # NumPy float64 data: float64 is expected
        with pytest.raises(AssertionError, match=r"dtype mismatch.*float64, expected float32"):
            assert_close(backend.asarray(a), a, xp=backend.xp, dtype=backend.dtype("float32"))
        assert_close(f32, a, xp=backend.xp, dtype=backend.dtype("float32"), atol=1e-6)

    def test_namespace_mismatch_fails(self, backend):
        a = randn(2, 3)
        if backend.family != "numpy":
            with pytest.raises(AssertionError, match=r"namespace mismatch.*pass `xp`"):
                assert_close(backend.asarray(a), a)  # NumPy data needs `xp`
        numpy_xp = testing.make_backend("numpy").xp
        if backend.xp is not numpy_xp:
            with pytest.raises(AssertionError, match=r"namespace mismatch.*expected one of"):
                assert_close(backend.asarray(a), a, xp=numpy_xp)
        with pytest.raises(AssertionError, match="not an array of a supported library"):
            assert_close([1.0, 2.0], np.ones(2))

    @pytest.mark.backends("array_api_strict", reason="array-api-strict's extra devices")
    def test_device_mismatch_fails(self, backend):
        xp = backend.xp
        a = randn(2, 3)
        on1 = xp.asarray(a, device=xp.Device("device1"))
        on2 = xp.asarray(a, device=xp.Device("device2"))
        with pytest.raises(AssertionError, match=r"device mismatch.*device1.*expected.*device2"):
            assert_close(on1, on2)  # the device of `expected`
        with pytest.raises(AssertionError, match=r"device mismatch.*device2.*expected.*device1"):
            assert_close(on2, a, xp=xp, device=xp.Device("device1"))
        assert_close(on1, a, xp=xp)  # NumPy data has no device to compare with: not checked
