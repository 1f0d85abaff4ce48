"""The host CPU: how many cores this process may use and whether BLAS threads can be limited.

Asked by the path policy (whether NumPy's query blocks run in threads) and used by
the threaded path (:mod:`portable_attn._paths._threads`), which limits BLAS to one
thread per worker while its threads run. :mod:`threadpoolctl` is optional.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["available_workers", "blas_limited", "can_limit_blas"]


def available_workers() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@functools.cache
def _controller() -> Any | None:
    """Return a cached ``threadpoolctl.ThreadpoolController``, or None without threadpoolctl."""
    try:
        import threadpoolctl
    except ImportError:
        return None
    return threadpoolctl.ThreadpoolController()


def can_limit_blas() -> bool:
    """Whether BLAS threads can be limited during a call (threadpoolctl is importable)."""
    return _controller() is not None


@contextlib.contextmanager
def blas_limited(limit: bool) -> Iterator[None]:
    """Limit BLAS to one thread per calling thread inside the block (if threadpoolctl is there)."""
    controller = _controller() if limit else None
    if controller is None:
        yield
        return
    with controller.limit(limits=1, user_api="blas"):
        yield
