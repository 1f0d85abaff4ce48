"""The single place that imports :mod:`array_api_compat`.

Everything else in the package asks this module for the namespace, the device
and the library name of an array, so backend detection lives in one spot and can
be cached per array type (namespace resolution is the largest part of the
per-call overhead on tiny inputs).
"""

from __future__ import annotations

from typing import Any

import array_api_compat
from array_api_compat import device, is_array_api_obj, size

__all__ = [
    "array_namespace",
    "device",
    "is_array_api_obj",
    "chunk_sizes",
    "library_name",
    "numpy_namespace",
    "size",
    "to_numpy",
]

_NAMESPACE_BY_TYPE: dict[type, Any] = {}


def library_name(x: Any) -> str:
    """Return the name of the library that owns array `x` (``"numpy"``, ``"torch"``, ...)."""
    name = type(x).__module__.split(".", 1)[0]
    return "jax" if name == "jaxlib" else name  # concrete JAX arrays live in jaxlib


def chunk_sizes(x: Any, axis: int) -> tuple[int, ...] | None:
    """Return the chunk sizes along `axis` of a Dask array split there, else None.

    Only for arrays split into several chunks along `axis` (with known sizes);
    NumPy, torch, JAX, CuPy and single-chunk axes give None.
    """
    if library_name(x) != "dask":
        return None
    sizes = x.chunks[axis]
    if len(sizes) < 2 or any(n != n for n in sizes):  # one chunk, or unknown (NaN) sizes
        return None
    return tuple(int(n) for n in sizes)


def _namespace_of(name: str, x: Any) -> Any:
    cls = type(x)
    xp = _NAMESPACE_BY_TYPE.get(cls)
    if xp is None:
        if not is_array_api_obj(x):
            msg = f"`{name}` must be an array, but got an object of type {cls.__qualname__!r}"
            raise TypeError(msg)
        xp = array_api_compat.array_namespace(x)
        # JAX tracers and other transient types are not cached: their namespace
        # is resolved each time (cheap), while the concrete array types are.
        if library_name(x) in {"numpy", "torch", "cupy", "array_api_strict", "dask"}:
            _NAMESPACE_BY_TYPE[cls] = xp
    return xp


def array_namespace(**arrays: Any) -> Any:
    """Return the one array-API namespace shared by the named arrays.

    ``None`` values are ignored. Arrays from different libraries raise a
    :class:`TypeError` that names both arguments and both libraries.

    Parameters
    ----------
    **arrays
        The arrays keyed by argument name, e.g. ``query=q, key=k``.

    Returns
    -------
    namespace
        The array-API compatible namespace (from ``array_api_compat``).
    """
    found_name = found_lib = xp = None
    for name, x in arrays.items():
        if x is None:
            continue
        x_xp = _namespace_of(name, x)
        if xp is None:
            xp, found_name, found_lib = x_xp, name, library_name(x)
        elif x_xp is not xp:
            msg = (
                f"`{found_name}` and `{name}` come from different array libraries: "
                f"`{found_name}` is a {found_lib} array, `{name}` is a "
                f"{library_name(x)} array; convert them to one library first"
            )
            raise TypeError(msg)
    if xp is None:  # pragma: no cover - callers always pass at least one array
        msg = "at least one array is required"
        raise TypeError(msg)
    return xp


def numpy_namespace() -> Any:
    """Return the array-API compatible NumPy namespace."""
    import array_api_compat.numpy as np_xp

    return np_xp


def to_numpy(x: Any) -> Any:
    """Copy an array of any supported library to a float64 NumPy array on the host.

    A host transfer (and, for Dask, a computation): only for reports, never in
    the attention computation itself.
    """
    import numpy as np

    lib = library_name(x)
    if lib == "dask":
        x = x.compute()
    elif lib == "torch":
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
    elif lib == "cupy":
        x = x.get()
    elif lib == "array_api_strict":
        return np.from_dlpack(x).astype(np.float64)
    return np.asarray(x, dtype=np.float64)
