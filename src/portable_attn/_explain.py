"""``portable-attn explain``: the numbers behind the 1/√d_k factor, computed by the library."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._attention import attention_weights
from ._check import install_hint, survey
from .diagnostics import attention_entropy, logit_stats, softmax_sensitivity
from .testing._backends import FAMILIES

__all__ = ["entropy_curves", "explain_table", "plot_entropy", "require_matplotlib"]

SCALINGS = {
    "none": lambda d: 1.0,
    "1/sqrt(d_k)": lambda d: 1.0 / math.sqrt(d),
    "1/d_k": lambda d: 1.0 / d,
}


def _target(backend: str) -> Any:
    """Return the first kind of `backend` that runs here; exit naming why there is none."""
    if backend not in FAMILIES:
        msg = f"unknown backend {backend!r}; choose from {', '.join(FAMILIES)}"
        raise SystemExit(msg)
    targets, unavailable, missing = survey([backend])
    if targets:
        return targets[0]
    if missing:
        msg = f"backend {backend!r} is not installed: {install_hint(backend)}"
    else:
        msg = f"backend {backend!r} cannot run here: {'; '.join(u.reason for u in unavailable)}"
    raise SystemExit(msg)


def _check_d_k(d_k: int) -> None:
    if isinstance(d_k, bool) or not isinstance(d_k, int) or d_k < 1:
        msg = f"`d_k` must be an integer >= 1, got {d_k!r}"
        raise ValueError(msg)


def _unit_qk(t: Any, d_k: int, n: int = 256, seed: int = 0) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    return (t.to_backend(rng.standard_normal((1, 1, n, d_k)), "float64"),
            t.to_backend(rng.standard_normal((1, 1, n, d_k)), "float64"))  # fmt: skip


def _mean_entropy(t: Any, q: Any, k: Any, scale: float) -> float:
    w = attention_weights(q, k, scale=scale)
    return float(t.to_numpy(attention_entropy(w, normalized=True)).mean())


def explain_table(d_k: int = 64, backend: str = "numpy") -> str:
    """Return the table of ``portable-attn explain``, computed on `backend`."""
    _check_d_k(d_k)
    t = _target(backend)
    q, k = _unit_qk(t, d_k)
    lines = [f"Why divide by sqrt(d_k)? d_k = {d_k}, backend {t.name}, unit-variance q and k", ""]
    raw = float(t.to_numpy(logit_stats(q, k, scale=1.0).std)[0])
    scaled = float(t.to_numpy(logit_stats(q, k).std)[0])
    by_d = float(t.to_numpy(logit_stats(q, k, scale=1.0 / d_k).std)[0])
    lines += [
        "logit standard deviation",
        f"  q.k unscaled          {raw:8.3f}   (theory sqrt(d_k) = {math.sqrt(d_k):.3f})",
        f"  q.k / sqrt(d_k)       {scaled:8.3f}   (theory 1)",
        f"  q.k / d_k             {by_d:8.3f}   (theory 1/sqrt(d_k) = {1 / math.sqrt(d_k):.3f})",
        "",
        "softmax of three scores (one query, keys with logits s)",
    ]
    one = t.to_backend(np.ones((1, 1)), "float64")
    for scores in ([8.0, 0.0, -8.0], [1.0, 0.0, -1.0]):
        keys = t.to_backend(np.asarray(scores)[:, None], "float64")
        w = t.to_numpy(attention_weights(one, keys, scale=1.0))[0]
        lines.append(f"  s = {scores!s:18} -> weights [{', '.join(f'{x:.7f}' for x in w)}]")
    p = t.to_backend(np.array([[0.9997, 0.0003]]), "float64")
    sens = float(t.to_numpy(softmax_sensitivity(p))[0])
    lines += [
        "",
        f"softmax sensitivity p(1-p) at p = 0.9997: {sens:.6f}   (0.25 at p = 0.5)",
        "",
        "mean normalised attention entropy (1 = uniform, 0 = one-hot), 256 keys",
    ]
    for name, f in SCALINGS.items():
        lines.append(f"  scale {name:12} {_mean_entropy(t, q, k, f(d_k)):.4f}")
    return "\n".join(lines)


def entropy_curves(
    backend: str = "numpy", dims: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
) -> dict[str, list[float]]:
    """Mean normalised entropy against d_k for the three scalings."""
    for d in dims:
        _check_d_k(d)
    t = _target(backend)
    curves: dict[str, list[float]] = {name: [] for name in SCALINGS}
    for d in dims:
        q, k = _unit_qk(t, d, n=128)
        for name, f in SCALINGS.items():
            curves[name].append(_mean_entropy(t, q, k, f(d)))
    return curves


def require_matplotlib() -> Any:
    """Return ``matplotlib.pyplot`` (Agg backend); exit saying how to install it if missing.

    ``explain --plot`` calls it before computing anything.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = "--plot needs matplotlib: pip install matplotlib (or portable-attn[docs])"
        raise SystemExit(msg) from None
    return plt


def plot_entropy(path: str, backend: str = "numpy") -> None:
    """Write the entropy-vs-d_k plot to `path` (needs matplotlib)."""
    plt = require_matplotlib()
    dims = (16, 32, 64, 128, 256, 512, 1024)
    curves = entropy_curves(backend, dims)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in curves.items():
        ax.plot(dims, ys, marker="o", label=f"scale = {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d_k")
    ax.set_ylabel("mean normalised entropy")
    ax.set_title("Attention entropy of unit-variance q, k")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
