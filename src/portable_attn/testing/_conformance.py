"""A conformance harness for anyone's attention function, against the float64 oracle.

:func:`conformance` calls ``fn(query, key, value, **options)`` on random small
cases drawn from the features the caller names, in this library's keyword names
(those of :func:`portable_attn.scaled_dot_product_attention`), compares each
output with :func:`reference_attention` in float64, and shrinks every failing
case to the smallest shapes that still fail. The semantics checked are the
library's (``docs/semantics.md``), with one declared difference allowed: a
wrapper whose ``is_causal`` and ``window`` are top-left aligned (torch's and
JAX's are) says so with ``causal_alignment="top-left"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .._lib._compat import library_name, standard_namespace
from ._backends import FAMILIES, Backend, kind_supports, make_backend, to_numpy
from ._reference import reference_attention, structure

__all__ = ["ALIGNMENTS", "FEATURES", "ConformanceFailure", "ConformanceReport", "conformance"]

FEATURES: tuple[str, ...] = (
    "mask",
    "bias",
    "causal",
    "window",
    "softcap",
    "gqa",
    "kv_lengths",
    "sinks",
    "empty_rows",
    "lq_ne_lk",
    "scale",
    "dv_ne_dk",
    "half",
)
"""The features :func:`conformance` can draw cases from, in the order reports list them."""

ALIGNMENTS: tuple[str, ...] = ("bottom-right", "top-left")
"""The causal alignments a wrapper may declare: the library's (``i' = i + Lk - Lq``) or
torch's and JAX's (``i' = i``)."""

#: (atol, rtol) per input dtype:
#: |actual - expected| <= atol * max(1, max|value|) + rtol * |expected|.
#: float32 allows about a thousand units in the last place; float16 and bfloat16 allow
#: the weights rounded to the dtype before the product with the values (as jax.nn does)
#: and the output rounded once more.
TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (4e-3, 4e-3),
    "bfloat16": (3e-2, 3e-2),
}

_EMPTY_ROW_MAKERS = ("mask", "bias", "kv_lengths")
_MAX_L = 48
_MAX_SHRINK_CALLS = 400
_DRAWS = 500
#: the longest cause a report prints: a longer first line of a message is cut with "..."
MAX_CAUSE_CHARS = 160
# a number in a message: a hex address, or a decimal not inside a name (float32 stays)
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|(?<![\w.])[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


# ---------------------------------------------------------------------------
# the report


@dataclass(frozen=True)
class ConformanceFailure:
    """One failing case, shrunk to the smallest shapes that still fail.

    Parameters
    ----------
    case : int
        Index of the case among the `n` drawn (a report with the same `seed`
        draws it again).
    features : tuple of str
        The features of the case (its options and its shapes).
    dtype : str
        The dtype of `query`, `key` and `value` (and of `bias` and `sinks`).
    query : ndarray, shape (B, Hq, Lq, Dk)
        The query as `fn` received it, in float64 (values exact in `dtype`).
    key : ndarray, shape (B, Hkv, Lk, Dk)
        The key, likewise.
    value : ndarray, shape (B, Hkv, Lk, Dv)
        The value, likewise.
    options : dict
        The keyword arguments `fn` received, arrays as NumPy (``mask`` bool,
        ``kv_lengths`` int32, ``bias`` and ``sinks`` float64 exact in `dtype`).
    expected : ndarray, shape (B, Hq, Lq, Dv)
        The float64 oracle's output.
    actual : ndarray or None
        What `fn` returned, in float64; None when it raised.
    error : str or None
        What is wrong besides the values: the exception `fn` raised, or a shape
        or dtype that differs; None when only the values differ.
    max_error : float
        The largest ``|actual - expected|`` (inf where `fn` gave NaN or inf, or
        no comparable output).
    original_shapes : dict of str to int
        ``B, Hq, Hkv, Lq, Lk, Dk, Dv`` of the case as drawn, before shrinking.
    """

    case: int
    features: tuple[str, ...]
    dtype: str
    query: npt.NDArray[np.float64] = field(repr=False)
    key: npt.NDArray[np.float64] = field(repr=False)
    value: npt.NDArray[np.float64] = field(repr=False)
    options: dict[str, Any] = field(repr=False)
    expected: npt.NDArray[np.float64] = field(repr=False)
    actual: npt.NDArray[np.float64] | None = field(repr=False)
    error: str | None
    max_error: float
    original_shapes: dict[str, int] = field(repr=False)

    @property
    def lq(self) -> int:
        """Query length of the repro."""
        return int(self.query.shape[-2])

    @property
    def lk(self) -> int:
        """Key length of the repro."""
        return int(self.key.shape[-2])

    @property
    def shapes(self) -> dict[str, int]:
        """``B, Hq, Hkv, Lq, Lk, Dk, Dv`` of the repro."""
        return _shapes(self.query, self.key, self.value)

    @property
    def cause(self) -> str:
        """What went wrong, in words shared by every failure of the same cause.

        The first line of :attr:`error` with every number written ``#`` (so that
        shapes and indices do not split one cause in many), at most
        :data:`MAX_CAUSE_CHARS` long; for a value-only failure, ``"wrong values:
        NaN or inf in the output"`` or ``"wrong values: error above tolerance"``.
        """
        if self.error is not None:
            return _cause_of(self.error)
        if self.actual is not None and not np.isfinite(self.actual).all():
            return "wrong values: NaN or inf in the output"
        return "wrong values: error above tolerance"

    def __str__(self) -> str:
        s = self.shapes
        o = self.original_shapes
        lines = [
            f"case {self.case} [{', '.join(self.features)}], {self.dtype}: "
            f"Lq x Lk = {s['Lq']} x {s['Lk']} (drawn {o['Lq']} x {o['Lk']}); "
            + ", ".join(f"{k}={v}" for k, v in s.items() if k not in ("Lq", "Lk"))
        ]
        with np.printoptions(threshold=64, precision=4, suppress=True):
            for name, a in (("query", self.query), ("key", self.key), ("value", self.value)):
                lines.append(f"  {name} = {_code(a.astype(_host_dtype(self.dtype)))}")
            args = ", ".join(f"{k}={_code(v)}" for k, v in self.options.items())
            lines.append(f"  out = fn(query, key, value{', ' + args if args else ''})")
            if self.error is not None:
                lines.append(f"  {self.error}")
            if self.actual is not None and self.actual.shape == self.expected.shape:
                err = np.abs(self.actual - self.expected)
                err = np.where(np.isnan(err), np.inf, err)
                at = [int(i) for i in np.unravel_index(int(np.argmax(err)), err.shape)][:-1]
                where = ", ".join(map(str, at))
                expected, actual = self.expected, self.actual
                for i in at:  # down to the row of the largest error
                    expected, actual = expected[i], actual[i]
                atol, rtol = TOLERANCE[self.dtype]
                lines.append(
                    f"  max error {self.max_error:.3g} in out[{where}, :] "
                    f"(tolerance {atol:g} * max(1, max|value|) + {rtol:g} * |expected|)"
                )
                lines.append(f"  expected {expected}")
                lines.append(f"  actual   {actual}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ConformanceReport:
    """What :func:`conformance` found: cases run and failed per feature, and the repros.

    Parameters
    ----------
    features : dict of str to (int, int)
        For each requested feature, ``(cases run, cases failed)`` among the cases
        that used it. A case uses several features, so one failing case counts
        against each of its features.
    failures : list of ConformanceFailure
        Every failing case, shrunk, smallest ``Lq x Lk`` first.
    n : int
        Cases run.
    seed : int
        The seed they were drawn with.
    causal_alignment : str
        The alignment the wrapper declared.
    target : str
        What was checked: the function's name and the library with its version.
    """

    features: dict[str, tuple[int, int]]
    failures: list[ConformanceFailure]
    n: int
    seed: int
    causal_alignment: str
    target: str = "fn"

    @property
    def failed(self) -> int:
        """The number of failing cases."""
        return len(self.failures)

    @property
    def ok(self) -> bool:
        """Whether every case agreed with the oracle."""
        return not self.failures

    @property
    def causes(self) -> dict[str, list[ConformanceFailure]]:
        """The failures grouped by :attr:`ConformanceFailure.cause`, most frequent first.

        Each group keeps the order of :attr:`failures` (smallest first), so its first
        failure is its smallest repro; groups of equal size keep the order of those.
        """
        groups: dict[str, list[ConformanceFailure]] = {}
        for f in self.failures:
            groups.setdefault(f.cause, []).append(f)
        return dict(sorted(groups.items(), key=lambda item: -len(item[1])))

    def summary(self) -> str:
        """Return the summary: the status, cases run and failed per feature, the causes.

        Each cause is one entry: how many failing cases it has, the features every
        one of them uses, and the number of its smallest repro (``FAIL i/n`` of
        :meth:`repros`).

        Returns
        -------
        str
            Lines of text, without the repros.
        """
        status = "ok" if self.ok else f"{self.failed} FAILED"
        lines = [
            f"conformance of {self.target}: {self.n} cases, seed {self.seed}, "
            f"{self.causal_alignment} causal alignment: {status}",
            f"{'feature':<12}{'cases':>7}{'failed':>8}",
        ]
        lines += [f"{name:<12}{run:>7}{bad:>8}" for name, (run, bad) in self.features.items()]
        if self.failures:
            causes = self.causes
            number = self._numbers()
            plural = "s" if len(causes) > 1 else ""
            lines.append(f"{len(causes)} cause{plural} of the {self.failed} failing cases:")
            width = len(str(self.failed))
            for cause, group in causes.items():
                shared = [f for f in FEATURES if all(f in g.features for g in group)]
                common = ", ".join(shared) if shared else "no feature in all of them"
                lines.append(f"  {len(group):>{width}} x {cause}")
                lines.append(
                    f"  {'':>{width}}   in every one: {common}; "
                    f"smallest repro: FAIL {number[id(group[0])]}/{self.failed}"
                )
        return "\n".join(lines)

    def repros(self, limit: int | None = None) -> list[str]:
        """Return repros as text, each ``FAIL i/n: `` and the failure printed as code.

        Parameters
        ----------
        limit : int, optional
            None (the default): every failure, smallest first. Otherwise the
            smallest repro of each cause, in the order of :attr:`causes`, at most
            `limit` of them.

        Returns
        -------
        list of str
            One text (of several lines) per repro.
        """
        number = self._numbers()
        if limit is None:
            chosen = self.failures
        else:
            chosen = [group[0] for group in self.causes.values()][: max(limit, 0)]
        return [f"FAIL {number[id(f)]}/{self.failed}: {f}" for f in chosen]

    def _numbers(self) -> dict[int, int]:
        """``id(failure)`` to its number from 1 in :attr:`failures`."""
        return {id(f): i for i, f in enumerate(self.failures, 1)}

    def __str__(self) -> str:
        return "\n".join([self.summary(), *self.repros()])


# ---------------------------------------------------------------------------
# a case


@dataclass(frozen=True)
class _Case:
    """One drawn case, as NumPy data: float64 values exact in `dtype`."""

    index: int
    features: frozenset[str]
    dtype: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None = None  # (mb, mh, Lq, Lk) bool
    bias: np.ndarray | None = None  # (mb, mh, Lq, Lk)
    is_causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    scale: float | None = None
    kv_lengths: np.ndarray | None = None  # (B,) int32
    sinks: np.ndarray | None = None  # (Hq,)

    @property
    def ordered_features(self) -> tuple[str, ...]:
        return tuple(f for f in FEATURES if f in self.features)

    def options(self) -> dict[str, Any]:
        """Return the keyword arguments of the call, as NumPy data, in a fixed order."""
        found = {
            "mask": self.mask,
            "bias": self.bias,
            "is_causal": True if self.is_causal else None,
            "window": self.window,
            "softcap": self.softcap,
            "scale": self.scale,
            "kv_lengths": self.kv_lengths,
            "sinks": self.sinks,
        }
        return {k: v for k, v in found.items() if v is not None}


def _cause_of(error: str) -> str:
    """Return the cause of an error message: its first line, numbers as ``#``, cut to length."""
    lines = error.strip().splitlines()
    text = _NUMBER.sub("#", lines[0] if lines else "")
    if len(text) > MAX_CAUSE_CHARS:
        text = text[: MAX_CAUSE_CHARS - 3] + "..."
    return text


def _shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> dict[str, int]:
    b, hq, lq, dk = q.shape
    return {"B": b, "Hq": hq, "Hkv": k.shape[1], "Lq": lq, "Lk": k.shape[2], "Dk": dk,
            "Dv": v.shape[3]}  # fmt: skip


def _host_dtype(dtype: str) -> Any:
    return np.float32 if dtype == "bfloat16" else np.dtype(dtype)


def _code(x: Any) -> str:
    """Write a value as code: ``np.array(...)`` for an array (a summary when large)."""
    if isinstance(x, np.ndarray):
        if x.size > 64:
            return f"<{x.dtype} array of shape {x.shape}>"
        text = np.array2string(x, separator=", ")
        return f"np.array({text}, dtype=np.{x.dtype})"
    return repr(x)


def _visible(
    batch: int,
    lq: int,
    lk: int,
    *,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    kv_lengths: np.ndarray | None,
    alignment: str,
) -> np.ndarray:
    """(B, Lq, Lk): the keys causality, the window and the lengths leave to each row."""
    kl = np.full(batch, lk) if kv_lengths is None else np.asarray(kv_lengths, dtype=np.int64)
    offset = kl - lq if alignment == "bottom-right" else np.zeros(batch, dtype=np.int64)
    i = np.arange(lq)[None, :, None] + offset[:, None, None]
    j = np.arange(lk)[None, None, :]
    ok = np.broadcast_to(j < kl[:, None, None], (batch, lq, lk)).copy()
    if is_causal:
        ok &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            ok &= j >= i - left
        if right is not None:
            ok &= j <= i + right
    return ok


def _empty_rows(case: _Case, alignment: str) -> np.ndarray:
    """(B, Hq, Lq): whether each query row sees no key at all."""
    b, hq, lq, _ = case.q.shape
    lk = case.k.shape[2]
    seen = _visible(
        b,
        lq,
        lk,
        is_causal=case.is_causal,
        window=case.window,
        kv_lengths=case.kv_lengths,
        alignment=alignment,
    )[:, None]
    if case.mask is not None:
        seen = seen & case.mask
    if case.bias is not None:
        seen = seen & np.isfinite(case.bias)
    return np.asarray(~np.broadcast_to(seen, (b, hq, lq, lk)).any(axis=-1))


def _consistent(case: _Case, alignment: str) -> bool:
    """Whether the shapes and empty rows of `case` are those its features say."""
    s = _shapes(case.q, case.k, case.v)
    f = case.features
    return (
        (s["Hq"] != s["Hkv"]) == ("gqa" in f)
        and (s["Lq"] != s["Lk"]) == ("lq_ne_lk" in f)
        and (s["Dv"] != s["Dk"]) == ("dv_ne_dk" in f)
        and bool(_empty_rows(case, alignment).any()) == ("empty_rows" in f)
    )


# ---------------------------------------------------------------------------
# drawing cases


def _length(rng: np.random.Generator) -> int:
    r = rng.random()
    if r < 0.5:
        return int(rng.integers(1, 9))
    if r < 0.8:
        return int(rng.integers(9, 21))
    return int(rng.integers(21, _MAX_L + 1))


def _dim(rng: np.random.Generator) -> int:
    return int(rng.choice([1, 2, 3, 4, 5, 8, 8, 16, 16, 24, 32]))


def _side(rng: np.random.Generator, longest: int) -> int | None:
    r = rng.random()
    if r < 0.2:
        return None
    if r < 0.65:
        return int(rng.integers(0, 4))
    return int(rng.integers(0, longest + 1))


def _empty_row_makers(chosen: Iterable[str], alignment: str) -> list[str]:
    """Return what can leave a row with no key among the features `chosen`."""
    chosen = set(chosen)
    makers = [m for m in _EMPTY_ROW_MAKERS if m in chosen]
    structural = "window" in chosen or ("causal" in chosen and alignment == "bottom-right")
    if "lq_ne_lk" in chosen and structural:
        makers.append("structure")
    return makers


def _choose(
    rng: np.random.Generator, index: int, requested: Sequence[str], alignment: str
) -> frozenset[str]:
    """Pick the features of case `index`: each requested one half the time, one always."""
    chosen = {f for f in requested if rng.random() < 0.5}
    chosen.add(requested[index % len(requested)])
    if "empty_rows" in chosen and not _empty_row_makers(chosen, alignment):
        options: list[tuple[str, ...]] = [(m,) for m in _EMPTY_ROW_MAKERS if m in requested]
        if "lq_ne_lk" in requested:
            options += [("lq_ne_lk", s) for s in ("window", "causal") if s in requested]
            if alignment == "top-left":
                options = [o for o in options if o != ("lq_ne_lk", "causal")]
        chosen.update(options[int(rng.integers(len(options)))])
    return frozenset(chosen)


def _draw(
    rng: np.random.Generator,
    index: int,
    requested: Sequence[str],
    alignment: str,
    half_dtypes: Sequence[str],
) -> _Case:
    """Draw case `index`: its features, then shapes and options that use exactly those."""
    f = _choose(rng, index, requested, alignment)
    maker = None
    if "empty_rows" in f:
        makers = _empty_row_makers(f, alignment)
        maker = makers[int(rng.integers(len(makers)))]
    batch = int(rng.integers(1, 4))
    hkv = int(rng.integers(1, 4))
    hq = hkv * (int(rng.integers(2, 5)) if "gqa" in f else 1)
    dk = _dim(rng)
    dv = dk
    while "dv_ne_dk" in f and dv == dk:
        dv = _dim(rng)
    dtype = str(rng.choice(list(half_dtypes))) if "half" in f else "float32"
    for _ in range(_DRAWS):  # shapes and structure until the rows are as the features say
        lq = lk = _length(rng)
        if "lq_ne_lk" in f:
            while lk == lq:
                lk = _length(rng)
            if maker == "structure":
                lq, lk = max(lq, lk), min(lq, lk)
        window = None
        if "window" in f:
            window = (_side(rng, max(lq, lk)), _side(rng, max(lq, lk)))
            if window == (None, None):
                window = (None, int(rng.integers(0, 4)))
        kv_lengths = None
        if "kv_lengths" in f:
            full = rng.random(batch) < 0.4
            kv_lengths = np.where(full, lk, rng.integers(1, lk + 1, batch)).astype(np.int32)
        seen = _visible(
            batch,
            lq,
            lk,
            is_causal="causal" in f,
            window=window,
            kv_lengths=kv_lengths,
            alignment=alignment,
        )
        empty = not seen.any(axis=-1).all()
        if empty == (maker == "structure"):
            break
    else:  # pragma: no cover - the draws above succeed far sooner
        msg = f"could not draw case {index} with features {sorted(f)}"
        raise RuntimeError(msg)
    std = float(rng.choice([0.5, 1.0, 2.0, 4.0]))
    q = rng.standard_normal((batch, hq, lq, dk)) * std
    k = rng.standard_normal((batch, hkv, lk, dk))
    v = rng.standard_normal((batch, hkv, lk, dv))
    mb = batch if "kv_lengths" in f or rng.random() < 0.5 else 1
    mh = hq if rng.random() < 0.5 else 1
    shape = (mb, mh, lq, lk)
    # one key each row keeps, among those the structure leaves (the same for every b when mb == 1)
    pick = np.argmax(rng.random(shape) * seen[:mb, None], axis=-1)[..., None]
    mask = bias = None
    if "mask" in f:
        mask = rng.random(shape) < rng.uniform(0.3, 0.9)
        np.put_along_axis(mask, pick, True, axis=-1)
    if "bias" in f:
        bias = rng.standard_normal(shape) * rng.choice([0.5, 1.0, 2.0])
        if rng.random() < 0.3:
            bias[rng.random(shape) < 0.2] = -np.inf
        np.put_along_axis(bias, pick, rng.standard_normal((mb, mh, lq, 1)), axis=-1)
    if maker in ("mask", "bias"):
        row = tuple(int(rng.integers(n)) for n in shape[:3])
        if maker == "mask":
            assert mask is not None
            mask[row] = False
        else:
            assert bias is not None
            bias[row] = -np.inf
    elif maker == "kv_lengths":
        assert kv_lengths is not None
        kv_lengths[int(rng.integers(batch))] = 0
    sinks = None
    if "sinks" in f:  # the sink about as heavy as the keys together: dropping it shows
        sinks = np.log(lk) + rng.uniform(-1.5, 1.5, hq)
    case = _Case(
        index=index,
        features=f,
        dtype=dtype,
        q=q,
        k=k,
        v=v,
        mask=mask,
        bias=bias,
        is_causal="causal" in f,
        window=window,
        softcap=float(rng.uniform(0.5, 5.0)) if "softcap" in f else None,
        scale=float(rng.uniform(0.05, 1.5)) if "scale" in f else None,
        kv_lengths=kv_lengths,
        sinks=sinks,
    )
    if not _consistent(case, alignment):  # pragma: no cover - drawn so by construction
        msg = f"case {index} with features {sorted(f)} was drawn inconsistent"
        raise RuntimeError(msg)
    return case


# ---------------------------------------------------------------------------
# running a case


@dataclass(frozen=True)
class _Outcome:
    expected: np.ndarray
    actual: np.ndarray | None
    error: str | None
    max_error: float
    errors: np.ndarray  # (B, Hq, Lq, Dv), inf where wrong and not comparable
    failed: bool


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _run(fn: Callable[..., Any], backend: Backend, case: _Case, alignment: str) -> tuple[
    _Case, _Outcome
]:  # fmt: skip
    """Call `fn` on `case` and judge its output; return the case with its exact values too."""
    dtype = case.dtype
    arrays = {
        name: backend.asarray(getattr(case, name).astype(np.float32), dtype)
        for name in ("q", "k", "v", "bias", "sinks")
        if getattr(case, name) is not None
    }
    # what fn receives, exactly: the oracle computes on these values
    received: dict[str, Any] = {name: to_numpy(a) for name, a in arrays.items()}
    exact = replace(case, **received)
    options: dict[str, Any] = {}
    for name, value in exact.options().items():
        if name in ("bias", "sinks"):
            options[name] = arrays[name]
        elif name in ("mask", "kv_lengths"):
            options[name] = backend.asarray(value)
        else:
            options[name] = value
    expected = _oracle(exact, alignment)
    error = None
    actual = None
    try:
        out = fn(arrays["q"], arrays["k"], arrays["v"], **options)
    except Exception as exc:  # anything fn raises is its failure, reported
        error = f"raised {type(exc).__name__}: {exc}"
    else:
        try:
            actual = to_numpy(out)
        except Exception as exc:
            error = f"returned {type(out).__name__}, not an array: {exc}"
        else:
            found = _dtype_name(getattr(out, "dtype", actual.dtype))
            if actual.shape != expected.shape:
                error = f"returned shape {actual.shape}, expected {expected.shape}"
                actual = None
            elif found != dtype:
                error = f"returned dtype {found}, expected {dtype}"
    errors = np.full(expected.shape, np.inf)
    max_error = np.inf
    failed = error is not None
    if actual is not None:
        with np.errstate(invalid="ignore"):
            errors = np.abs(actual - expected)
        errors = np.where(np.isfinite(errors), errors, np.inf)
        max_error = float(errors.max()) if errors.size else 0.0
        atol, rtol = TOLERANCE[dtype]
        bound = atol * max(1.0, float(np.abs(exact.v).max(initial=0.0))) + rtol * np.abs(expected)
        failed = failed or bool((errors > bound).any())
    return exact, _Outcome(expected, actual, error, max_error, errors, failed)


def _oracle(case: _Case, alignment: str) -> np.ndarray:
    """Return the float64 oracle's output for `case` under `alignment`."""
    kw: dict[str, Any] = {
        "bias": case.bias,
        "scale": case.scale,
        "softcap": case.softcap,
        "sinks": case.sinks,
    }
    if alignment == "bottom-right":
        kw.update(
            mask=case.mask,
            is_causal=case.is_causal,
            window=case.window,
            kv_lengths=case.kv_lengths,
        )
    else:  # top-left: i' = i, the lengths only hide keys
        b, _, lq, _ = case.q.shape
        lk = case.k.shape[2]
        allowed = structure(lq, lk, is_causal=case.is_causal, window=case.window, offset=0)
        allowed = np.broadcast_to(allowed, (b, 1, lq, lk))
        if case.kv_lengths is not None:
            allowed = allowed & (np.arange(lk) < case.kv_lengths[:, None, None, None])
        kw["mask"] = allowed if case.mask is None else allowed & case.mask
    return reference_attention(case.q, case.k, case.v, **kw)


# ---------------------------------------------------------------------------
# shrinking


def _subcase(
    case: _Case,
    batches: Sequence[int],
    kv_heads: Sequence[int],
    groups: Sequence[int],
    rows: slice,
    cols: slice,
    dk: int,
    dv: int,
) -> _Case:
    """Cut `case` down to these batches, heads, query rows, key columns and features."""
    b = list(batches)
    g_count = case.q.shape[1] // case.k.shape[1]
    heads = [h * g_count + g for h in kv_heads for g in groups]

    def part(a: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        a = a[b] if a.shape[0] > 1 else a
        a = a[:, heads] if a.shape[1] > 1 else a
        return a[:, :, rows, cols]

    kv_lengths = None
    if case.kv_lengths is not None:
        start, stop, _ = cols.indices(case.k.shape[2])
        kv_lengths = np.clip(case.kv_lengths[b] - start, 0, stop - start).astype(np.int32)
    return replace(
        case,
        q=case.q[b][:, heads, rows, :dk],
        k=case.k[b][:, list(kv_heads), cols, :dk],
        v=case.v[b][:, list(kv_heads), cols, :dv],
        mask=part(case.mask),
        bias=part(case.bias),
        kv_lengths=kv_lengths,
        sinks=None if case.sinks is None else case.sinks[heads],
    )


def _spans(length: int, worst: int) -> Iterator[slice]:
    """Shorter spans of an axis of `length`, shortest first: prefixes, suffixes, the worst."""
    for m in sorted({1, 2, 3, length // 4, length // 2, length - 2, length - 1}):
        if 1 <= m < length:
            yield slice(0, m)
            yield slice(length - m, length)
            start = min(max(0, worst - m // 2), length - m)
            yield slice(start, start + m)


def _by_error(errors: np.ndarray, axis: int) -> list[int]:
    """Return the indices of `axis`, the largest error first."""
    other = tuple(a for a in range(errors.ndim) if a != axis)
    worst = errors.max(axis=other) if errors.size else np.zeros(errors.shape[axis])
    return [int(i) for i in np.argsort(-worst, kind="stable")]


def _candidates(case: _Case, errors: np.ndarray) -> Iterator[_Case]:
    """Smaller cases than `case`, the likeliest to still fail first."""
    s = _shapes(case.q, case.k, case.v)
    g_count = s["Hq"] // s["Hkv"]
    everything: dict[str, Any] = {
        "batches": range(s["B"]),
        "kv_heads": range(s["Hkv"]),
        "groups": range(g_count),
        "rows": slice(None),
        "cols": slice(None),
        "dk": s["Dk"],
        "dv": s["Dv"],
    }

    def sub(**kw: Any) -> _Case:
        return _subcase(case, **{**everything, **kw})

    for b in _by_error(errors, 0)[: 1 if s["B"] > 1 else 0]:
        yield sub(batches=[b])
    head_errors = errors.reshape(s["B"], s["Hkv"], g_count, *errors.shape[2:])
    if s["Hkv"] > 1:
        for h in _by_error(head_errors, 1)[:2]:
            yield sub(kv_heads=[h])
    keep = 2 if "gqa" in case.features else 1
    if g_count > keep:
        worst = _by_error(head_errors, 2)[0]
        start = min(worst, g_count - keep)
        yield sub(groups=range(start, start + keep))
    worst_row = _by_error(errors, 2)[0]
    for span in _spans(s["Lq"], worst_row):
        if "lq_ne_lk" in case.features:
            yield sub(rows=span)
        else:  # the key columns with them, so that Lq == Lk
            yield sub(rows=span, cols=span)
    if "lq_ne_lk" in case.features:
        for span in _spans(s["Lk"], s["Lk"] - 1):
            yield sub(cols=span)
        # one query row and one key off either end together: the alignment of the rest
        # moves by at most one, which a bug at an edge often needs
        for rows in (slice(1, None), slice(None, -1)):
            for cols in (slice(1, None), slice(None, -1)):
                if s["Lq"] > 1 and s["Lk"] > 1:
                    yield sub(rows=rows, cols=cols)
    if case.window is not None:  # a bound is a size too: smaller keeps the same option
        for side in (0, 1):
            bound = case.window[side]
            for m in sorted({0, 1, 2, (bound or 0) // 2, (bound or 0) - 1}):
                if bound is not None and 0 <= m < bound:
                    window = (m, case.window[1]) if side == 0 else (case.window[0], m)
                    yield replace(case, window=window)
                    if s["Lq"] > bound - m:  # and as many first rows: the others keep their keys
                        yield replace(sub(rows=slice(bound - m, None)), window=window)
    for m in sorted({1, 2, s["Dk"] // 2, s["Dk"] - 1}):
        if 1 <= m < s["Dk"]:
            yield sub(dk=m, dv=m if "dv_ne_dk" not in case.features else s["Dv"])
    if "dv_ne_dk" in case.features:
        for m in sorted({1, 2, s["Dv"] // 2, s["Dv"] - 1}):
            if 1 <= m < s["Dv"]:
                yield sub(dv=m)


def _size(case: _Case) -> tuple[int, int]:
    """Return what shrinking lowers: the inputs' size, then the window's bounds."""
    bounds = sum(b or 0 for b in case.window) if case.window is not None else 0
    return int(case.q.size + case.k.size + case.v.size), bounds


def _shrink(
    fn: Callable[..., Any], backend: Backend, case: _Case, outcome: _Outcome, alignment: str
) -> tuple[_Case, _Outcome]:
    """Shrink a failing case greedily while it still fails, keeping its features and options."""
    calls = 0
    improved = True
    while improved and calls < _MAX_SHRINK_CALLS:
        improved = False
        for smaller in _candidates(case, outcome.errors):
            if _size(smaller) >= _size(case) or not _consistent(smaller, alignment):
                continue
            calls += 1
            exact, result = _run(fn, backend, smaller, alignment)
            if result.failed:
                case, outcome, improved = exact, result, True
                break
            if calls >= _MAX_SHRINK_CALLS:
                break
    return case, outcome


# ---------------------------------------------------------------------------
# the entry point


def _backend_of(xp: Any) -> Backend:
    """Return the testing backend (first kind of its family) of namespace `xp`."""
    ns = standard_namespace(xp, "xp")
    family = library_name(ns.asarray(0))
    if family not in FAMILIES:  # pragma: no cover - standard_namespace knows the same libraries
        msg = f"`xp` is a namespace of {family}, which the backend table does not know"
        raise TypeError(msg)
    return make_backend(FAMILIES[family][0], exact=False)


def _failure(case: _Case, outcome: _Outcome, original: dict[str, int]) -> ConformanceFailure:
    return ConformanceFailure(
        case=case.index,
        features=case.ordered_features,
        dtype=case.dtype,
        query=case.q,
        key=case.k,
        value=case.v,
        options=case.options(),
        expected=outcome.expected,
        actual=outcome.actual,
        error=outcome.error,
        max_error=outcome.max_error,
        original_shapes=original,
    )


def conformance(
    fn: Callable[..., Any],
    *,
    xp: Any,
    features: Iterable[str] | None = None,
    causal_alignment: str = "bottom-right",
    n: int = 200,
    seed: int = 0,
) -> ConformanceReport:
    """Check an attention function against the float64 oracle on `n` random small cases.

    Each case calls ``fn(query, key, value, **options)`` with arrays of `xp`'s
    library, ``query`` ``(B, Hq, Lq, Dk)``, ``key`` ``(B, Hkv, Lk, Dk)`` and
    ``value`` ``(B, Hkv, Lk, Dv)``, and options in this library's keyword names
    (those of :func:`portable_attn.scaled_dot_product_attention`), drawn from the
    requested `features` only:

    ============== ========================================================
    ``mask``       ``mask=``, bool ``(B or 1, Hq or 1, Lq, Lk)``, True = attend
    ``bias``       ``bias=``, same shapes, some entries ``-inf`` in some cases
    ``causal``     ``is_causal=True``
    ``window``     ``window=(left, right)``, either side may be None
    ``softcap``    ``softcap=`` a float
    ``gqa``        ``Hq`` a multiple ``G >= 2`` of ``Hkv``: query head ``h``
                   uses key/value head ``h // G``; K and V are not repeated
    ``kv_lengths`` ``kv_lengths=``, int32 ``(B,)``
    ``sinks``      ``sinks=``, ``(Hq,)`` in the inputs' dtype
    ``empty_rows`` some query rows see no key (a mask row of False, a bias
                   row of ``-inf``, a length of 0, or causal/window with
                   ``Lq > Lk``): their output must be zeros
    ``lq_ne_lk``   ``Lq != Lk``, both ways
    ``scale``      ``scale=`` a float
    ``dv_ne_dk``   ``Dv != Dk``
    ``half``       float16 or bfloat16 inputs (those `xp`'s library has)
    ============== ========================================================

    Every case uses about half the requested features at once (so that they
    meet), and each requested feature is in at least every ``len(features)``-th
    case. Without ``empty_rows`` every row sees a key; without ``lq_ne_lk``,
    ``Lq == Lk``; without ``gqa``, ``Hq == Hkv``; without ``dv_ne_dk``,
    ``Dv == Dk``; other cases are float32. Shapes are small: ``B, Hkv <= 3``,
    ``G <= 4``, ``Lq, Lk <= 48``, ``Dk, Dv <= 32``.

    The output, brought back to NumPy, must have shape ``(B, Hq, Lq, Dv)``,
    the inputs' dtype, and values within :data:`TOLERANCE` of
    :func:`reference_attention` computed in float64 on the very values `fn`
    received. Each failing case is shrunk -- fewer batches, heads, query rows,
    keys and features while it still fails, with the same options -- into a
    :class:`ConformanceFailure`.

    Parameters
    ----------
    fn : callable
        ``fn(query, key, value, **options) -> output``, ``(B, Hq, Lq, Dv)``.
    xp : namespace
        The namespace of the library `fn` takes: ``numpy``, ``torch``,
        ``jax.numpy``, ``cupy``, ``array_api_strict``, ``dask.array`` or its
        ``array_api_compat`` namespace. Inputs are made on the library's first
        backend kind (:data:`FAMILIES`: the CPU, CuPy's GPU).
    features : iterable of str, optional
        The features `fn` supports, from :data:`FEATURES` (default: all of them).
    causal_alignment : {"bottom-right", "top-left"}, default "bottom-right"
        How `fn` aligns ``is_causal`` and ``window``: bottom-right (this
        library's, ``i' = i + Lk - Lq``, with ``kv_lengths[b]`` in place of
        ``Lk``), or top-left (torch's and ``jax.nn``'s, ``i' = i``).
    n : int, default 200
        Number of cases, at least 1.
    seed : int, default 0
        Seed of the cases: the same seed draws the same cases.

    Returns
    -------
    ConformanceReport
        ``.ok``, ``.features`` (``{name: (run, failed)}``), ``.failures`` and
        ``.causes`` (the failures grouped by cause); ``str(report)`` prints the
        summary (a table, then each cause with its count) and each repro as code,
        ``report.summary()`` and ``report.repros(limit)`` a part of it.

    Raises
    ------
    ValueError
        An unknown feature (the message lists the known ones), an unknown
        alignment, ``n < 1``, ``half`` for a library with neither float16 nor
        bfloat16, or ``empty_rows`` with nothing that can empty a row.
    TypeError
        `xp` is not an array namespace, or `fn` is not callable.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import scaled_dot_product_attention
    >>> report = conformance(scaled_dot_product_attention, xp=np, n=20)
    >>> report.ok, report.n
    (True, 20)
    """
    if not callable(fn):
        msg = f"`fn` must be callable, got {type(fn).__name__}"
        raise TypeError(msg)
    requested = _requested(features)
    if causal_alignment not in ALIGNMENTS:
        msg = f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}"
        raise ValueError(msg)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        msg = f"n must be an integer >= 1, got {n!r}"
        raise ValueError(msg)
    if "empty_rows" in requested and not _empty_row_makers(requested, causal_alignment):
        msg = (
            "'empty_rows' needs a feature that can leave a row with no key: 'mask', 'bias', "
            "'kv_lengths', or 'lq_ne_lk' with 'window' (or with 'causal', bottom-right)"
        )
        raise ValueError(msg)
    backend = _backend_of(xp)
    half = [d for d in ("float16", "bfloat16") if kind_supports(backend.kind, d)]
    if "half" in requested and not half:
        msg = f"'half' was requested but {backend.family} has neither float16 nor bfloat16"
        raise ValueError(msg)
    rng = np.random.default_rng(seed)
    counts = {f: [0, 0] for f in requested}
    failures = []
    for index in range(int(n)):
        case = _draw(rng, index, requested, causal_alignment, half)
        exact, outcome = _run(fn, backend, case, causal_alignment)
        for f in case.features:
            counts[f][0] += 1
            counts[f][1] += outcome.failed
        if outcome.failed:
            original = _shapes(exact.q, exact.k, exact.v)
            small, result = _shrink(fn, backend, exact, outcome, causal_alignment)
            failures.append(_failure(small, result, original))
    failures.sort(key=lambda f: (f.lq * f.lk, _size_of(f), f.case))
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return ConformanceReport(
        features={f: (run, bad) for f, (run, bad) in counts.items()},
        failures=failures,
        n=int(n),
        seed=seed,
        causal_alignment=causal_alignment,
        target=f"{name} on {backend.family} {backend.version}",
    )


def _size_of(f: ConformanceFailure) -> int:
    return int(f.query.size + f.key.size + f.value.size)


def _requested(features: Iterable[str] | None) -> list[str]:
    """Return the requested features in :data:`FEATURES` order (unknown: ValueError)."""
    if features is None:
        return list(FEATURES)
    if isinstance(features, str):
        features = [features]
    names = list(features)
    unknown = [name for name in names if name not in FEATURES]
    if unknown:
        msg = (
            f"unknown feature{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; choose from {', '.join(FEATURES)}"
        )
        raise ValueError(msg)
    return [name for name in FEATURES if name in names]
