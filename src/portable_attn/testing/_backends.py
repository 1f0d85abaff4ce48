"""The one backend table: every array library the project runs on, by kind.

This is the one place that knows how each library converts NumPy data to its
arrays and back, how it synchronises a device and how it differentiates. It is
public as :mod:`portable_attn.testing`, which the test suite, the
``portable-attn check`` command line and the benchmarks all use; the attention
itself never does (it is written once against the array API).

A backend *family* is a library (``numpy``, ``torch``...); each family has one
or more *kinds* (``numpy`` and ``numpy_readonly``; ``torch`` and
``torch:cuda``...). Every library is imported lazily, when a kind of it is asked
about, so importing this module imports none of them, and what each kind can
do (its dtypes, automatic differentiation, its device) is plain data here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._lib._compat import library_name

__all__ = [
    "ALL_KINDS",
    "AUTODIFF_FAMILIES",
    "DTYPES",
    "DTYPE_FAMILIES",
    "FAMILIES",
    "GPU_KINDS",
    "MODULES",
    "TEST_ONLY_KINDS",
    "Backend",
    "configure",
    "family_installed",
    "family_of",
    "has_autodiff",
    "kind_supports",
    "make_backend",
    "to_numpy",
    "unavailable_reason",
]

FAMILIES: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy", "numpy_readonly"),
    "array_api_strict": ("array_api_strict", "array_api_strict:device1"),
    "torch": ("torch", "torch:cuda"),
    "jax": ("jax", "jax:gpu"),
    "cupy": ("cupy",),
    "dask": ("dask",),
}
"""The kinds of each family; the first kind of a family runs on the CPU (CuPy: GPU).

``numpy_readonly`` gives read-only NumPy inputs; ``array_api_strict:device1``
puts every input on array-api-strict's non-default device ``"device1"``, where
combining it with an array made on the default device raises, as it would on a
GPU: a CPU check of device handling.
"""

MODULES: dict[str, str] = {
    "numpy": "numpy",
    "array_api_strict": "array_api_strict",
    "torch": "torch",
    "jax": "jax",
    "cupy": "cupy",
    "dask": "dask.array",
}
"""The module that provides each family's arrays."""

ALL_KINDS: tuple[str, ...] = tuple(kind for kinds in FAMILIES.values() for kind in kinds)
DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
"""The floating dtypes the project computes in, widest first."""


AUTODIFF_FAMILIES: tuple[str, ...] = ("torch", "jax")
"""The families with automatic differentiation (:meth:`Backend.grad`)."""

DTYPE_FAMILIES: dict[str, tuple[str, ...]] = {
    "bfloat16": ("torch", "jax"),
    "float16": tuple(f for f in FAMILIES if f != "array_api_strict"),  # not in the standard
}
"""The families that compute in each dtype that not every family has."""

GPU_KINDS: dict[str, str] = {"torch:cuda": "cuda", "jax:gpu": "gpu", "cupy": "cuda"}
"""The kinds that need a GPU, with the name of their device."""

TEST_ONLY_KINDS: tuple[str, ...] = ("numpy_readonly", "array_api_strict:device1")
"""Kinds that compute like another kind of their family and only check inputs:
the test suite runs them, ``portable-attn check`` does not."""

_DEVICE_NAMES = {**GPU_KINDS, "array_api_strict:device1": "device1"}
_GPU_KINDS = GPU_KINDS  # the name portable_attn._check imports


def family_of(kind: str) -> str:
    """Return the family (library) of a backend kind.

    Parameters
    ----------
    kind : str
        One of :data:`ALL_KINDS`, e.g. ``"torch:cuda"``.

    Returns
    -------
    str
        The family, e.g. ``"torch"``.
    """
    for family, kinds in FAMILIES.items():
        if kind in kinds:
            return family
    msg = f"unknown backend kind {kind!r}; choose from {', '.join(ALL_KINDS)}"
    raise ValueError(msg)


def has_autodiff(kind: str) -> bool:
    """Return whether backend `kind` differentiates (without importing its library)."""
    return family_of(kind) in AUTODIFF_FAMILIES


def kind_supports(kind: str, dtype: str) -> bool:
    """Return whether backend `kind` computes in floating dtype `dtype` (a name).

    Known without importing the library: the test suite asks while it collects.

    Parameters
    ----------
    kind : str
        One of :data:`ALL_KINDS`.
    dtype : str
        One of :data:`DTYPES`.

    Returns
    -------
    bool
    """
    if dtype not in DTYPES:
        msg = f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}"
        raise ValueError(msg)
    return family_of(kind) in DTYPE_FAMILIES.get(dtype, tuple(FAMILIES))


def family_installed(family: str) -> bool:
    """Return whether the library of `family` can be imported (without importing it)."""
    return importlib.util.find_spec(MODULES[family].split(".")[0]) is not None


@functools.cache
def configure(family: str) -> None:
    """Set a library up for exact comparisons, once per process.

    JAX gets float64 (``jax_enable_x64``) and full-precision matmuls
    (``jax_default_matmul_precision="highest"``); torch gets TF32 switched off.
    Other families need nothing. Benchmarks skip this (see :func:`make_backend`)
    so that they time the libraries' default settings.

    Parameters
    ----------
    family : str
        A key of :data:`FAMILIES`.
    """
    if family == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
        jax.config.update("jax_default_matmul_precision", "highest")
    elif family == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def unavailable_reason(kind: str, *, exact: bool = True) -> str | None:
    """Return why `kind` cannot run here, or None when it can.

    Parameters
    ----------
    kind : str
        One of :data:`ALL_KINDS`.
    exact : bool, default True
        Whether to :func:`configure` the library for exact comparisons first.

    Returns
    -------
    str or None
        The library that is not installed, or the device that is missing (for
        CuPy without a usable GPU, with the exception it raised).
    """
    family = family_of(kind)
    if not family_installed(family):
        return f"{MODULES[family]} is not installed"
    if exact:
        configure(family)
    if kind == "torch:cuda":
        import torch

        if not torch.cuda.is_available():
            return "torch: no CUDA device"
    elif kind == "jax:gpu":
        import jax

        try:
            jax.devices("gpu")
        except RuntimeError:
            return "jax: no GPU device"
    elif kind == "cupy":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                return "cupy: no CUDA device"
        except Exception as exc:  # CUDARuntimeError (no driver) and friends
            return f"cupy: no usable CUDA device ({type(exc).__name__}: {exc})"
    return None


def _host(family: str, x: Any) -> np.ndarray:
    """Copy an array of `family` to NumPy on the host, bfloat16 as float32."""
    if family == "torch":
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.cpu().numpy()
    if family == "jax":
        import jax.numpy as jnp

        if x.dtype == jnp.bfloat16:
            x = x.astype(jnp.float32)
        return np.asarray(x)
    if family == "cupy":
        return x.get()
    if family == "dask":
        return np.asarray(x.compute())
    if family == "array_api_strict":
        try:
            return np.from_dlpack(x)
        except BufferError:  # NumPy < 2 exports no read-only array (a broadcast view)
            import array_api_strict

            return np.from_dlpack(array_api_strict.asarray(x, copy=True))
    return np.asarray(x)


@dataclass(frozen=True)
class Backend:
    """One kind of backend: its namespace, device and data conversions.

    Parameters
    ----------
    kind : str
        One of :data:`ALL_KINDS`.
    xp : namespace
        The array-API compatible namespace (from ``array_api_compat``, or
        ``array_api_strict`` itself).
    device : object, optional
        The library's device object for torch, JAX and ``array_api_strict:device1``,
        else None (the library's default device).
    version : str, default "?"
        The library's version.
    """

    kind: str
    xp: Any = field(repr=False)
    device: Any = field(repr=False, default=None)
    version: str = "?"

    @property
    def family(self) -> str:
        """The library: a key of :data:`FAMILIES`."""
        return family_of(self.kind)

    @property
    def device_name(self) -> str:
        """Where it computes: ``"cpu"``, ``"cuda"``, ``"gpu"`` (JAX) or ``"device1"``."""
        return _DEVICE_NAMES.get(self.kind, "cpu")

    @property
    def has_autodiff(self) -> bool:
        """Whether :meth:`grad` works (torch and JAX)."""
        return has_autodiff(self.kind)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The floating dtypes it computes in, widest first."""
        return tuple(name for name in DTYPES if self.supports(name))

    def supports(self, dtype: str) -> bool:
        """Return whether the backend computes in floating dtype `dtype` (a name)."""
        return kind_supports(self.kind, dtype)

    def dtype(self, name: str) -> Any:
        """Return the backend's dtype object called `name` (e.g. ``"float32"``)."""
        if self.family == "dask" and not hasattr(self.xp, name):
            return np.dtype(name)  # the compat dask namespace lists only standard dtypes
        return getattr(self.xp, name)

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        """Return NumPy data as an array of this backend, with the same values.

        Parameters
        ----------
        a : array_like
            The data, any shape.
        dtype : str, optional
            The dtype name of the result (default: that of ``np.asarray(a)``);
            ``"bfloat16"`` rounds through float32.

        Returns
        -------
        array
            A new array of the backend, shaped like `a`, on its device. NumPy
            gives a copy (read-only for ``numpy_readonly``); Dask splits every
            axis of length n into chunks of ``(n + 1) // 2``, so that every axis
            longer than one has several chunks.
        """
        a = np.asarray(a)
        if dtype is None:
            dtype = str(a.dtype)
        if dtype == "bfloat16":
            return self.xp.astype(self.asarray(a, "float32"), self.xp.bfloat16)
        a = a.astype(dtype)
        family = self.family
        if self.kind == "numpy_readonly":
            a = a.copy()
            a.flags.writeable = False
            return a
        if family == "numpy":
            return a.copy()
        if family == "array_api_strict":
            return self.xp.asarray(a, device=self.device)
        if family == "torch":
            import torch

            return torch.asarray(a.copy(), device=self.device)
        if family == "jax":
            import jax

            return jax.device_put(a, self.device)
        if family == "cupy":
            import cupy

            return cupy.asarray(a)
        if family == "dask":
            import dask.array as da

            chunks = tuple(max(1, (n + 1) // 2) for n in a.shape)  # several chunks per axis
            return da.from_array(a, chunks=chunks)
        raise AssertionError(self.kind)  # pragma: no cover - FAMILIES is closed

    def to_numpy(self, x: Any) -> np.ndarray:
        """Bring an array of this backend back to NumPy (bfloat16 as float32).

        Parameters
        ----------
        x : array
            An array of this backend (a Dask array is computed).

        Returns
        -------
        ndarray
            The values, same shape and dtype (bfloat16 becomes float32).
        """
        return _host(self.family, x)

    def sync(self, x: Any) -> None:
        """Wait until `x` (an array, or a tuple of arrays) is computed.

        JAX blocks until it is ready, torch on CUDA and CuPy synchronise the
        device, Dask computes it (and drops the result); NumPy, array-api-strict
        and torch on the CPU compute eagerly and need nothing.
        """
        family = self.family
        if family == "jax":
            import jax

            jax.block_until_ready(x)
        elif self.kind == "torch:cuda":
            import torch

            torch.cuda.synchronize(self.device)
        elif family == "cupy":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
        elif family == "dask":
            import dask

            dask.compute(x)

    def grad(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        """Return the gradients of the scalar ``fn(*args)`` with respect to every argument.

        Parameters
        ----------
        fn : callable
            Maps arrays of this backend to a scalar (0-d) array.
        *args : array
            The point to differentiate at.

        Returns
        -------
        tuple of array
            One gradient per argument, shaped like it (zeros where `fn` does not
            depend on it). Only torch (autograd) and JAX (``jax.jit(jax.grad(fn))``:
            one program, as a training step runs it; `fn` must trace, and the arrays it
            closes over stay concrete).
        """
        if self.family == "torch":
            import torch

            leaves = [a.detach().clone().requires_grad_(True) for a in args]
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, allow_unused=True)
            return tuple(
                torch.zeros_like(a) if g is None else g for a, g in zip(args, grads, strict=True)
            )
        if self.family == "jax":
            import jax

            return jax.jit(jax.grad(fn, argnums=tuple(range(len(args)))))(*args)
        msg = f"{self.kind} has no automatic differentiation"
        raise NotImplementedError(msg)


@functools.cache
def make_backend(kind: str, *, exact: bool = True) -> Backend:
    """Return the (cached) backend of `kind`.

    Parameters
    ----------
    kind : str
        One of :data:`ALL_KINDS`; it must be able to run here (see
        :func:`unavailable_reason`).
    exact : bool, default True
        :func:`configure` the library for exact comparisons (tests and
        ``portable-attn check``). Benchmarks pass False to time the library's
        own defaults; the setting is process-wide once made.

    Returns
    -------
    Backend
    """
    reason = unavailable_reason(kind, exact=exact)
    if reason is not None:
        msg = f"backend {kind!r} cannot run: {reason}"
        raise RuntimeError(msg)
    import array_api_compat

    family = family_of(kind)
    library = importlib.import_module(MODULES[family].split(".")[0])
    version = getattr(library, "__version__", "?")
    if family == "numpy":
        import array_api_compat.numpy as xp

        return Backend(kind, xp, version=version)
    if family == "array_api_strict":
        import array_api_strict as strict

        extra = strict.Device("device1") if kind == "array_api_strict:device1" else None
        return Backend(kind, strict, extra, version)
    if family == "torch":
        import torch

        dev = torch.device("cpu")
        if kind == "torch:cuda":  # where arrays land: cuda:0 ("cuda" compares unequal to it)
            dev = torch.device("cuda", torch.cuda.current_device())
        return Backend(kind, array_api_compat.array_namespace(torch.zeros(1)), dev, version)
    if family == "jax":
        import jax

        dev = jax.devices("gpu" if kind == "jax:gpu" else "cpu")[0]
        return Backend(kind, array_api_compat.array_namespace(jax.numpy.zeros(1)), dev, version)
    if family == "cupy":
        import array_api_compat.cupy as cupy_xp

        return Backend(kind, cupy_xp, version=version)
    import array_api_compat.dask.array as dask_xp

    return Backend(kind, dask_xp, version=version)


def _family_of_array(x: Any) -> str | None:
    name = library_name(x)
    return name if name in FAMILIES else None


def to_numpy(x: Any) -> np.ndarray:
    """Copy an array of any supported library to a float64 NumPy array on the host.

    A host transfer (and, for Dask, a computation): for reports and
    comparisons, never inside the attention computation.

    Parameters
    ----------
    x : array or array_like
        An array of NumPy, array-api-strict, torch, JAX, CuPy or Dask, or
        anything :func:`numpy.asarray` takes.

    Returns
    -------
    ndarray
        float64, same shape.
    """
    family = _family_of_array(x)
    host = np.asarray(x) if family is None else _host(family, x)
    return np.asarray(host, dtype=np.float64)
