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
from pathlib import Path
from typing import Any

__all__ = ["available_workers", "blas_limited", "can_limit_blas", "has_float16_arithmetic"]

#: CPU flags (Linux ``/proc/cpuinfo``) of float16 arithmetic in hardware: AVX512-FP16
#: (Sapphire Rapids and later) and AMX-FP16 (Granite Rapids)
FLOAT16_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})


def available_workers() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@functools.cache
def has_float16_arithmetic() -> bool:
    """Whether this CPU computes in float16 itself (one of :data:`FLOAT16_FLAGS`).

    Read from ``/proc/cpuinfo``; False where there is none (macOS, Windows) or it
    cannot be read, which keeps the route measured on CPUs without such arithmetic.
    """
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    return float16_flags_in(text)


def float16_flags_in(cpuinfo: str) -> bool:
    """Whether the first ``flags`` line of `cpuinfo` names one of :data:`FLOAT16_FLAGS`."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return not FLOAT16_FLAGS.isdisjoint(line.partition(":")[2].split())
    return False


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
