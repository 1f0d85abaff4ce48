"""Diagnostics for the scale of attention logits: entropy, saturation, sensitivity.

These functions measure what the ``1/√d_k`` factor is there to control. For
unit-variance, independent query and key coordinates the dot product ``q·k`` has
variance ``d_k``; scaled by ``1/√d_k`` its standard deviation is about 1. A
missing scale leaves a spread of ``√d_k`` (8 at ``d_k = 64``), which pushes the
softmax towards one-hot rows whose gradients ``p(1 - p)`` vanish; scaling twice
(or by ``1/d_k``) shrinks it to ``1/√d_k`` (0.125 at ``d_k = 64``) and flattens
the weights towards uniform. :func:`scale_report` turns the measured figures into
findings. Everything returns arrays of the inputs' namespace and works under
``jax.jit`` except :func:`scale_report`, which reads its figures on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._attention import attention_weights
from ._lib import _validation as v
from ._lib._call import ATTENTION_KEYWORDS, prepare
from ._lib._compat import array_namespace, result_type
from ._lib._rules import lower_arguments
from ._lib._scores import allowed_block, logits_block, scaled_query_rows, scores_block
from .testing._backends import to_numpy as _to_host

__all__ = [
    "Finding",
    "LogitStats",
    "ScaleReport",
    "attention_entropy",
    "logit_stats",
    "saturation",
    "scale_report",
    "softmax_sensitivity",
]

#: Thresholds of :func:`scale_report`, documented and used as named here.
SATURATED_WEIGHT = 0.99  # a row is saturated when its largest weight exceeds this
SATURATED_FRACTION = 0.5  # "saturated" when more than this fraction of rows are
DIFFUSE_ENTROPY = 0.95  # "diffuse" when the mean normalised entropy exceeds this
MISSING_RATIO = 0.5  # "scale_missing" when spread / expected > this · √d_k ...
MISSING_MIN_STD = 2.0  # ... and the logit std exceeds this
TOO_SMALL_RATIO = 0.35  # "scale_too_small" when spread / expected < this, weights diffuse


def _heads_last(xp: Any, x: Any, keep: int) -> Any:
    """Sum `x` (..., H, *rest) over everything but the head axis at -`keep`."""
    axes = tuple(i for i in range(x.ndim) if i != x.ndim - keep)
    return xp.sum(x, axis=axes)


def attention_entropy(weights: Any, *, normalized: bool = False) -> Any:
    """Entropy of each row of attention weights, in nats.

    Parameters
    ----------
    weights : array, shape (..., Lq, Lk)
        Rows that sum to 1 or are all zero; zero entries (masked keys) are ignored.
    normalized : bool, default False
        Divide by ``log(number of visible keys)``: 1 for uniform weights, 0 for
        one-hot rows (and for rows with one visible key).

    Returns
    -------
    array, shape (..., Lq)
        Fully masked (all-zero) rows give 0, never NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn.diagnostics import attention_entropy
    >>> attention_entropy(np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])).round(4)
    array([0.6931, 0.    ])
    """
    xp = array_namespace(weights=weights)
    w = xp.astype(weights, result_type(xp, weights.dtype, xp.float32), copy=False)
    positive = w > 0
    safe = xp.where(positive, w, 1.0)
    entropy = 0.0 - xp.sum(xp.where(positive, w * xp.log(safe), 0.0), axis=-1)  # no -0.0
    if not normalized:
        return entropy
    visible = xp.sum(xp.astype(positive, w.dtype), axis=-1)
    log_n = xp.log(xp.where(visible > 1, visible, 2.0))
    return xp.where(visible > 1, entropy / log_n, 0.0)


def saturation(weights: Any, *, threshold: float = SATURATED_WEIGHT) -> Any:
    """Per head, the fraction of rows whose largest weight exceeds `threshold`.

    Parameters
    ----------
    weights : array, shape (..., H, Lq, Lk)
        Attention weights; all-zero (fully masked) rows are not counted.
    threshold : float, default 0.99
        A row above it is "nearly one-hot".

    Returns
    -------
    array, shape (H,)
        Fractions in [0, 1], reduced over the batch and the query rows.
    """
    xp = array_namespace(weights=weights)
    top = xp.max(weights, axis=-1)  # (..., H, Lq)
    dt = result_type(xp, weights.dtype, xp.float32)
    live = xp.astype(top > 0, dt)
    hot = xp.astype(top > threshold, dt)
    rows = _heads_last(xp, live, 2)
    return _heads_last(xp, hot, 2) / xp.where(rows > 0, rows, 1.0)


def softmax_sensitivity(weights: Any) -> Any:
    """Per row, the largest diagonal softmax Jacobian term ``max_j p_j (1 - p_j)``.

    It bounds how much a change of one logit can move its own weight: 0.25 at
    ``p = 0.5``, about 0.0003 at ``p = 0.9997`` (a saturated row passes almost
    no learning signal).

    Parameters
    ----------
    weights : array, shape (..., Lq, Lk)

    Returns
    -------
    array, shape (..., Lq)
    """
    xp = array_namespace(weights=weights)
    return xp.max(weights * (1.0 - weights), axis=-1)


@dataclass(frozen=True)
class LogitStats:
    """Per-head statistics of the pre-softmax logits over visible positions (arrays (H,))."""

    mean: Any
    std: Any
    max_abs: Any


def _logits_and_allowed(
    caller: str, query: Any, key: Any, kwargs: dict[str, Any]
) -> tuple[Any, Any, Any, Any]:
    """Compute the logits exactly as the attention does, and the allowed mask."""
    v.check_keywords(caller, kwargs, ATTENTION_KEYWORDS)
    kwargs = lower_arguments(kwargs, query, key)  # a ready rule
    call = prepare(query, key, None, **kwargs).in_compute_dtype()
    xp, plan = call.xp, call.plan
    whole_q, whole_k = (0, plan.q_len), (0, plan.kv_len)
    capped = logits_block(xp, scaled_query_rows(xp, call.query, plan), call.key, plan)
    logits = scores_block(xp, capped, call.bias, call.terms, plan, whole_q, whole_k)
    allowed = allowed_block(xp, call.terms, plan, whole_q, whole_k)  # (..., Hq, Lq, Lk)
    if allowed is None:
        allowed = xp.ones_like(logits, dtype=xp.bool)  # on the device of `logits`
    allowed = xp.broadcast_to(allowed, logits.shape)
    return xp, logits, allowed, plan


def logit_stats(query: Any, key: Any, **kwargs: Any) -> LogitStats:
    """Mean, standard deviation and max ``|logit|`` per head, as the attention computes them.

    Parameters
    ----------
    query : array, shape (..., Hq, Lq, Dk)
    key : array, shape (..., Hkv, Lk, Dk)
    **kwargs
        ``scale``, ``mask``, ``bias``, ``is_causal``, ``window``, ``softcap``,
        ``q_lengths``, ``kv_lengths``, ``alibi_slopes``, ``score_mod`` as in
        :func:`scaled_dot_product_attention`; masked positions are left out.

    Returns
    -------
    LogitStats
        Arrays of shape (Hq,).
    """
    xp, logits, allowed, _ = _logits_and_allowed("logit_stats", query, key, kwargs)
    f = xp.astype(allowed, logits.dtype)
    count = _heads_last(xp, f, 3)
    count = xp.where(count > 0, count, 1.0)
    vals = xp.where(allowed, logits, 0.0)
    mean = _heads_last(xp, vals, 3) / count
    by_head = xp.reshape(mean, (*(1,) * (logits.ndim - 3), -1, 1, 1))  # (1..., H, 1, 1)
    centred = xp.where(allowed, logits - by_head, 0.0)
    std = xp.sqrt(_heads_last(xp, centred * centred, 3) / count)
    max_abs = xp.max(xp.abs(vals), axis=tuple(i for i in range(vals.ndim) if i != vals.ndim - 3))
    return LogitStats(mean, std, max_abs)


@dataclass(frozen=True)
class Finding:
    """One observation of :func:`scale_report`: a stable `code` and a plain-language `message`."""

    code: str
    message: str
    heads: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScaleReport:
    """Figures per head (NumPy arrays of shape (Hq,)) and the findings drawn from them."""

    d_k: int
    scale: float
    logit_mean: Any
    logit_std: Any
    logit_max_abs: Any
    expected_std: Any
    entropy: Any
    saturation: Any
    sensitivity: Any
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def codes(self) -> tuple[str, ...]:
        """The codes of the findings, in order."""
        return tuple(f.code for f in self.findings)

    def __str__(self) -> str:
        lines = [f"scale report: d_k={self.d_k}, scale={self.scale:.4g}"]
        lines.append("head  logit std  expected  max|logit|  norm. entropy  saturated  p(1-p)")
        for h in range(len(self.logit_std)):
            lines.append(
                f"{h:>4}  {self.logit_std[h]:9.3f}  {self.expected_std[h]:8.3f}  "
                f"{self.logit_max_abs[h]:10.3f}  {self.entropy[h]:13.3f}  "
                f"{self.saturation[h]:9.2f}  {self.sensitivity[h]:6.4f}"
            )
        lines += [f"[{f.code}] {f.message}" for f in self.findings] or ["no findings"]
        return "\n".join(lines)


def scale_report(query: Any, key: Any, **kwargs: Any) -> ScaleReport:
    """Measure the logits and weights of an attention call and flag scaling problems.

    Per head it measures the logit spread ``s``, the spread that ``1/√d_k``
    scaling would give for these inputs, ``u = rms(q) · rms(k)`` (what the
    variance argument predicts for independent coordinates), the mean normalised
    entropy of the weights, the fraction of saturated rows and the mean softmax
    sensitivity ``max p(1 - p)``. Findings (thresholds are the module constants):

    - ``"scale_missing"``: ``s / u > 0.5 · √d_k`` and ``s > 2`` — the spread grows
      like ``√d_k``, as it does when the scale is missing.
    - ``"scale_too_small"``: ``s / u < 0.35`` with mean normalised entropy above
      0.95 — far below the ``1/√d_k`` expectation with near-uniform weights
      (scaled twice, or divided by ``d_k``).
    - ``"saturated"``: more than half the rows have a weight above 0.99.
    - ``"diffuse"``: mean normalised entropy above 0.95 (near-uniform weights).

    Parameters
    ----------
    query : array, shape (..., Hq, Lq, Dk)
    key : array, shape (..., Hkv, Lk, Dk)
    **kwargs
        ``scale`` (the one your model uses; default ``1/√d_k``) and the other
        arguments of :func:`logit_stats`.

    Returns
    -------
    ScaleReport
        Host-side (NumPy) figures and ``findings``; not traceable by ``jax.jit``.
    """
    import numpy as np

    xp, _, _, plan = _logits_and_allowed("scale_report", query, key, kwargs)
    stats = logit_stats(query, key, **kwargs)
    weights = attention_weights(query, key, **kwargs)
    if weights.ndim == 2:
        weights = weights[None, ...]
    q = xp.astype(query, plan.compute_dtype)
    k = xp.astype(key, plan.compute_dtype)
    rms_q = _to_host(xp.sqrt(xp.mean(q * q)))
    rms_k = _to_host(xp.sqrt(xp.mean(k * k)))
    d_k = int(query.shape[-1])
    hq = plan.num_q_heads
    entropy = _to_host(attention_entropy(weights, normalized=True))
    entropy = entropy.reshape(-1, hq, entropy.shape[-1]).mean(axis=(0, 2))
    sensitivity = _to_host(softmax_sensitivity(weights))
    sensitivity = sensitivity.reshape(-1, hq, sensitivity.shape[-1]).mean(axis=(0, 2))
    sat = _to_host(saturation(weights))
    std = _to_host(stats.std)
    expected = np.full(hq, float(rms_q * rms_k))
    ratio = std / np.where(expected > 0, expected, 1.0)
    findings: list[Finding] = []

    def heads(cond: Any) -> tuple[int, ...]:
        return tuple(int(h) for h in np.flatnonzero(cond))

    root, exp0 = math.sqrt(d_k), float(expected[0])

    def add(code: str, hs: tuple[int, ...], message: str) -> None:
        if hs:
            findings.append(Finding(code, message, hs))

    hs = heads((ratio > MISSING_RATIO * root) & (std > MISSING_MIN_STD))
    add(
        "scale_missing",
        hs,
        (
            f"logit std {std[list(hs)].mean() if hs else 0:.2f} is about √d_k = {root:.1f} times "
            f"what 1/√d_k scaling gives for these inputs ({exp0:.2f}): the scores look unscaled; "
            "divide q·k by √d_k."
        ),
    )
    hs = heads((ratio < TOO_SMALL_RATIO) & (entropy > DIFFUSE_ENTROPY))
    add(
        "scale_too_small",
        hs,
        (
            f"logit std {std[list(hs)].mean() if hs else 0:.3f} is far below the {exp0:.2f} that "
            "1/√d_k scaling gives, and the weights are nearly uniform: the scores look scaled "
            "twice, or divided by d_k instead of √d_k."
        ),
    )
    hs = heads(sat > SATURATED_FRACTION)
    add(
        "saturated",
        hs,
        (
            f"{100 * sat[list(hs)].mean() if hs else 0:.0f}% of rows put more than "
            f"{SATURATED_WEIGHT} of their weight on one key; p(1-p) averages "
            f"{sensitivity[list(hs)].mean() if hs else 0:.4f}, so little gradient reaches the "
            "logits (expected after training, a problem before it)."
        ),
    )
    hs = heads(entropy > DIFFUSE_ENTROPY)
    add(
        "diffuse",
        hs,
        (
            f"normalised entropy {entropy[list(hs)].mean() if hs else 0:.3f}: the weights are "
            "close to uniform, every visible key gets about the same share."
        ),
    )
    return ScaleReport(
        d_k=d_k,
        scale=float(_to_host(plan.scale)),  # a learned scale (0-d array) read on the host
        logit_mean=_to_host(stats.mean),
        logit_std=std,
        logit_max_abs=_to_host(stats.max_abs),
        expected_std=expected,
        entropy=entropy,
        saturation=sat,
        sensitivity=sensitivity,
        findings=tuple(findings),
    )
