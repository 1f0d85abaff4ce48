"""The one timer of the project: medians of wall time after warm-up calls.

``portable-attn check`` and every benchmark time through here. A result is
handed to `sync` (e.g. :meth:`portable_attn.testing.Backend.sync`) inside the
timed region, so asynchronous device work and lazy Dask graphs are counted.
What only the benchmarks and tests use (interleaved timing, the RSS watch of
Dask workers) lives outside the package, in ``benchmarks/_timing.py``, built on
:func:`sample_seconds`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["median_seconds", "sample_seconds"]


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
