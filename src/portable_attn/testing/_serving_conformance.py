"""Conformance cases for anyone's serving functions: sparse, quantized, cascade, merge, top-k.

:func:`serving_conformance` calls a function with the arguments of this library's own
(:func:`~portable_attn.serving.ragged_paged_attention` with ``kv_indices=`` or with
scales, :func:`~portable_attn.serving.cascade_attention`,
:func:`~portable_attn.merge_attention`, :func:`~portable_attn.serving.topk_indices`)
on small fixed cases, each aimed at one rule that kernels get wrong (a list's padding
and repeats, a sink counted once, the low nibble first, base-2 log-sum-exps, two empty
states), and compares what it returns with a float64 NumPy oracle written here, row by
row, independent of the library's walks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backends import Backend, make_backend, to_numpy
from ._conformance import TOLERANCE

__all__ = ["SERVING_KINDS", "ServingCase", "ServingReport", "serving_conformance"]

SERVING_KINDS: tuple[str, ...] = ("sparse", "quantized", "cascade", "merge", "topk")
"""The kinds of function :func:`serving_conformance` checks."""

#: |actual - expected| <= ATOL * max(1, max|expected|) + RTOL * |expected|: the float32
#: tolerance of :func:`conformance`, the cases' inputs being float32
ATOL, RTOL = TOLERANCE["float32"]

HQ, HKV, D, PAGE = 4, 2, 8, 4


@dataclass(frozen=True)
class ServingCase:
    """One case: its `name`, the rule it checks (`what`), and what went wrong, if anything.

    `error` the exception raised or the shape that differs (None: the values were
    compared); `max_error` the largest difference from the oracle (inf where the values
    are not finite or not comparable).
    """

    name: str
    what: str
    error: str | None
    max_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """Whether the function agreed with the oracle."""
        return self.error is None and self.max_error <= self.tolerance


@dataclass(frozen=True)
class ServingReport:
    """The cases of one kind, run on one function."""

    kind: str
    target: str
    cases: list[ServingCase]

    @property
    def failed(self) -> list[ServingCase]:
        """The cases that failed."""
        return [c for c in self.cases if not c.ok]

    @property
    def ok(self) -> bool:
        """Whether every case passed."""
        return not self.failed

    def __str__(self) -> str:
        status = "ok" if self.ok else f"{len(self.failed)} FAILED"
        lines = [f"{self.kind} conformance of {self.target}: {len(self.cases)} cases: {status}"]
        for c in self.cases:
            mark = "ok  " if c.ok else "FAIL"
            detail = c.error or f"max error {c.max_error:.3g} (tolerance {c.tolerance:.3g})"
            lines.append(f"  {mark} {c.name}: {c.what}" + ("" if c.ok else f" -- {detail}"))
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# the oracle: one row at a time


def _attend(q: Any, k: Any, v: Any, visible: Any, sink: Any = None, scale: float = 0.0) -> Any:
    """Float64 attention of one row's heads: q (Hq, D), k (n, Hkv, D), v (n, Hkv, Dv).

    `visible` (Hkv, n) bool; `sink` (Hq,) or None joins each denominator once.
    Returns out (Hq, Dv) and lse (Hq,): zeros and -inf where nothing is seen.
    """
    hq, g = q.shape[0], q.shape[0] // k.shape[1]
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    out, lse = np.zeros((hq, v.shape[-1])), np.full(hq, -np.inf)
    for h in range(hq):
        seen = visible[h // g]
        s = scale * (k[seen, h // g] @ q[h])
        parts = np.concatenate([s, [] if sink is None else [sink[h]]])
        if len(parts) == 0:
            continue
        m = parts.max()
        lse[h] = m + np.log(np.exp(parts - m).sum())
        if len(s):
            out[h] = np.exp(s - lse[h]) @ v[seen, h // g]
    return out, lse


def _paged(rng: Any, lengths: list[int], dv: int = D) -> dict[str, Any]:
    """Return requests' keys and values in a shuffled pool, and the tables."""
    pages = [-(-n // PAGE) for n in lengths]
    order = rng.permutation(sum(pages) + 2)
    table = np.zeros((len(lengths), max(pages) + 1), dtype=np.int64)
    kp = rng.standard_normal((len(order), PAGE, HKV, D)).astype(np.float32)
    vp = rng.standard_normal((len(order), PAGE, HKV, dv)).astype(np.float32)
    at = 0
    for r, n in enumerate(pages):
        table[r, :n] = order[at : at + n]
        at += n
    keys = [kp[table[r]].reshape(-1, HKV, D)[: lengths[r]] for r in range(len(lengths))]
    values = [vp[table[r]].reshape(-1, HKV, dv)[: lengths[r]] for r in range(len(lengths))]
    return {"key_pages": kp, "value_pages": vp, "table": table, "keys": keys, "values": values}


def _rows(lengths: list[int], new: list[int]) -> tuple[Any, Any, Any]:
    """Each packed row's request and position (bottom-right), and ``q_starts``."""
    starts = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    req = np.repeat(np.arange(len(new)), new)
    pos = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, new, strict=True)])
    return req, pos.astype(np.int64), starts


# ---------------------------------------------------------------------------
# the cases of each kind: (name, what, call(fn, on) -> got, expected)


def _sparse_cases(rng: Any) -> list[tuple[str, str, Callable[..., Any], Any]]:
    lengths, new = [13, 6], [3, 2]
    pool = _paged(rng, lengths)
    req, pos, starts = _rows(lengths, new)
    t = len(req)
    q = rng.standard_normal((t, HQ, D)).astype(np.float32)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    cases = []

    def case(name: str, what: str, idx: Any, **options: Any) -> None:
        causal = options.get("is_causal", True)
        window = options.get("window")
        union = options.get("window_union", False)
        expected = np.zeros((t, HQ, D))
        for row in range(t):
            r, p, n = req[row], pos[row], lengths[req[row]]
            keys = np.arange(n)
            band = keys <= p if causal else np.ones(n, bool)
            if window is not None:
                band = band & (keys >= p - window[0])
            visible = np.zeros((HKV, n), bool)
            for h in range(HKV):
                listed = np.isin(keys, idx[row, h][idx[row, h] >= 0])
                visible[h] = (
                    (listed & (keys <= p if causal else True)) | band if union else (listed & band)
                )
            sink = options.get("sinks")
            expected[row] = _attend(q[row], pool["keys"][r], pool["values"][r], visible, sink)[0]

        def call(fn: Any, on: Any) -> Any:
            args = (q, pool["key_pages"], pool["value_pages"], pool["table"])
            kw = {n: on(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
            meta = (np.array(lengths), starts)
            return fn(*(on(x) for x in (*args, *meta)), kv_indices=on(idx), **kw)

        cases.append((name, what, call, expected))

    def lists(k: int) -> Any:  # k distinct positions of each row's request, per head
        rows = [[rng.choice(lengths[r], size=k, replace=False) for _ in range(HKV)] for r in req]
        return np.asarray(rows, dtype=np.int64)

    padded = lists(6)
    padded[:, :, ::3] = -1
    case("padding", "-1 entries of a list are no key", padded)
    repeated = lists(5)
    repeated[:, :, 1] = repeated[:, :, 0]
    case("repeats", "a position listed twice counts once", repeated)
    case("causal", "a listed key after the row is hidden (bottom-right causal)", lists(6))
    case("not causal", "with is_causal=False every listed key is seen", lists(6), is_causal=False)
    case("sink once", "a sink joins each row's denominator once", lists(6), sinks=sinks)
    empty = lists(4)
    empty[0] = -1
    case("empty list", "a row that lists nothing is zeros", empty)
    case(
        "window union",
        "window_union=True adds the window's keys, each once",
        lists(4),
        window=(3, 0),
        window_union=True,
    )
    return cases


def _quantized_cases(rng: Any) -> list[tuple[str, str, Callable[..., Any], Any]]:
    lengths, new = [10, 7], [2, 1]
    req, pos, starts = _rows(lengths, new)
    t = len(req)
    q = rng.standard_normal((t, HQ, D)).astype(np.float32)
    pool = _paged(rng, lengths)
    n_pages = pool["key_pages"].shape[0]
    cases = []

    def case(name: str, what: str, bits: int, groups: int, zero: bool) -> None:
        stored, kw, deq = [], {"kv_bits": bits}, []
        for name_ in ("key", "value"):
            lo, hi = (-8, 8) if bits == 4 else (-128, 128)
            data = rng.integers(lo, hi, size=(n_pages, PAGE, HKV, D))
            shape = (n_pages, PAGE, HKV, *((groups,) if groups else ()))
            scale = (rng.random(shape) * 0.1 + 0.01).astype(np.float32)
            zp = rng.integers(-2, 3, size=shape).astype(np.float32) if zero else None
            per = (*shape, 1) if groups else (*shape, 1, 1)
            g = max(groups, 1)
            x = data.reshape(n_pages, PAGE, HKV, g, D // g).astype(np.float64)
            z = 0.0 if zp is None else zp.reshape(per)
            deq.append(((x - z) * scale.reshape(per)).reshape(n_pages, PAGE, HKV, D))
            if bits == 4:
                nib = (data & 15).astype(np.uint8).reshape(n_pages, PAGE, HKV, D // 2, 2)
                data = nib[..., 0] | (nib[..., 1] << 4)
            else:
                data = data.astype(np.int8)
            stored.append(data)
            kw[f"{name_}_scales"] = scale
            if zp is not None:
                kw[f"{name_}_zero_points"] = zp
        expected = np.zeros((t, HQ, D))
        for row in range(t):
            r, p, n = req[row], pos[row], lengths[req[row]]
            keys = deq[0][pool["table"][r]].reshape(-1, HKV, D)[:n]
            values = deq[1][pool["table"][r]].reshape(-1, HKV, D)[:n]
            visible = np.broadcast_to(np.arange(n) <= p, (HKV, n))
            expected[row] = _attend(q[row].astype(np.float64), keys, values, visible)[0]

        def call(fn: Any, on: Any) -> Any:
            args = (q, *stored, pool["table"], np.array(lengths), starts)
            options = {n: on(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
            return fn(*(on(x) for x in args), **options)

        cases.append((name, what, call, expected))

    case("int8 per token", "(stored) · scale, a scale per token", 8, 0, False)
    case("int8 per group, zero points", "(stored - zero) · scale per group of D / G", 8, 2, True)
    case("int4", "two signed nibbles a byte, the low nibble first", 4, 0, False)
    return cases


def _cascade_cases(rng: Any) -> list[tuple[str, str, Callable[..., Any], Any]]:
    lp, lengths, new = 5, [4, 3, 2], [2, 1, 1]
    groups = np.array([0, 2, 2, 3])  # group 1 holds no request
    pool = _paged(rng, lengths)
    prefix_k = rng.standard_normal((3, lp, HKV, D)).astype(np.float32)
    prefix_v = rng.standard_normal((3, lp, HKV, D)).astype(np.float32)
    req, pos, starts = _rows(lengths, new)
    pos = pos + lp
    t = len(req)
    q = rng.standard_normal((t, HQ, D)).astype(np.float32)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    group_of = np.searchsorted(groups, np.arange(len(lengths)), side="right") - 1
    cases = []

    def case(name: str, what: str, **options: Any) -> None:
        expected = np.zeros((t, HQ, D))
        for row in range(t):
            r, p = req[row], pos[row]
            g = group_of[r]
            keys = np.concatenate([prefix_k[g], pool["keys"][r]])
            values = np.concatenate([prefix_v[g], pool["values"][r]])
            n = len(keys)
            band = np.arange(n) <= p
            if "window" in options:
                band = band & (np.arange(n) >= p - options["window"][0])
            visible = np.broadcast_to(band, (HKV, n))
            sink = options.get("sinks")
            expected[row] = _attend(q[row], keys, values, visible, sink)[0]

        def call(fn: Any, on: Any) -> Any:
            args: tuple[Any, ...] = (q, prefix_k, prefix_v, pool["key_pages"])
            args += (pool["value_pages"], pool["table"], np.array(lengths), starts, groups)
            kw = {n: on(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
            return fn(*(on(x) for x in args), **kw)

        cases.append((name, what, call, expected))

    case("prefix then own keys", "a row sees its group's prefix, then its own keys, causal")
    case("sink once", "the sink joins the merged denominator once, not per part", sinks=sinks)
    case(
        "window across the parts", "a window counts positions across prefix and own", window=(3, 0)
    )
    return cases


def _merge_cases(rng: Any) -> list[tuple[str, str, Callable[..., Any], Any]]:
    outs = [rng.standard_normal((2, 3, D)).astype(np.float32) for _ in range(2)]
    lses = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2)]
    lses[0][0, 0] = lses[1][0, 0] = -np.inf  # a row empty in both parts
    outs[0][0, 0] = outs[1][0, 0] = 0.0
    top = np.max(np.stack(lses), axis=0)
    w = np.exp(np.stack(lses) - np.where(np.isfinite(top), top, 0.0))  # empty: exp(-inf) = 0
    total = w.sum(axis=0)
    safe = np.where(total == 0, 1.0, total)
    expected = (w[..., None] * np.stack(outs)).sum(axis=0) / safe[..., None]
    cases = []

    def natural(fn: Any, on: Any) -> Any:
        return fn([on(o) for o in outs], [on(x) for x in lses])[0]

    def base2(fn: Any, on: Any) -> Any:
        return fn([on(o) for o in outs], [on(x / math.log(2)) for x in lses], lse_base=2)[0]

    cases.append(("natural lse", "parts merged by their log-sum-exps", natural, expected))
    cases.append(("base-2 lse", "lse_base=2 states merge as the natural ones", base2, expected))
    return cases


def _topk_cases(rng: Any) -> list[tuple[str, str, Callable[..., Any], Any]]:
    scores = rng.integers(-2, 3, size=(3, 2, 9)).astype(np.float32)  # many ties
    lengths = np.array([9, 4, 0])
    expected = np.full((3, 2, 6), -1, dtype=np.int64)
    for i in range(3):
        for j in range(2):
            row = scores[i, j, : lengths[i]]
            ok = np.argsort(-row, kind="stable")[:6]  # ties: the lower position first
            expected[i, j, : len(ok)] = ok

    def call(fn: Any, on: Any) -> Any:
        return fn(on(scores), 6, on(lengths))

    return [
        ("ties and padding", "ties to the lower position, -1 past the valid ones", call, expected)
    ]


_CASES = {
    "sparse": _sparse_cases,
    "quantized": _quantized_cases,
    "cascade": _cascade_cases,
    "merge": _merge_cases,
    "topk": _topk_cases,
}


def serving_conformance(
    fn: Callable[..., Any], kind: str, *, backend: str | Backend = "numpy", seed: int = 0
) -> ServingReport:
    """Check a serving function of `kind` against float64 oracles on fixed small cases.

    Parameters
    ----------
    fn : callable
        Takes the arguments of this library's function of `kind` and returns what it
        returns: ``"sparse"``, ``ragged_paged_attention(query, key_pages, value_pages,
        page_table, kv_lengths, q_starts, kv_indices=, ...)``; ``"quantized"``, the same
        with ``key_scales=``, ``value_scales=`` (zero points, ``kv_bits``);
        ``"cascade"``, ``cascade_attention``; ``"merge"``, ``merge_attention(outs, lses,
        lse_base=)``; ``"topk"``, ``topk_indices(scores, k, kv_lengths)``.
    kind : str
        One of :data:`SERVING_KINDS`.
    backend : str or Backend, default "numpy"
        The backend kind whose arrays `fn` is given (:func:`make_backend`).
    seed : int, default 0
        The seed of the cases' data.

    Returns
    -------
    ServingReport
        One :class:`ServingCase` per case; ``str(report)`` lists them.
    """
    if kind not in _CASES:
        msg = f"`kind` must be one of {', '.join(SERVING_KINDS)}, but got {kind!r}"
        raise ValueError(msg)
    b = make_backend(backend) if isinstance(backend, str) else backend
    rng = np.random.default_rng(seed)
    results = []
    for name, what, call, expected in _CASES[kind](rng):
        tolerance = ATOL * max(1.0, float(np.abs(expected).max(initial=0.0)))
        error, max_error = None, math.inf
        try:
            got = call(fn, b.asarray)
            got = got[0] if isinstance(got, tuple) else got
            actual = np.asarray(to_numpy(got), dtype=np.float64)
        except Exception as exc:  # the function's error is the finding
            error = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        else:
            if actual.shape != expected.shape:
                error = f"shape {actual.shape}, expected {expected.shape}"
            else:
                diff = np.abs(actual - expected) - RTOL * np.abs(expected)
                finite = np.isfinite(actual) | (actual == expected)
                max_error = float(np.max(np.where(finite, diff, np.inf), initial=0.0))
        results.append(ServingCase(name, what, error, max(max_error, 0.0), tolerance))
    target = f"{getattr(fn, '__qualname__', type(fn).__name__)} on {b.kind}"
    return ServingReport(kind, target, results)
