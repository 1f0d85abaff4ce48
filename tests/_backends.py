"""The backends the test suite runs on, and how to move NumPy data onto each.

A backend *family* is what a nox session asks for (``numpy``, ``torch``...);
each family has one or more *kinds* (``numpy`` and ``numpy_readonly``; ``torch``
and ``torch:cuda``...). GPU kinds are skipped with a reason when no device is
present; a family that a run asked for must be importable or the run fails.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FAMILIES: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy", "numpy_readonly"),
    "array_api_strict": ("array_api_strict",),
    "torch": ("torch", "torch:cuda"),
    "jax": ("jax", "jax:gpu"),
    "cupy": ("cupy",),
    "dask": ("dask",),
}
MODULES = {
    "numpy": "numpy",
    "array_api_strict": "array_api_strict",
    "torch": "torch",
    "jax": "jax",
    "cupy": "cupy",
    "dask": "dask.array",
}
ALL_KINDS = tuple(kind for kinds in FAMILIES.values() for kind in kinds)


def family_of(kind: str) -> str:
    return next(f for f, kinds in FAMILIES.items() if kind in kinds)


def family_installed(family: str) -> bool:
    return importlib.util.find_spec(MODULES[family].split(".")[0]) is not None


def _configure(family: str) -> None:
    if family == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
        jax.config.update("jax_default_matmul_precision", "highest")
    elif family == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def unavailable_reason(kind: str) -> str | None:
    """Why `kind` cannot run here, or None when it can."""
    family = family_of(kind)
    if not family_installed(family):
        return f"{MODULES[family]} is not installed"
    _configure(family)
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
        except Exception as exc:  # cupy raises CUDARuntimeError without a driver
            return f"cupy: no usable CUDA device ({type(exc).__name__})"
    return None


@dataclass
class BackendCase:
    """One kind of backend: its namespace, device and data conversions."""

    kind: str
    xp: Any = field(repr=False)
    device: Any = field(repr=False, default=None)

    @property
    def family(self) -> str:
        return family_of(self.kind)

    @property
    def has_autodiff(self) -> bool:
        return self.family in ("torch", "jax")

    def supports(self, dtype: str) -> bool:
        if dtype == "bfloat16":
            return self.family in ("torch", "jax")
        if dtype == "float16":  # not in the standard; array-api-strict leaves it out
            return self.family != "array_api_strict"
        return True

    def dtype(self, name: str) -> Any:
        if self.family == "dask" and not hasattr(self.xp, name):
            return np.dtype(name)  # the compat dask namespace lists only standard dtypes
        return getattr(self.xp, name)

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        """Return NumPy data `a` as an array of this backend (same values)."""
        a = np.asarray(a)
        if dtype is None:
            dtype = str(a.dtype)
        if dtype == "bfloat16":
            return self.xp.astype(self.asarray(a, "float32"), self.xp.bfloat16)
        a = a.astype(dtype)
        fam = self.family
        if self.kind == "numpy_readonly":
            a = a.copy()
            a.flags.writeable = False
            return a
        if fam == "numpy":
            return a.copy()
        if fam == "array_api_strict":
            return self.xp.asarray(a)
        if fam == "torch":
            import torch

            return torch.asarray(a.copy(), device=self.device)
        if fam == "jax":
            import jax

            return jax.device_put(a, self.device)
        if fam == "cupy":
            import cupy

            return cupy.asarray(a)
        if fam == "dask":
            import dask.array as da

            chunks = tuple(max(1, (n + 1) // 2) for n in a.shape)  # several chunks per axis
            return da.from_array(a, chunks=chunks)
        raise AssertionError(self.kind)

    def to_numpy(self, x: Any) -> np.ndarray:
        """Bring a backend array back to NumPy (bfloat16 as float32)."""
        fam = self.family
        if fam == "torch":
            import torch

            x = x.detach()
            if x.dtype == torch.bfloat16:
                x = x.float()
            return x.cpu().numpy()
        if fam == "jax":
            import jax.numpy as jnp

            if x.dtype == jnp.bfloat16:
                x = x.astype(jnp.float32)
            return np.asarray(x)
        if fam == "cupy":
            return x.get()
        if fam == "dask":
            return np.asarray(x.compute())
        if fam == "array_api_strict":
            return np.from_dlpack(x)
        return np.asarray(x)

    def grad(self, fn: Any, *args: Any) -> tuple[Any, ...]:
        """Gradients of the scalar ``fn(*args)`` with respect to every arg (torch/JAX)."""
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

            return jax.grad(fn, argnums=tuple(range(len(args))))(*args)
        msg = f"{self.kind} has no automatic differentiation"
        raise NotImplementedError(msg)


def make_case(kind: str) -> BackendCase:
    """Build the case for `kind`; the caller has checked :func:`unavailable_reason`."""
    import array_api_compat

    fam = family_of(kind)
    if fam in ("numpy",):
        import array_api_compat.numpy as xp

        return BackendCase(kind, xp)
    if fam == "array_api_strict":
        import array_api_strict as xp

        return BackendCase(kind, xp)
    if fam == "torch":
        import torch

        dev = torch.device("cuda" if kind == "torch:cuda" else "cpu")
        return BackendCase(kind, array_api_compat.array_namespace(torch.zeros(1)), dev)
    if fam == "jax":
        import jax

        dev = jax.devices("gpu" if kind == "jax:gpu" else "cpu")[0]
        return BackendCase(kind, array_api_compat.array_namespace(jax.numpy.zeros(1)), dev)
    if fam == "cupy":
        import array_api_compat.cupy as xp

        return BackendCase(kind, xp)
    if fam == "dask":
        import array_api_compat.dask.array as xp

        return BackendCase(kind, xp)
    raise AssertionError(kind)
