"""The one timer of the project: medians of wall time after warm-up calls.

``portable-attn check`` and every benchmark time through here. A result is
handed to `sync` (e.g. :meth:`portable_attn.testing.Backend.sync`) inside the
timed region, so asynchronous device work and lazy Dask graphs are counted.
What only the benchmarks and tests use (interleaved timing, the RSS watch of
Dask workers) lives outside the package, in ``benchmarks/_timing.py``, built on
:func:`sample_seconds`. :func:`load_warning` says when the machine is too loaded
for a timing to mean much (a 1-minute load average above :data:`LOADED_PER_CPU` per CPU).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LOADED_PER_CPU", "load_warning", "machine_load", "median_seconds", "sample_seconds"]

#: a 1-minute load average above this many per CPU: the machine is loaded, timings unreliable
LOADED_PER_CPU = 1.0


def _no_sync(_: Any) -> None:
    return None


def sample_seconds(fn: Callable[[], Any], sync: Callable[[Any], Any], number: int) -> float:
    """Return the mean wall time of `number` calls ``sync(fn())`` (one timed sample)."""
    start = time.perf_counter()
    for _ in range(number):
        sync(fn())
    return (time.perf_counter() - start) / number


def median_seconds(
    fn: Callable[[], Any],
    *,
    repeats: int,
    warmup: int = 1,
    sync: Callable[[Any], Any] | None = None,
    number: int = 1,
) -> float:
    """Return the median wall time of one call of `fn`, after warm-up calls.

    Parameters
    ----------
    fn : callable
        Called with no arguments; its result is passed to `sync`.
    repeats : int
        Timed samples (at least 1).
    warmup : int, default 1
        Untimed calls first (library loading, JIT compilation, caches).
    sync : callable, optional
        ``sync(fn())`` is what is timed: it waits for the result to be computed.
        Default: nothing to wait for.
    number : int, default 1
        Calls per sample; a sample is their mean (for calls of microseconds).

    Returns
    -------
    float
        Seconds per call, the median over the `repeats` samples.
    """
    if repeats < 1:
        msg = f"repeats must be at least 1, got {repeats}"
        raise ValueError(msg)
    sync = _no_sync if sync is None else sync
    for _ in range(warmup):
        sync(fn())
    return statistics.median(sample_seconds(fn, sync, number) for _ in range(repeats))


def machine_load() -> tuple[float, int] | None:
    """Return the 1-minute load average and the number of CPUs, where both are known.

    Returns
    -------
    (float, int) or None
        ``os.getloadavg()[0]`` and ``os.cpu_count()``; None where the platform has
        no load average (Windows) or either cannot be read.
    """
    getloadavg = getattr(os, "getloadavg", None)
    if getloadavg is None:
        return None
    try:
        load = float(getloadavg()[0])
    except OSError:  # "load average was unobtainable"
        return None
    cpus = os.cpu_count()
    return None if not cpus else (load, cpus)


def load_warning() -> str | None:
    """Say that the machine is loaded, when its load average is above its CPUs.

    Returns
    -------
    str or None
        A line naming the 1-minute load average and the number of CPUs when the
        load is above :data:`LOADED_PER_CPU` per CPU; None otherwise, and where
        the load is not known (:func:`machine_load`).
    """
    found = machine_load()
    if found is None:
        return None
    load, cpus = found
    if load <= LOADED_PER_CPU * cpus:
        return None
    return (
        f"machine loaded: 1-minute load average {load:.2f} on {cpus} CPUs; "
        "the timings are unreliable"
    )
