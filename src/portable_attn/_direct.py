"""Repeated torch calls that go to SDPA as they are: the kernel call alone.

An eager call runs a few hundred lines of Python before its kernel: the checks,
the plan, the path, the masks. In a loop of its own that took 36 us per call, but
right after an SDPA call (which evicts that Python from the caches) 138 us, and the
full route ran at 1.07x SDPA in bfloat16 at L = 1024 with a padding mask, the kept
kernel call at 1.03x (issue 25; ``benchmarks/results/per-call-torch.json`` at 12f45a8).

For the calls whose arrays the native route hands to SDPA unchanged
(:func:`~portable_attn._paths._native.direct_kernel`: torch, Q, K, V and an optional
mask, nothing else), the first call of each signature takes the full route, and
its kernel call (:class:`~portable_attn._paths._native.DirectKernel`) is kept under
the signature (:func:`signature`): the types, shapes, dtypes, devices and layouts of
Q, K, V and the mask, ``is_causal``, ``scale``, ``block_size`` and
``implementation`` (each with its type), everything the checks, the plan and the path
read of such a call. A later call with the same signature is the kernel call alone,
its result cast to the inputs' dtype as the route's is (``torch.autocast`` changes
SDPA's). Calls that
fail a check are never kept; every other call takes the full route.
"""

from __future__ import annotations

from typing import Any

from ._lib import _policy
from ._lib._call import AttentionCall
from ._lib._compat import library_name
from ._lib._path import Native, Path
from ._paths._native import DirectKernel, direct_kernel

__all__ = ["forget", "kernel_for", "remember", "signature"]

#: The kept kernel calls by :func:`signature`
_KERNELS: dict[Any, DirectKernel] = {}
_KERNELS_SIZE = 256


def signature(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    is_causal: Any,
    scale: Any,
    block_size: Any,
    implementation: Any,
) -> Any:
    """Return the key of a torch call with no argument but these (None elsewhere).

    None for other libraries (no direct kernel) and for arguments that are not tensors.
    """
    if library_name(query) != "torch":
        return None
    try:
        arrays = tuple(
            None if x is None else (type(x), x.shape, x.dtype, x.device, x.layout)
            for x in (query, key, value, mask)
        )
    except AttributeError:
        return None
    options = (is_causal, scale, block_size, implementation)
    return (*arrays, *((type(o), o) for o in options))


def kernel_for(sig: Any) -> DirectKernel | None:
    """Return the kernel call kept for signature `sig`, or None (not kept, or unhashable)."""
    try:
        return _KERNELS.get(sig)
    except TypeError:  # an unhashable block_size: the full route says what it is
        return None


def remember(sig: Any, call: AttentionCall, path: Path, arguments: tuple[Any, ...]) -> None:
    """Keep the kernel call of `call` under `sig` where the route hands SDPA its arrays.

    `arguments`: the caller's query, key, value and mask.

    With :data:`~portable_attn._lib._policy.CHECK_CACHED_PATHS` (set by the tests) a
    kept kernel call that differs from the one the route decides now raises.
    """
    kernel = direct_kernel(call, path, arguments) if isinstance(path, Native) else None
    kept = kernel_for(sig)
    if kept is not None:
        if _policy.CHECK_CACHED_PATHS and kept != kernel:
            msg = f"kept kernel call {kept!r} but the route says {kernel!r} ({path!r}): forget()"
            raise AssertionError(msg)
        return
    if kernel is None:
        return
    if len(_KERNELS) >= _KERNELS_SIZE:
        _KERNELS.clear()
    _KERNELS[sig] = kernel


def forget() -> None:
    """Drop every kept kernel call (after a policy setting changes)."""
    _KERNELS.clear()
