"""Timing and memory helpers that only the benchmarks and the tests use.

Interleaved timing (several implementations timed round-robin in one process,
so that drift of a shared machine hits them alike) and the resident-memory watch
of Dask workers. The one timer, :func:`portable_attn._timing.median_seconds`
(which ``portable-attn check`` uses too), stays in the package; this module
builds on its :func:`~portable_attn._timing.sample_seconds` and re-exports it.

The benchmarks import it as ``_timing`` (their folder is on ``sys.path``);
``tests/test_dask_distributed.py`` loads it from this file.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from portable_attn._timing import median_seconds, sample_seconds

__all__ = [
    "Interleaved",
    "interleaved_seconds",
    "median_seconds",
    "peak_extra_mib",
    "start_rss_watch",
    "stop_rss_watch",
]


def _no_sync(_: Any) -> None:
    return None


@dataclass(frozen=True)
class Interleaved:
    """The samples of several callables timed round-robin.

    Parameters
    ----------
    samples : dict of name to list of float
        Seconds per call of each name (any hashable), one sample per round, in round order.
    """

    samples: dict[Any, list[float]]

    @property
    def medians(self) -> dict[Any, float]:
        """Seconds per call of each name, the median over the rounds."""
        return {name: statistics.median(s) for name, s in self.samples.items()}

    def ratios(self, numerator: Any, denominator: Any) -> list[float]:
        """Return the per-round time ratios ``numerator / denominator``.

        Both were timed in the same round, next to each other, so the ratios
        cancel the drift of the machine between rounds.

        Parameters
        ----------
        numerator, denominator : hashable
            Names of the timed callables.

        Returns
        -------
        list of float
            One ratio per round.
        """
        return [
            a / b for a, b in zip(self.samples[numerator], self.samples[denominator], strict=True)
        ]


def interleaved_seconds(
    fns: Mapping[Any, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
    sync: Callable[[Any], Any] | None = None,
    number: int = 1,
    before: Callable[[], Any] | None = None,
    shuffle: bool = False,
) -> Interleaved:
    """Time several callables side by side, round-robin, in this process.

    Each of the `repeats` rounds times every callable once (`number` calls),
    starting from a different one each round (the order rotates: for two, it
    alternates), so that neither always runs first. In the rotation each callable
    mostly follows the same neighbour; `before` makes what runs just before every
    sample the same for all.

    Parameters
    ----------
    fns : mapping of name to callable
        The callables by name (any hashable: a str, a bool...); each is called with no arguments.
    repeats : int
        Rounds (at least 1).
    warmup : int, default 1
        Untimed calls of each callable first.
    sync : callable, optional
        ``sync(fn())`` is what is timed (see :func:`median_seconds`).
    number : int, default 1
        Calls per sample.
    before : callable, optional
        Called (untimed, its result synced) before each sample: what precedes the
        call in a program (a projection before attention), the same for every
        callable. On a CPU the time of a call depends on what ran just before it
        (``benchmarks/half.py`` times torch both ways).

    shuffle : bool, default False
        Each round in its own random order (seeded), instead of the rotation: every
        callable follows each of the others about equally often. Where one of them
        leaves the caches cold for whatever comes next (a textbook of hundreds of MiB
        of scores), the rotation always puts the same callable after it.
    Returns
    -------
    Interleaved
        The samples; ``.medians`` gives seconds per call by name and
        ``.ratios(a, b)`` the per-round ratios.
    """
    if repeats < 1:
        msg = f"repeats must be at least 1, got {repeats}"
        raise ValueError(msg)
    sync = _no_sync if sync is None else sync
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            sync(fns[name]())
    samples: dict[Any, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for i in range(repeats):
        shift = i % len(names) if names else 0
        ordered = names[shift:] + names[:shift]
        if shuffle:
            order.shuffle(ordered)
        for name in ordered:
            if before is not None:
                sync(before())
            samples[name].append(sample_seconds(fns[name], sync, number))
    return Interleaved(samples)


def start_rss_watch(dask_worker: Any) -> None:
    """Poll this process's resident memory every 2 ms in a thread, from now on.

    Run in each Dask worker (``client.run(start_rss_watch)``); the peak growth is
    read back by :func:`stop_rss_watch`. Used by the Dask memory test and
    ``benchmarks/scale.py``.
    """
    import threading

    import psutil  # comes with dask.distributed

    proc = psutil.Process()
    state = {"base": proc.memory_info().rss, "peak": 0, "stop": threading.Event()}

    def poll() -> None:
        while not state["stop"].is_set():
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            state["stop"].wait(0.002)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    dask_worker._portable_attn_rss = (state, thread)


def stop_rss_watch(dask_worker: Any) -> int:
    """Stop the poll of :func:`start_rss_watch`; return the peak RSS growth in bytes."""
    state, thread = dask_worker._portable_attn_rss
    state["stop"].set()
    thread.join()
    return max(0, state["peak"] - state["base"])


def _status_kib(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    msg = f"no {field} in /proc/self/status"
    raise RuntimeError(msg)


def peak_extra_mib(run: Callable[[], Any]) -> float:
    """The peak resident memory (MiB) one call of `run` adds, and keeps it alive while measured.

    The resident set's peak (``VmHWM``) is reset just before the call
    (``/proc/self/clear_refs``), and the resident set then is subtracted: what the call
    allocated and touched at its peak, its result included (Linux).
    """
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from here
        f.write("5")
    result = run()
    peak = _status_kib("VmHWM")
    del result
    return (peak - before) / 1024
