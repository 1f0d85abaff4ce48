"""``portable-attn check``: run the library on every installed backend and compare.

This is the one module of the package that knows each backend by name: it
converts NumPy data to each library, synchronises devices for timing and drives
autograd. The attention itself is always the portable implementation.
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._attention import attention_weights, scaled_dot_product_attention

__all__ = ["CheckResult", "available_targets", "run_checks"]

# Max abs error allowed against the float64 oracle on unit-scale data, per dtype.
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


@dataclass
class Target:
    """One backend on one device, with the few operations the check needs."""

    name: str
    version: str
    device: str
    dtypes: tuple[str, ...]
    to_backend: Callable[[np.ndarray, str], Any]
    to_numpy: Callable[[Any], np.ndarray]
    sync: Callable[[Any], None] = lambda _: None
    grad: Callable[..., tuple[Any, ...]] | None = None


def _version(module: str) -> str:
    return getattr(importlib.import_module(module), "__version__", "?")


def _numpy_targets() -> Iterator[Target]:
    yield Target(
        "numpy",
        np.__version__,
        "cpu",
        ("float64", "float32", "float16"),
        lambda a, dt: a.astype(dt),
        np.asarray,
    )


def _strict_targets() -> Iterator[Target]:
    import array_api_strict as xs

    yield Target(
        "array_api_strict",
        xs.__version__,
        "cpu",
        ("float64", "float32"),
        lambda a, dt: xs.asarray(a.astype(dt)),
        np.from_dlpack,
    )


def _torch_targets() -> Iterator[Target]:
    import torch

    def grad(fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        leaves = [a.detach().requires_grad_(True) for a in args]
        return torch.autograd.grad(fn(*leaves), leaves)

    def to_numpy(x: Any) -> np.ndarray:
        x = x.detach()
        return (x.float() if x.dtype == torch.bfloat16 else x).cpu().numpy()

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        sync = (lambda _: torch.cuda.synchronize()) if dev == "cuda" else (lambda _: None)

        def to_backend(a: np.ndarray, dt: str, dev: str = dev) -> Any:
            t = torch.asarray(a.astype("float32" if dt == "bfloat16" else dt), device=dev)
            return t.to(torch.bfloat16) if dt == "bfloat16" else t

        yield Target(
            f"torch:{dev}",
            torch.__version__,
            dev,
            ("float64", "float32", "float16", "bfloat16"),
            to_backend,
            to_numpy,
            sync,
            grad,
        )


def _jax_targets() -> Iterator[Target]:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)

    def grad(fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        return jax.grad(fn, argnums=tuple(range(len(args))))(*args)

    def to_numpy(x: Any) -> np.ndarray:
        return np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)

    platforms = ["cpu"]
    try:
        jax.devices("gpu")
        platforms.append("gpu")
    except RuntimeError:
        pass
    for platform in platforms:
        dev = jax.devices(platform)[0]

        def to_backend(a: np.ndarray, dt: str, dev: Any = dev) -> Any:
            return jax.device_put(jnp.asarray(a, dtype=getattr(jnp, dt)), dev)

        yield Target(
            f"jax:{platform}",
            jax.__version__,
            platform,
            ("float64", "float32", "float16", "bfloat16"),
            to_backend,
            to_numpy,
            lambda x: x.block_until_ready(),
            grad,
        )


def _cupy_targets() -> Iterator[Target]:
    import cupy

    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return
    except Exception:  # no driver: CUDARuntimeError
        return
    yield Target(
        "cupy",
        cupy.__version__,
        "cuda",
        ("float64", "float32", "float16"),
        lambda a, dt: cupy.asarray(a.astype(dt)),
        lambda x: x.get(),
        lambda _: cupy.cuda.runtime.deviceSynchronize(),
    )


def _dask_targets() -> Iterator[Target]:
    import dask
    import dask.array as da

    def to_backend(a: np.ndarray, dt: str) -> Any:
        return da.from_array(a.astype(dt), chunks=tuple(max(1, n // 2) for n in a.shape))

    yield Target(
        "dask",
        dask.__version__,
        "cpu",
        ("float64", "float32", "float16"),
        to_backend,
        lambda x: np.asarray(x.compute()),
        lambda x: x.compute(),
    )


_FACTORIES = {
    "numpy": _numpy_targets,
    "array_api_strict": _strict_targets,
    "torch": _torch_targets,
    "jax": _jax_targets,
    "cupy": _cupy_targets,
    "dask": _dask_targets,
}
_MODULES = {"dask": "dask.array"}


def available_targets(only: list[str] | None = None) -> tuple[list[Target], list[str]]:
    """Return the installed targets and the names of the backends not installed."""
    targets, missing = [], []
    for name, factory in _FACTORIES.items():
        if only and name not in only:
            continue
        module = _MODULES.get(name, name).split(".")[0]
        if importlib.util.find_spec(module) is None:
            missing.append(name)
            continue
        targets.extend(factory())
    return targets, missing


# ---------------------------------------------------------------------------
# the oracle: float64 NumPy, per head, with the structural mask built by np.tri


def _oracle(q, k, v, *, mask=None, bias=None, is_causal=False, window=None, softcap=None):
    *batch, hq, lq, d = q.shape
    hkv, lk = k.shape[-3], k.shape[-2]
    allowed = np.ones((lq, lk), dtype=bool)
    shift = lk - lq
    if is_causal:
        allowed &= np.tri(lq, lk, shift, dtype=bool)
    if window is not None:
        left, right = window
        if right is not None:
            allowed &= np.tri(lq, lk, shift + right, dtype=bool)
        if left is not None:
            allowed &= ~np.tri(lq, lk, shift - left - 1, dtype=bool)
    out = np.zeros((*batch, hq, lq, v.shape[-1]))
    for idx in np.ndindex(*batch, hq):
        kv_idx = (*idx[:-1], idx[-1] // (hq // hkv))
        s = q[idx] @ k[kv_idx].T / np.sqrt(d)
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        if bias is not None:
            s = s + np.broadcast_to(bias, (*batch, hq, lq, lk))[idx]
        ok = (
            allowed if mask is None else allowed & np.broadcast_to(mask, (*batch, hq, lq, lk))[idx]
        )
        for i in range(lq):
            row = s[i][ok[i]]
            if row.size and np.isfinite(row.max()):
                p = np.exp(row - row.max())
                out[idx][i] = (p / p.sum()) @ v[kv_idx][ok[i]]
    return out


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

    @property
    def ok(self) -> bool:
        return not self.failures


def _check_values(t: Target, res: CheckResult, cases: list[tuple[str, dict[str, Any]]]) -> None:
    for dt in t.dtypes:
        worst = 0.0
        for label, case in cases:
            kw = {n: case[n] for n in ("is_causal", "window", "softcap") if n in case}
            # the oracle sees the values after rounding to the dtype under test
            rounded = {
                n: t.to_numpy(t.to_backend(case[n], dt)).astype(np.float64)
                for n in ("q", "k", "v")
            }
            expected = _oracle(
                rounded["q"],
                rounded["k"],
                rounded["v"],
                mask=case.get("mask"),
                bias=case.get("bias"),
                **kw,
            )
            args = [t.to_backend(rounded[n], dt) for n in ("q", "k", "v")]
            mask = None if "mask" not in case else t.to_backend(case["mask"], "bool")
            bias = None if "bias" not in case else t.to_backend(case["bias"], dt)
            out = t.to_numpy(scaled_dot_product_attention(*args, mask=mask, bias=bias, **kw))
            weights = t.to_numpy(attention_weights(*args[:2], mask=mask, bias=bias, **kw))
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
    if t.grad is None:
        return
    shapes = [(1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 3)]
    data = [rng.standard_normal(s) for s in shapes]
    mask = np.ones((3, 5), dtype=bool)
    mask[0] = False
    cot = rng.standard_normal((1, 2, 3, 3))

    def loss_np(*arrays: np.ndarray) -> float:
        return float(np.sum(_oracle(*arrays, mask=mask, is_causal=True) * cot))

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = scaled_dot_product_attention(
            q, k, v, mask=t.to_backend(mask, "bool"), is_causal=True
        )
        return (out * t.to_backend(cot, "float64")).sum()

    grads = t.grad(loss, *(t.to_backend(a, "float64") for a in data))
    eps, worst = 1e-6, 0.0
    for i, (a, g) in enumerate(zip(data, grads, strict=True)):
        g = t.to_numpy(g)
        for idx in np.ndindex(a.shape):
            hi, lo = [x.copy() for x in data], [x.copy() for x in data]
            hi[i][idx] += eps
            lo[i][idx] -= eps
            numeric = (loss_np(*hi) - loss_np(*lo)) / (2 * eps)
            worst = max(worst, abs(numeric - g[idx]))
    ok = worst < 1e-6
    res.gradients = f"ok ({worst:.0e})" if ok else f"FAIL ({worst:.1e})"
    if not ok:
        res.failures.append(f"gradients differ from central differences by {worst:.2e}")


def _time_call(t: Target, res: CheckResult, rng: np.random.Generator, repeats: int) -> None:
    q, k, v = (t.to_backend(rng.standard_normal((1, 8, 256, 64)), "float32") for _ in range(3))
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        t.sync(scaled_dot_product_attention(q, k, v, is_causal=True))
        times.append(time.perf_counter() - start)
    res.time_ms = statistics.median(times[2:]) * 1e3


def run_checks(
    only: list[str] | None = None, *, repeats: int = 10
) -> tuple[list[CheckResult], list[str]]:
    """Check every installed backend; return the results and the missing backends."""
    targets, missing = available_targets(only)
    results = []
    for t in targets:
        rng = np.random.default_rng(0)
        res = CheckResult(t.name, t.version, t.device)
        try:
            _check_values(t, res, _cases(rng))
            _check_gradients(t, res, rng)
            _time_call(t, res, rng, repeats)
        except Exception as exc:  # report the backend as broken, keep checking the others
            res.failures.append(f"raised {type(exc).__name__}: {exc}")
        results.append(res)
    return results, missing
