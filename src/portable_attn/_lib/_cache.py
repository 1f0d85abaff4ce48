"""The one cache in front of the route: call signature -> what was decided for it.

A call's *signature* (:func:`signature`) is everything the checks, the plan and the
router read of it without reading values: the type, shape and dtype of every array
argument (with the device and layout where the library pins devices), the query's
device, and every scalar option with its type. Calls with the same signature pass
the same static checks and get the same plan and, unless the route reads host
values, the same route. So the first call of a signature validates, plans and
routes, and keeps an :class:`Entry`; a later call replays it:

- an entry with a kept kernel call is that call alone: torch's SDPA
  (:class:`~portable_attn._paths._native.DirectKernel`) or the dense path
  (:class:`~portable_attn._lib._dense.DenseKernel`: NumPy, array-api-strict, CuPy, torch
  on the portable path), where the call's Q, K, V and mask go to it as they are;
- an entry with a route runs it on the call's arrays (the score terms still gathered
  and checked), with its compiled program for an eager JAX call;
- an entry without a route (the router read host values: lengths or segment ids)
  skips the static checks and the plan, and routes again.

A call that fails a check is never kept. Nothing is kept while ``torch.compile``
traces (a compiled graph has no Python to save, and symbolic shapes are not keys).
After a router setting changes (:mod:`portable_attn._lib._route`), :func:`forget`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _route
from ._compat import device, forward_mode, torch_records
from ._path import Route
from ._scores import AttentionPlan

__all__ = ["Entry", "entry_for", "forget", "signature"]


@dataclass(frozen=True)
class Entry:
    """What was decided for one call signature.

    `xp` and `plan`: the namespace and the static facts; `route`: the route, or None
    where the router reads host values (decided per call); `kept`: the kernel call of
    a call SDPA or the dense path takes as it is, or the compiled program of an eager
    JAX call.
    """

    xp: Any
    plan: AttentionPlan
    route: Route | None = None
    kept: Any = None


_ENTRIES: dict[Any, Entry] = {}


def signature(arrays: tuple[Any, ...], options: tuple[Any, ...]) -> Any:
    """Return the cache key of a call of these `arrays` and scalar `options`, or None.

    `arrays` start with the query; None entries are arguments not given. `options`
    are the scalar arguments in a fixed order, ``scale`` second and ``softcap``
    fourth (a pair's entries keyed with their types: ``(1, 2) == (True, 2)``). None:
    not kept -- an argument that is not an array (the checks will say), a learned
    `scale` or `softcap` (an array in the plan), a call that a torch tracer records
    (``torch.compile``, ``torch.func``) or differentiates in forward mode: the router
    decides differently there. A key
    with an unhashable part is never kept either (:func:`entry_for`).
    """
    query = arrays[0]
    scale, softcap = options[1], options[3]  # a learned scale or cap: this call's value
    if hasattr(scale, "shape") or hasattr(softcap, "shape") or torch_records(query):
        return None
    try:
        row = _route.library(query)
        if row.autodiff is not None and forward_mode(arrays):
            return None
        if row.pins_devices:  # torch (.device, .layout), CuPy (.device.id)
            parts: list[Any] = [
                None
                if x is None
                # requires_grad: a kernel without a backward is routed around
                else (type(x), x.shape, x.dtype, x.device, x.layout, x.requires_grad)
                if hasattr(x, "layout")
                else (type(x), x.shape, x.dtype, x.device.id)  # CuPy's Device: unhashable
                for x in arrays
            ]
        else:
            parts = [None if x is None else (type(x), x.shape, x.dtype) for x in arrays]
            parts.append(device(query))
        # each option with its type, and a pair's entries' types: (1, 2) == (True, 2)
        if row.autodiff == "torch":  # a kernel without a backward
            import torch

            parts.append(torch.is_grad_enabled())
        parts += (options, tuple(map(type, options)))
        parts += [tuple(map(type, o)) for o in options if type(o) is tuple]
    except Exception:  # not an array: the checks will say what it is
        return None
    return tuple(parts)  # an unhashable part: entry_for keeps nothing


def entry_for(key: Any, derive: Callable[[], tuple[Entry, Any]]) -> tuple[Entry, Any]:
    """Return the entry kept under signature `key`, or derive and keep one.

    `derive` validates, plans and routes the call (a miss); it returns the entry and
    what the caller needs of that work. Returns ``(entry, None)`` on a hit and
    ``derive()`` on a miss. A `key` of None is never kept: every such call derives.
    """
    try:
        entry = None if key is None else _ENTRIES.get(key)
    except TypeError:  # an unhashable part (a list for a pair, say): never kept
        key = entry = None
    if entry is not None:
        return entry, None
    entry, derived = derive()
    if key is not None:
        if len(_ENTRIES) >= _route.CACHE_SIZE:
            _ENTRIES.clear()
        _ENTRIES[key] = entry
    return entry, derived


def forget() -> None:
    """Drop every entry: after a router setting changes."""
    _ENTRIES.clear()
