"""Tools to test attention on several array libraries: the backend table, an oracle, a check.

This is what the project's own test suite and ``portable-attn check`` use, and
what a user testing a model on several backends can use too:

- the backend table (:data:`FAMILIES`, :func:`make_backend`, :class:`Backend`):
  every array library the project runs on, how to move NumPy data onto it and
  back, how to synchronise its device and how to differentiate;
- the float64 NumPy oracle (:func:`reference_attention`,
  :func:`reference_weights`, :func:`reference_lse`,
  :func:`reference_max_logit`) and finite differences
  (:func:`central_differences`), written independently of the library;
- :func:`conformance`, which checks anyone's attention function against the
  oracle on random small cases and shrinks each failure to a small repro
  (:class:`ConformanceReport`, :class:`ConformanceFailure`);
- :func:`assert_close`, which checks an array's namespace, device, shape and
  dtype before its values (as ``array_api_extra``'s ``xp_assert_close`` does).

Importing this module imports none of the optional libraries (torch, JAX,
CuPy, Dask, array-api-strict): each is imported when a kind of it is asked for.

Examples
--------
>>> import numpy as np
>>> from portable_attn import scaled_dot_product_attention
>>> from portable_attn.testing import assert_close, make_backend, reference_attention
>>> b = make_backend("numpy")
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((2, 3, 4)) for _ in range(3))
>>> out = scaled_dot_product_attention(b.asarray(q), b.asarray(k), b.asarray(v))
>>> assert_close(out, reference_attention(q, k, v), xp=b.xp, rtol=1e-10)
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

from .._lib._compat import library_name, standard_namespace
from ._backends import (
    ALL_KINDS,
    AUTODIFF_FAMILIES,
    DTYPE_FAMILIES,
    DTYPES,
    FAMILIES,
    GPU_KINDS,
    MODULES,
    TEST_ONLY_KINDS,
    Backend,
    configure,
    family_installed,
    family_of,
    has_autodiff,
    kind_supports,
    make_backend,
    to_numpy,
    unavailable_reason,
)
from ._conformance import (
    ALIGNMENTS,
    FEATURES,
    ConformanceFailure,
    ConformanceReport,
    conformance,
)
from ._reference import (
    central_differences,
    reference_attention,
    reference_lse,
    reference_max_logit,
    reference_weights,
    structure,
)
from ._serving_conformance import (
    SERVING_KINDS,
    ServingCase,
    ServingReport,
    serving_conformance,
)

__all__ = [
    "ALIGNMENTS",
    "ALL_KINDS",
    "AUTODIFF_FAMILIES",
    "DTYPES",
    "DTYPE_FAMILIES",
    "FAMILIES",
    "GPU_KINDS",
    "MODULES",
    "TEST_ONLY_KINDS",
    "FEATURES",
    "SERVING_KINDS",
    "Backend",
    "ConformanceFailure",
    "ConformanceReport",
    "ServingCase",
    "ServingReport",
    "assert_close",
    "central_differences",
    "configure",
    "conformance",
    "family_installed",
    "family_of",
    "has_autodiff",
    "kind_supports",
    "make_backend",
    "reference_attention",
    "reference_lse",
    "reference_max_logit",
    "reference_weights",
    "serving_conformance",
    "structure",
    "to_numpy",
    "unavailable_reason",
]


def _namespace_name(xp: Any) -> str:
    return getattr(xp, "__name__", type(xp).__name__)


def _dtype_name(dtype: Any) -> str:
    """Return ``"float32"`` for the float32 of any library (torch's is ``torch.float32``)."""
    return str(dtype).rsplit(".", 1)[-1]


def _is_host_numpy(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or not array_api_compat.is_array_api_obj(x)


def _default_rtol(dtype: Any) -> float:
    name = _dtype_name(dtype)
    if name == "bfloat16":
        return 4 * 2.0**-7
    try:
        return 4 * float(np.finfo(name).eps)
    except (TypeError, ValueError):  # integers and booleans compare exactly
        return 0.0


def assert_close(
    actual: Any,
    expected: Any,
    *,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
    rtol: float | None = None,
    atol: float = 0.0,
    err_msg: str = "",
) -> None:
    """Assert that `actual` is the array expected, then that its values are close.

    Checked in order, each with its own message: the namespace of `actual`, its
    device, its shape (that of `expected`), its dtype, and finally its values
    (on the host, in float64, with :func:`numpy.testing.assert_allclose`: NaN
    matches NaN).

    Parameters
    ----------
    actual : array
        The result to check, an array of any supported library.
    expected : array or array_like
        The values it should have: an array of the same library, or NumPy data
        (such as the float64 oracle :func:`reference_attention`) when `xp` is given.
    xp : namespace, optional
        The array-API namespace `actual` must have (e.g. ``Backend.xp``).
        Default: that of `expected`, which must then be an array of the same
        library as `actual`.
    device : object, optional
        The device `actual` must be on (e.g. ``Backend.device``). Default: the
        device of `expected` when it is of the same library as `actual`, else
        not checked.
    dtype : dtype, optional
        The dtype `actual` must have, a dtype of its library. Default: that of
        `expected` (compared by name, such as ``"float64"``, across libraries).
    rtol : float, optional
        Relative tolerance. Default: four units in the last place of the dtype
        of `actual` (``4 * finfo.eps``), as array-api-extra's.
    atol : float, default 0.0
        Absolute tolerance.
    err_msg : str, default ""
        Added to every failure message.

    Raises
    ------
    AssertionError
        On the first mismatch, naming what differs (namespace, device, shape,
        dtype or values) and both sides.

    Examples
    --------
    >>> import numpy as np
    >>> assert_close(np.asarray([1.0, 2.0]), np.asarray([1.0, 2.0 + 1e-16]))
    """
    note = f" ({err_msg})" if err_msg else ""
    if not array_api_compat.is_array_api_obj(actual):
        msg = f"`actual` is not an array of a supported library: {type(actual).__name__}{note}"
        raise AssertionError(msg)
    actual_xp = array_api_compat.array_namespace(actual)
    host_expected = _is_host_numpy(expected)
    same_library = library_name(actual) == library_name(expected) and not (
        host_expected and not isinstance(actual, np.ndarray)
    )
    if xp is None:
        if not same_library:
            msg = (
                f"namespace mismatch: `actual` is an array of {_namespace_name(actual_xp)}, "
                f"`expected` of {type(expected).__module__} (pass `xp` to compare with "
                f"NumPy data){note}"
            )
            raise AssertionError(msg)
        xp = array_api_compat.array_namespace(expected)
    xp = standard_namespace(xp)
    if actual_xp is not xp:
        msg = (
            f"namespace mismatch: `actual` is an array of {_namespace_name(actual_xp)}, "
            f"expected one of {_namespace_name(xp)}{note}"
        )
        raise AssertionError(msg)
    found = array_api_compat.device(actual)
    if device is None and same_library and not host_expected:
        device = array_api_compat.device(expected)
    if device is not None and found != device:
        msg = f"device mismatch: `actual` is on {found!r}, expected {device!r}{note}"
        raise AssertionError(msg)
    shape = tuple(np.shape(expected)) if host_expected else tuple(expected.shape)
    if tuple(actual.shape) != shape:
        msg = f"shape mismatch: `actual` has shape {tuple(actual.shape)}, expected {shape}{note}"
        raise AssertionError(msg)
    if dtype is None:
        want = _dtype_name(np.asarray(expected).dtype if host_expected else expected.dtype)
        ok = _dtype_name(actual.dtype) == want
    else:
        want, ok = _dtype_name(dtype), actual.dtype == dtype
    if not ok:
        found = _dtype_name(actual.dtype)
        msg = f"dtype mismatch: `actual` has dtype {found}, expected {want}{note}"
        raise AssertionError(msg)
    np.testing.assert_allclose(
        to_numpy(actual),
        to_numpy(expected),
        rtol=_default_rtol(actual.dtype) if rtol is None else rtol,
        atol=atol,
        err_msg=f"values differ{note}",
    )
