"""``portable-attn check``: run the library on every installed backend and compare.

Each backend that can run here (from :mod:`portable_attn.testing`, the one
table of array libraries) computes a fixed set of cases in every dtype it
supports; the results are compared with the float64 oracle of
:mod:`portable_attn.testing`, gradients with its central differences, and a
float32 call is timed with :mod:`portable_attn._timing`. The attention itself is
always the portable implementation.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from ._attention import attention_weights, scaled_dot_product_attention
from ._timing import median_seconds
from .testing._backends import (
    _GPU_KINDS,
    FAMILIES,
    MODULES,
    Backend,
    family_installed,
    family_of,
    make_backend,
    unavailable_reason,
)
from .testing._backends import TEST_ONLY_KINDS as _TEST_ONLY_KINDS
from .testing._reference import central_differences, reference_attention

__all__ = [
    "EXTRAS",
    "CheckResult",
    "Target",
    "Unavailable",
    "available_targets",
    "extra_hint",
    "has_nvidia_gpu",
    "install_hint",
    "installed_from",
    "run_checks",
    "survey",
]

#: timed calls of the float32 call of each backend: its ms/call is their median
TIMED_CALLS = 5
#: untimed calls first (library loading, JIT compilation, caches)
WARMUP_CALLS = 2
#: what the timed call is, as the output names it
TIMED_CASE = "float32 causal attention, B=1 H=8 L=256 D=64"

# Max abs error allowed against the float64 oracle on unit-scale data, per dtype.
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}

# The extra of pyproject.toml that installs each family (NumPy is a dependency).
EXTRAS = {
    "numpy": None,
    "array_api_strict": "strict",
    "torch": "torch",
    "jax": "jax",
    "cupy": "cupy",
    "dask": "dask",
}


#: PyTorch's index of CPU-only builds (no CUDA libraries), as the README installs it
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: pip's flags that make an unreachable index fail in seconds, not after minutes of retries
FAIL_FAST = "--timeout 10 --retries 1"
#: families that run only on an NVIDIA GPU: no install hint on a machine without one
NEEDS_NVIDIA_GPU = frozenset({"cupy"})


def has_nvidia_gpu() -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU (False where it is missing or fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        probe = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0 and "GPU" in probe.stdout


def installed_from() -> tuple[str | None, bool]:
    """Where this package was installed from: (the folder of a local clone, editable).

    Read from the distribution's ``direct_url.json`` (PEP 610), which pip writes for
    ``pip install .`` and ``pip install -e .``. ``(None, False)`` for an install from an
    index or a wheel; the folder is None too when the package runs from a source tree
    without being installed (``PYTHONPATH=src``), where the caller assumes a clone.
    """
    try:
        dist = importlib.metadata.distribution("portable-attn")
    except importlib.metadata.PackageNotFoundError:
        return None, False
    text = dist.read_text("direct_url.json")
    if not text:
        return None, False
    try:
        info = json.loads(text)
    except ValueError:
        return None, False
    url = urlparse(str(info.get("url", "")))
    if url.scheme != "file" or "dir_info" not in info:
        return None, False
    return unquote(url.path), bool(info["dir_info"].get("editable"))


def _requirement(extra: str | None) -> str:
    """Return the pip argument that installs this package with `extra` as it was installed.

    From a clone: ``".[torch]"`` in the clone's folder (``-e ".[torch]"`` when the
    install was editable), the clone's path from anywhere else; from an index or a
    wheel: ``"portable-attn[torch]"``. The package is not on an index, so a source tree
    that was never installed gets the clone form.
    """
    try:
        dist: importlib.metadata.Distribution | None = importlib.metadata.distribution(
            "portable-attn"
        )
    except importlib.metadata.PackageNotFoundError:
        dist = None  # run from a source tree (PYTHONPATH=src): a clone
    suffix = f"[{extra}]" if extra else ""
    if dist is not None and dist.read_text("direct_url.json") is None:
        return f'"portable-attn{suffix}"'  # from an index or a wheel
    folder, editable = installed_from()
    where = "." if folder is None or _same_folder(folder, os.getcwd()) else folder
    return ("-e " if editable else "") + f'"{where}{suffix}"'


def _same_folder(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


#: the extras of pyproject.toml that install torch
TORCH_EXTRAS = frozenset({"torch", "transformers"})


def extra_hint(extra: str | None, *, gpu: bool | None = None) -> str:
    """Return the command that installs this package's `extra`, e.g. ``pip install ".[jax]"``.

    Parameters
    ----------
    extra : str or None
        An extra of pyproject.toml (None: the package alone).
    gpu : bool, optional
        Whether the machine has an NVIDIA GPU (default: ask :func:`has_nvidia_gpu`).
        Without one, an extra that installs torch is preceded by torch from PyTorch's
        CPU index (pip's default torch on Linux is the CUDA build, GBs of libraries),
        failing fast where that index cannot be reached.
    """
    command = f"pip install {_requirement(extra)}"
    if extra in TORCH_EXTRAS and not (has_nvidia_gpu() if gpu is None else gpu):
        return f"pip install {FAIL_FAST} torch --index-url {TORCH_CPU_INDEX}, then {command}"
    return command


def install_hint(family: str, *, gpu: bool | None = None) -> str:
    """Return how to install `family`, e.g. ``'pip install ".[dask]"'`` in a clone.

    Parameters
    ----------
    family : str
        A backend family, a key of :data:`EXTRAS`.
    gpu : bool, optional
        Whether the machine has an NVIDIA GPU (default: ask :func:`has_nvidia_gpu`).
        Without one, torch comes from PyTorch's CPU index first (:func:`extra_hint`),
        and CuPy says that it needs a GPU.

    Returns
    -------
    str
        The command (two for torch without a GPU), or why none applies.
    """
    if gpu is None:
        gpu = has_nvidia_gpu()
    extra = EXTRAS.get(family)
    if family in NEEDS_NVIDIA_GPU and not gpu:
        command = f"pip install {_requirement(extra)}"
        return f"it needs an NVIDIA GPU, and nvidia-smi found none; with one: {command}"
    return extra_hint(extra, gpu=gpu)


@dataclass(frozen=True)
class Target:
    """One backend as ``check`` (and ``explain``) names and drives it.

    A thin view of a :class:`~portable_attn.testing.Backend`: the conversions,
    the synchronisation and the gradients are the backend table's.

    Parameters
    ----------
    backend : Backend
        The backend.
    """

    backend: Backend

    @property
    def name(self) -> str:
        """The reported name: torch and JAX name their device (``"torch:cpu"``)."""
        b = self.backend
        return f"{b.family}:{b.device_name}" if b.family in ("torch", "jax") else b.kind

    @property
    def version(self) -> str:
        """The library's version."""
        return self.backend.version

    @property
    def device(self) -> str:
        """``"cpu"``, ``"cuda"`` or ``"gpu"``."""
        return self.backend.device_name

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The floating dtypes checked, widest first."""
        return self.backend.dtypes

    @property
    def has_autodiff(self) -> bool:
        """Whether :meth:`grad` works."""
        return self.backend.has_autodiff

    def to_backend(self, a: Any, dtype: str) -> Any:
        """Return NumPy data `a` as an array of the backend in `dtype` (a name)."""
        return self.backend.asarray(a, dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        """Bring an array of the backend back to NumPy (bfloat16 as float32)."""
        return self.backend.to_numpy(x)

    def sync(self, x: Any) -> None:
        """Wait until `x` is computed."""
        self.backend.sync(x)

    def grad(self, fn: Any, *args: Any) -> tuple[Any, ...]:
        """Return the gradients of the scalar ``fn(*args)`` (torch and JAX only)."""
        return self.backend.grad(fn, *args)


@dataclass(frozen=True)
class Unavailable:
    """A kind of an installed family that cannot run here, and why.

    Parameters
    ----------
    kind : str
        The backend kind, e.g. ``"cupy"``.
    reason : str
        Why, e.g. ``"cupy: no usable CUDA device (CUDARuntimeError: ...)"``.
    """

    kind: str
    reason: str


def _installed_version(family: str) -> str:
    try:
        module = importlib.import_module(MODULES[family].split(".")[0])
    except Exception:  # installed but broken: the reason says so
        return "?"
    return str(getattr(module, "__version__", "?"))


def survey(
    only: list[str] | None = None,
) -> tuple[list[Target], list[Unavailable], list[str]]:
    """Sort the backends into those that run here, those that cannot and those not installed.

    Parameters
    ----------
    only : list of str, optional
        Families to consider (default: all of them); each a key of
        :data:`~portable_attn.testing.FAMILIES`.

    Returns
    -------
    targets : list of Target
        Every kind of the installed families that can run (GPU kinds only with
        their device), in the order of :data:`~portable_attn.testing.FAMILIES`.
    unavailable : list of Unavailable
        The kinds of an installed family of which *no* kind can run (CuPy
        without a usable GPU), with the reason; a family with a running kind
        (torch on the CPU of a machine without CUDA) does not list its GPU kind.
    missing : list of str
        The families asked for (or all) that are not installed.
    """
    unknown = [f for f in only or () if f not in FAMILIES]
    if unknown:
        msg = f"unknown backend {', '.join(map(repr, unknown))}; choose from {', '.join(FAMILIES)}"
        raise ValueError(msg)
    targets: list[Target] = []
    unavailable: list[Unavailable] = []
    missing: list[str] = []
    for family, kinds in FAMILIES.items():
        if only and family not in only:
            continue
        if not family_installed(family):
            missing.append(family)
            continue
        runs, cannot = [], []
        for kind in kinds:
            if kind in _TEST_ONLY_KINDS:
                continue
            try:
                reason = unavailable_reason(kind)
                if reason is None:
                    runs.append(Target(make_backend(kind)))
                    continue
            except Exception as exc:  # a broken installation: say so, check the others
                reason = f"{kind}: {type(exc).__name__}: {exc}"
            cannot.append(Unavailable(kind, reason))
        targets += runs
        if not runs:
            unavailable += cannot
    return targets, unavailable, missing


def available_targets(only: list[str] | None = None) -> tuple[list[Target], list[str]]:
    """Return the backends that can run here and the families not installed.

    Parameters
    ----------
    only : list of str, optional
        Families to consider (default: all of them).

    Returns
    -------
    targets : list of Target
        Every kind of the installed families that can run, as :func:`survey`.
    missing : list of str
        The families asked for (or all) that are not installed.
    """
    targets, _, missing = survey(only)
    return targets, missing


def _cases(rng: np.random.Generator) -> list[tuple[str, dict[str, Any]]]:
    def qkv(hq: int, hkv: int, lq: int, lk: int) -> dict[str, Any]:
        return {
            "q": rng.standard_normal((2, hq, lq, 16)),
            "k": rng.standard_normal((2, hkv, lk, 16)),
            "v": rng.standard_normal((2, hkv, lk, 16)),
        }

    masked = np.ones((9, 12), dtype=bool)
    masked[3] = False  # a fully masked row
    return [
        ("plain", qkv(2, 2, 12, 12)),
        (
            "mask+bias",
            {
                **qkv(2, 2, 9, 12),
                "mask": rng.random((9, 12)) < 0.6,
                "bias": rng.standard_normal((2, 1, 9, 12)),
            },
        ),
        ("causal Lq<Lk", {**qkv(2, 2, 5, 12), "is_causal": True}),
        ("causal Lq>Lk", {**qkv(2, 2, 12, 5), "is_causal": True}),
        ("GQA+window+softcap", {**qkv(4, 1, 12, 12), "window": (3, 1), "softcap": 2.0}),
        ("fully masked row", {**qkv(2, 2, 9, 12), "mask": masked}),
    ]


@dataclass
class CheckResult:
    """What `portable-attn check` found for one target."""

    target: str
    version: str
    device: str
    errors: dict[str, float] = field(default_factory=dict)
    gradients: str = "n/a"
    time_ms: float = float("nan")
    failures: list[str] = field(default_factory=list)
    unavailable: str | None = None
    """Why the backend could not run here (then nothing was checked); None when it ran."""

    @property
    def ok(self) -> bool:
        """Whether nothing failed (a backend that could not run has not failed)."""
        return not self.failures


def _check_values(t: Target, res: CheckResult, cases: list[tuple[str, dict[str, Any]]]) -> None:
    b = t.backend
    for dt in b.dtypes:
        worst = 0.0
        for label, case in cases:
            kw = {n: case[n] for n in ("is_causal", "window", "softcap") if n in case}
            # the oracle sees the values after rounding to the dtype under test
            rounded = {
                n: b.to_numpy(b.asarray(case[n], dt)).astype(np.float64) for n in ("q", "k", "v")
            }
            expected = reference_attention(
                rounded["q"],
                rounded["k"],
                rounded["v"],
                mask=case.get("mask"),
                bias=case.get("bias"),
                **kw,
            )
            args = [b.asarray(rounded[n], dt) for n in ("q", "k", "v")]
            mask = None if "mask" not in case else b.asarray(case["mask"], "bool")
            bias = None if "bias" not in case else b.asarray(case["bias"], dt)
            out = b.to_numpy(scaled_dot_product_attention(*args, mask=mask, bias=bias, **kw))
            weights = b.to_numpy(attention_weights(*args[:2], mask=mask, bias=bias, **kw))
            row_sums = weights.sum(-1)
            if not np.all(np.isfinite(out)) or not np.all(np.isfinite(weights)):
                res.failures.append(f"{dt} {label}: non-finite values")
            elif not np.all((np.abs(row_sums - 1) < 0.02) | (row_sums == 0)):
                res.failures.append(f"{dt} {label}: weight rows do not sum to 1 or 0")
            err = float(np.max(np.abs(out.astype(np.float64) - expected)))
            worst = max(worst, err)
            if not err <= TOLERANCE[dt]:
                res.failures.append(f"{dt} {label}: max abs error {err:.2e} > {TOLERANCE[dt]}")
        res.errors[dt] = worst


def _check_gradients(t: Target, res: CheckResult, rng: np.random.Generator) -> None:
    b = t.backend
    if not b.has_autodiff:
        return
    shapes = [(1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 3)]
    data = [rng.standard_normal(s) for s in shapes]
    mask = np.ones((3, 5), dtype=bool)
    mask[0] = False
    cot = rng.standard_normal((1, 2, 3, 3))

    def loss_np(*arrays: np.ndarray) -> float:
        return float(np.sum(reference_attention(*arrays, mask=mask, is_causal=True) * cot))

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = scaled_dot_product_attention(q, k, v, mask=b.asarray(mask, "bool"), is_causal=True)
        return (out * b.asarray(cot, "float64")).sum()

    grads = b.grad(loss, *(b.asarray(a, "float64") for a in data))
    numeric = central_differences(loss_np, data, eps=1e-6)
    worst = max(
        float(np.max(np.abs(n - b.to_numpy(g)))) for n, g in zip(numeric, grads, strict=True)
    )
    ok = worst < 1e-6
    res.gradients = f"ok ({worst:.0e})" if ok else f"FAIL ({worst:.1e})"
    if not ok:
        res.failures.append(f"gradients differ from central differences by {worst:.2e}")


def _time_call(t: Target, res: CheckResult, rng: np.random.Generator, repeats: int) -> None:
    b = t.backend
    q, k, v = (b.asarray(rng.standard_normal((1, 8, 256, 64)), "float32") for _ in range(3))
    seconds = median_seconds(
        lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
        repeats=repeats,
        warmup=WARMUP_CALLS,
        sync=b.sync,
    )
    res.time_ms = seconds * 1e3


def run_checks(
    only: list[str] | None = None,
    *,
    repeats: int = TIMED_CALLS,
    on_start: Callable[[list[CheckResult]], None] | None = None,
    on_target: Callable[[int, int, str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> tuple[list[CheckResult], list[str]]:
    """Check every backend that can run here.

    Parameters
    ----------
    only : list of str, optional
        Families to check (default: all installed).
    repeats : int, default :data:`TIMED_CALLS`
        Timed calls per backend, after :data:`WARMUP_CALLS` warm-up calls; at
        least 1. The time reported is their median.
    on_start : callable, optional
        Called once, before anything is checked, with one :class:`CheckResult`
        per row to come (nothing measured yet: names, versions and devices), so
        that a caller can lay out a table.
    on_target : callable, optional
        Called as ``on_target(i, n, name)`` before the i-th (from 1) of the n
        backends that run is checked.
    on_result : callable, optional
        Called with each result as soon as it is complete, in the order returned.

    Returns
    -------
    results : list of CheckResult
        One per backend checked; a backend that raises is reported as failed.
        Then one per kind that cannot run here (see :func:`survey`), with
        :attr:`CheckResult.unavailable` set and no failure.
    missing : list of str
        The families not installed.

    Raises
    ------
    ValueError
        For an unknown family or `repeats` < 1.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        msg = f"`repeats` must be an integer >= 1, got {repeats!r}"
        raise ValueError(msg)
    targets, unavailable, missing = survey(only)
    not_run = [
        CheckResult(
            u.kind,
            _installed_version(family_of(u.kind)),
            _GPU_KINDS.get(u.kind, "cpu"),
            unavailable=u.reason,
        )
        for u in unavailable
    ]
    if on_start is not None:
        on_start([CheckResult(t.name, t.version, t.device) for t in targets] + not_run)
    results = []
    for i, t in enumerate(targets, 1):
        if on_target is not None:
            on_target(i, len(targets), t.name)
        rng = np.random.default_rng(0)
        res = CheckResult(t.name, t.version, t.device)
        try:
            _check_values(t, res, _cases(rng))
            _check_gradients(t, res, rng)
            _time_call(t, res, rng, repeats)
        except Exception as exc:  # report the backend as broken, keep checking the others
            res.failures.append(f"raised {type(exc).__name__}: {exc}")
        results.append(res)
        if on_result is not None:
            on_result(res)
    for res in not_run:
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results, missing
