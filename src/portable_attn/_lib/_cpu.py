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

__all__ = [
    "available_workers",
    "blas_limited",
    "can_limit_blas",
    "cpuinfo",
    "cpuinfo_fields",
    "has_half_arithmetic",
]

#: CPU flags (Linux ``/proc/cpuinfo``) of arithmetic in a half dtype that the measured
#: routes rely on: float16, AVX512-FP16 (Sapphire Rapids and later) and AMX-FP16 (Granite
#: Rapids); bfloat16, AMX-BF16 (Sapphire Rapids and later). AVX512-BF16 alone (AMD Zen 4)
#: is not listed: JAX's bfloat16 products there ran no faster than float32 ones
#: (benchmarks/results/half-jax.json).
HALF_ARITHMETIC_FLAGS = {
    "float16": frozenset({"avx512_fp16", "amx_fp16"}),
    "bfloat16": frozenset({"amx_bf16"}),
}


def available_workers() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cpuinfo_fields(text: str) -> dict[str, str]:
    """Return the ``key: value`` fields of the first processor in ``/proc/cpuinfo`` text."""
    first = text.split("\n\n", 1)[0].splitlines()
    return {k.strip(): v.strip() for k, sep, v in (line.partition(":") for line in first) if sep}


def _read_cpuinfo() -> dict[str, str]:
    """Read :func:`cpuinfo_fields` of this machine: its first processor's lines alone."""
    lines = []
    try:
        with Path("/proc/cpuinfo").open(encoding="ascii", errors="replace") as text:
            for line in text:  # the kernel writes the processors one by one: stop at the first
                if not line.strip():
                    break
                lines.append(line)
    except OSError:
        return {}
    return cpuinfo_fields("".join(lines))


#: Read once, when this module is imported: never inside a call that ``torch.compile``
#: traces (a file read there broke its graph; ``fullgraph=True`` failed for half inputs,
#: whose route asks :func:`has_half_arithmetic`).
_CPUINFO = _read_cpuinfo()


def cpuinfo() -> dict[str, str]:
    """Return :func:`cpuinfo_fields` of this machine; empty without ``/proc/cpuinfo``."""
    return _CPUINFO


def has_half_arithmetic(dtype: str) -> bool:
    """Whether this CPU computes in half dtype `dtype` itself (:data:`HALF_ARITHMETIC_FLAGS`).

    `dtype` is ``"float16"`` or ``"bfloat16"``. False where ``/proc/cpuinfo`` is missing
    (macOS, Windows) or unreadable, which keeps the route measured on CPUs without such
    arithmetic.
    """
    flags = HALF_ARITHMETIC_FLAGS.get(dtype, frozenset())
    return not flags.isdisjoint(cpuinfo().get("flags", "").split())


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
