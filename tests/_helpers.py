"""Assertions pinned to the backend under test."""

from __future__ import annotations

from typing import Any

import numpy as np

from _backends import BackendCase
from portable_attn._lib._compat import array_namespace, device


def assert_backend_array(backend: BackendCase, actual: Any, *, shape=None, dtype=None) -> None:
    """Check namespace, device, shape and dtype of a result before its values."""
    xp = array_namespace(actual=actual)
    assert xp is backend.xp or backend.family == "array_api_strict", (xp, backend.xp)
    if backend.device is not None:
        assert device(actual) == backend.device
    if shape is not None:
        assert tuple(actual.shape) == tuple(shape)
    if dtype is not None:
        assert actual.dtype == backend.dtype(dtype), (actual.dtype, dtype)


def assert_close(
    backend: BackendCase,
    actual: Any,
    expected: np.ndarray,
    *,
    dtype: str = "float64",
    atol: float = 1e-12,
    rtol: float = 1e-10,
) -> None:
    assert_backend_array(backend, actual, shape=np.shape(expected), dtype=dtype)
    np.testing.assert_allclose(
        backend.to_numpy(actual).astype(np.float64), expected, atol=atol, rtol=rtol
    )
