"""Every argument check of the package, and its message.

Every message names the argument, the axis and both shapes or dtypes, so a bad
call fails here with a readable error instead of deep inside a backend: a wrong
type is a TypeError, a wrong value a ValueError. The checks only read static
metadata (shapes, dtypes, Python scalars): they never look at array values, so
they are cheap and safe under ``jax.jit``. The one exception is a `scale` or
`softcap` given as a 0-d array: its single value is checked when it is concrete
(:func:`check_scalar_option`), never when it is traced or lazy.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from ._compat import array_namespace, device, has_concrete_values, to_host
from ._masks import arange

__all__ = [
    "array_or_none",
    "broadcast_batch_shapes",
    "check_alibi_slopes",
    "check_attention_arrays",
    "check_block_size",
    "check_bias_dtype",
    "check_broadcastable_to",
    "check_count",
    "check_dropout",
    "check_floating",
    "check_given",
    "check_implementation",
    "check_is_causal",
    "check_is_flag",
    "check_keywords",
    "check_layout",
    "check_length_values",
    "check_lengths",
    "check_mask_dtype",
    "check_merge_parts",
    "check_merge_shapes",
    "check_native_route",
    "check_positive_scalar",
    "guarded_rule",
    "check_rule_library",
    "check_same_device",
    "check_scalar_option",
    "check_score_mod",
    "check_segment_ids",
    "check_self_segments",
    "check_sinks",
    "check_sinks_range",
    "check_score_mod_result",
    "check_supported_array",
    "check_window",
]

Shape = tuple[int, ...]

_AXIS_NAMES = {-1: "the feature axis", -2: "the sequence axis", -3: "the head axis"}

#: A `window` side of this many positions or more is unbounded (positions are
#: computed in 32-bit integers on JAX without x64; no sequence is that long).
UNBOUNDED_WINDOW = 2**31 - 1


def _shape(x: Any) -> Shape:
    return tuple(x.shape)


def check_floating(xp: Any, name: str, x: Any) -> None:
    """Raise TypeError unless `x` has a real floating dtype."""
    ml_dtype = isinstance(x, np.ndarray) and x.dtype.kind == "V"  # ml_dtypes' bfloat16, float8
    # one-byte floats (torch / JAX float8): no accumulation contract, no promotion in torch
    float8 = "float" in str(x.dtype) and getattr(x.dtype, "itemsize", 2) < 2
    if ml_dtype or float8 or not xp.isdtype(x.dtype, "real floating"):
        hint = ""
        if float8 and not ml_dtype:
            hint = f"; cast {name} to float16 or bfloat16 (float8 is for storage, not attention)"
        if ml_dtype:
            hint = (
                f"; NumPy has no array-API {x.dtype} (an ml_dtypes type, e.g. from "
                f"np.asarray of a JAX array): pass {name}.astype(np.float32)"
            )
        msg = (
            f"`{name}` must have a real floating dtype (float16, bfloat16, float32 or "
            f"float64), but got dtype {x.dtype}{hint}"
        )
        raise TypeError(msg)


def check_mask_dtype(xp: Any, name: str, x: Any) -> None:
    """Raise TypeError unless `x` is a boolean array; say how to make one of what it is.

    A 0/1 integer mask (a tokenizer's ``attention_mask``) becomes one with ``x != 0``.
    A floating mask may be 0/1 or additive (0 / -inf): the message gives both forms,
    never the other argument alone (a 0/1 array added as a bias hides nothing).
    """
    if xp.isdtype(x.dtype, "bool"):
        return
    meaning = "keep" if name == "dropout_mask" else "may attend"
    msg = f"`{name}` must be a boolean array (True = {meaning}), but got dtype {x.dtype}"
    if xp.isdtype(x.dtype, "integral"):
        msg += (
            f"; a 0/1 integer mask (1 = {meaning}, as tokenizers return `attention_mask`) "
            f"becomes one with `{name} != 0` (torch: `{name}.bool()`, NumPy and JAX: "
            f"`{name}.astype(bool)`)"
        )
    elif xp.isdtype(x.dtype, "real floating"):
        msg += f"; a 0/1 floating mask (1 = {meaning}) becomes one with `{name} != 0`"
        if name == "mask":
            msg += (
                "; an additive mask (0 where a query may attend, -inf or a large negative "
                "number where it may not) is a `bias=` as it is"
            )
    if name == "mask" and x.ndim == 2:
        msg += (
            "; a 2-D mask is read as (Lq, Lk): give a (batch, keys) padding mask its head "
            "and query axes, `[:, None, None, :]`, or pass the valid lengths as `kv_lengths=`"
        )
    raise TypeError(msg)


def check_bias_dtype(xp: Any, bias: Any) -> None:
    """Raise TypeError unless `bias` is floating, saying what a boolean or integer one means.

    A bias is *added* to the logits: a 0/1 padding mask given as a bias (an integer
    array, or one cast to float) hides nothing. A boolean or integer `bias` is refused
    with the mask it most likely is; a real additive bias is cast by the caller.
    """
    if xp.isdtype(bias.dtype, "bool"):
        msg = (
            f"`bias` must have a real floating dtype, but got dtype {bias.dtype}: a boolean "
            "array is a mask (True = may attend): pass it as `mask=` instead"
        )
        raise TypeError(msg)
    if xp.isdtype(bias.dtype, "integral"):
        msg = (
            f"`bias` must have a real floating dtype, but got dtype {bias.dtype}: a bias is "
            "added to the logits, so a 0/1 padding mask given as `bias` (or cast to float) "
            "hides nothing. Pass a 0/1 mask (1 = may attend) as `mask=bias != 0`; cast a "
            "real additive bias to the inputs' floating dtype first"
        )
        raise TypeError(msg)
    check_floating(xp, "bias", bias)


def check_given(name: str, x: Any) -> None:
    """Raise TypeError when a required array argument is None (a newcomer's slip)."""
    if x is None:
        msg = f"`{name}` must be an array, but got None"
        raise TypeError(msg)


def _check_rank(name: str, x: Any) -> None:
    check_given(name, x)
    if x.ndim < 2:
        msg = (
            f"`{name}` must have at least 2 dimensions (..., L, D), "
            f"but got shape {_shape(x)} with {x.ndim} dimension(s)"
        )
        raise ValueError(msg)


def _check_same(
    axis: int, name_a: str, a: Shape, name_b: str, b: Shape, what: str, hint: str = ""
) -> None:
    if a[axis] != b[axis]:
        msg = (
            f"`{name_a}` and `{name_b}` must have the same size on axis {axis} "
            f"({_AXIS_NAMES[axis]}, {what}), but got {name_a} shape {a} and {name_b} "
            f"shape {b}{hint}"
        )
        raise ValueError(msg)


def broadcast_batch_shapes(named: Sequence[tuple[str, Shape]]) -> Shape:
    """Broadcast the leading batch shapes of several arguments, naming them on failure.

    Parameters
    ----------
    named : sequence of (str, tuple of int)
        Pairs of argument name and its batch shape (the axes before the head axis).

    Returns
    -------
    tuple of int
        The broadcast batch shape.
    """
    ndim = max(len(s) for _, s in named)
    out: list[int] = [1] * ndim
    owner: list[str | None] = [None] * ndim
    for name, shape in named:
        for i, n in enumerate(shape, start=ndim - len(shape)):
            if n == 1 or n == out[i]:
                continue
            if out[i] == 1:
                out[i], owner[i] = n, name
                continue
            other = owner[i]
            other_shape = dict(named)[other] if other is not None else ()
            msg = (
                f"batch dimensions of `{other}` and `{name}` are not broadcastable: "
                f"axis {i - ndim} of the batch shape is {out[i]} in {other} batch shape "
                f"{other_shape} and {n} in {name} batch shape {shape}"
            )
            raise ValueError(msg)
    return tuple(out)


def check_broadcastable_to(name: str, x: Any, target: Shape, target_desc: str) -> None:
    """Raise ValueError unless `x` broadcasts to `target` without changing its shape.

    A mask or bias may only be *expanded* to the logits shape: extra leading axes
    or sizes that would enlarge the result are rejected rather than silently
    broadcast into a different batch shape.
    """
    shape = _shape(x)
    ok = len(shape) <= len(target) and all(
        n in (1, t) for n, t in zip(shape[::-1], target[::-1], strict=False)
    )
    if not ok:
        bad = next(
            (
                -i
                for i, (n, t) in enumerate(zip(shape[::-1], target[::-1], strict=False), start=1)
                if n not in (1, t)
            ),
            -(len(target) + 1),
        )
        msg = (
            f"`{name}` with shape {shape} is not broadcastable to the {target_desc} shape "
            f"{target} (first mismatch on axis {bad})"
        )
        if len(shape) == 2 and len(target) >= 4 and shape == (target[0], target[-1]):
            msg += (
                f"; a (batch, keys) padding mask, as Hugging Face passes one? give it its "
                f"head and query axes, `{name}[:, None, None, :]`, or pass the valid "
                "lengths as `kv_lengths=`"
            )
        raise ValueError(msg)


def check_positive_scalar(name: str, value: Any, finfo: Any = None) -> float:
    """Return `value` as a float, raising unless it is a finite number > 0.

    With `finfo` (of the compute dtype), the number must also be a normal
    number of that dtype: ``1e308`` is finite in float64 but overflows float32.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        kind = type(value).__name__
        msg = f"`{name}` must be a positive real number, but got {value!r} of type {kind}"
        raise TypeError(msg)
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        msg = f"`{name}` must be a finite number > 0, but got {value!r}"
        raise ValueError(msg)
    if finfo is not None and not float(finfo.smallest_normal) <= value <= float(finfo.max):
        msg = (
            f"`{name}` = {value!r} is outside the normal range "
            f"[{float(finfo.smallest_normal):.3g}, {float(finfo.max):.3g}] of the compute dtype "
            f"{finfo.dtype}: it would overflow or underflow there"
        )
        raise ValueError(msg)
    return value


def array_or_none(value: Any) -> Any:
    """`value` if it is an array (not a Python or NumPy number), else None."""
    if value is None or isinstance(value, numbers.Number) or not hasattr(value, "shape"):
        return None
    return value


def check_scalar_option(
    xp: Any, name: str, value: Any, compute_dtype: Any, *, read: Any | None
) -> Any:
    """Validate `scale` or `softcap`: a real number, or a 0-d floating array (a learned one).

    A number comes back as a float (checked by :func:`check_positive_scalar`). A
    0-d array of the inputs' library comes back cast to `compute_dtype`, so
    gradients flow to it; its value is checked (finite, > 0, in the normal
    range of the compute dtype) when `read` is given: the function that reads
    a concrete array's value as a float (None for a tracer under ``jax.jit``
    or ``torch.compile`` and for a lazy Dask array).
    """
    finfo = xp.finfo(compute_dtype)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return check_positive_scalar(name, value, finfo)
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        kind = type(value).__name__
        msg = (
            f"`{name}` must be a positive real number or a 0-d floating array, "
            f"but got {value!r} of type {kind}"
        )
        raise TypeError(msg)
    if tuple(value.shape) != ():
        msg = (
            f"`{name}` must be a number or a 0-d array (one value for the whole call), "
            f"but got an array of shape {tuple(value.shape)}"
        )
        raise ValueError(msg)
    if not xp.isdtype(value.dtype, "real floating"):
        msg = f"`{name}` must be a floating array, but got dtype {value.dtype}"
        raise TypeError(msg)
    if read is not None:  # finite, > 0 and in the normal range of the compute dtype
        check_positive_scalar(name, read(value), finfo)
    return xp.astype(value, compute_dtype, copy=False)


def check_window(window: Any) -> tuple[int | None, int | None]:
    """Validate ``window=(left, right)`` and return it as a tuple."""
    if not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2:
        msg = (
            "`window` must be a pair (left, right) of non-negative integers or None, "
            f"but got {window!r}"
        )
        raise TypeError(msg)
    out: list[int | None] = []
    for side, w in zip(("left", "right"), window, strict=True):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            msg = f"`window` {side} entry must be an integer or None, but got {w!r}"
            raise TypeError(msg)
        w = int(w)
        if w < 0:
            msg = f"`window` {side} entry must be >= 0, but got {w!r}"
            raise ValueError(msg)
        # a side at least as long as any sequence restricts nothing: unbounded
        out.append(None if w >= UNBOUNDED_WINDOW else w)
    return out[0], out[1]


def check_attention_arrays(query: Any, key: Any, value: Any | None) -> tuple[Shape, Shape, Shape]:
    """Check ranks and the axes that must agree between query, key and value.

    2-D inputs ``(L, D)`` are read as one head; the returned shapes have the head
    axis made explicit (``(1, L, D)`` for a 2-D input).

    Returns
    -------
    (q_shape, k_shape, v_shape) : tuple of tuple of int
        The shapes with a head axis; ``v_shape`` is ``k_shape`` when `value` is None.
    """
    _check_rank("query", query)
    _check_rank("key", key)
    q = _shape(query) if query.ndim > 2 else (1, *_shape(query))
    k = _shape(key) if key.ndim > 2 else (1, *_shape(key))
    _check_same(-1, "query", _shape(query), "key", _shape(key), "Dk")
    v = k
    if value is not None:
        _check_rank("value", value)
        v = _shape(value) if value.ndim > 2 else (1, *_shape(value))
        _check_same(-2, "key", _shape(key), "value", _shape(value), "Lk", _LAYOUT)
        _check_same(-3, "key", k, "value", v, "Hkv", _LAYOUT)
    if q[-1] == 0:
        msg = (
            "`query` and `key` must have at least one feature on axis -1 (Dk), but got "
            f"query shape {_shape(query)} and key shape {_shape(key)}"
        )
        raise ValueError(msg)
    q_from, kv_from = f"from query shape {_shape(query)}", f"key shape {_shape(key)}"
    check_groups(q[-3], k[-3], q_from, kv_from, axis=" (axis -3)", hint=_LAYOUT)
    return q, k, v


def check_groups(
    hq: int, hkv: int, q_from: str, kv_from: str, *, axis: str = "", hint: str = ""
) -> None:
    """Grouped-query attention: the query heads a multiple of the key/value heads.

    `q_from` and `kv_from` say where each count comes from (a shape, an argument),
    `axis` which axis holds the heads.
    """
    if hkv == 0 or hq % hkv:
        msg = (
            f"the number of `query` heads must be a multiple of the number of `key`/`value` "
            f"heads{axis}: got Hq={hq} {q_from} and Hkv={hkv} from {kv_from}{hint}"
        )
        raise ValueError(msg)


#: the hint of a shape error that a (B, L, H, D) layout would give
_LAYOUT = (
    "; the library takes (B..., H, L, D): arrays laid out (B, L, H, D), as flash-attn and "
    "Hugging Face projections give them, need `layout='blhd'` (or `x.transpose(1, 2)` "
    "in torch, `jnp.swapaxes(x, 1, 2)` in JAX, first)"
)

#: the axis orders of Q, K, V (and the output) that the public functions take
LAYOUTS = ("bhld", "blhd")


def check_layout(layout: Any) -> str:
    """Return `layout` if it is "bhld" or "blhd" (the order of the last three axes)."""
    if isinstance(layout, str) and layout in LAYOUTS:
        return layout
    msg = (
        f"`layout` must be 'bhld' (query, key and value shaped (B..., H, L, D), the "
        f"default) or 'blhd' ((B..., L, H, D), as flash-attn takes them), but got {layout!r}"
    )
    if isinstance(layout, str):
        raise ValueError(msg)
    raise TypeError(msg)


def check_is_causal(is_causal: Any) -> bool:
    """Return `is_causal` as a bool (a NumPy bool too); TypeError for anything else."""
    return check_is_flag("is_causal", is_causal)


def check_is_flag(name: str, flag: Any) -> bool:
    """Return a True/False argument as a bool (a NumPy bool too); TypeError otherwise."""
    if not isinstance(flag, (bool, np.bool_)):
        msg = f"`{name}` must be True or False, but got {flag!r}"
        raise TypeError(msg)
    return bool(flag)


def check_lengths(xp: Any, name: str, x: Any, batch: Shape) -> None:
    """`q_lengths` / `kv_lengths`: an integer array broadcastable to the batch shape."""
    if not xp.isdtype(x.dtype, "integral"):
        msg = f"`{name}` must be an integer array of valid lengths, but got dtype {x.dtype}"
        raise TypeError(msg)
    check_broadcastable_to(name, x, batch, "batch")


def check_length_values(name: str, values: Any, limit: int, axis: str) -> None:
    """Lengths read on the host: each in ``[0, limit]`` (the axis they count positions of)."""
    bad = sorted(n for n in values if not 0 <= n <= limit)
    if bad:
        msg = (
            f"`{name}` must hold valid prefix lengths of the {axis} axis, each in "
            f"[0, {limit}], but got {bad[0]}"
        )
        raise ValueError(msg)


def check_alibi_slopes(xp: Any, slopes: Any, batch: Shape, num_q_heads: int) -> None:
    """`alibi_slopes`: floating, broadcastable to (..., Hq), ending with the head axis."""
    check_floating(xp, "alibi_slopes", slopes)
    check_broadcastable_to("alibi_slopes", slopes, (*batch, num_q_heads), "(..., Hq) heads")
    if slopes.ndim == 0 or slopes.shape[-1] not in (1, num_q_heads):
        msg = (
            f"`alibi_slopes` must end with the head axis Hq={num_q_heads} (or 1), "
            f"but has shape {tuple(slopes.shape)}"
        )
        raise ValueError(msg)


def check_sinks(xp: Any, sinks: Any, batch: Shape, num_q_heads: int) -> None:
    """`sinks`: floating, broadcastable to (..., Hq): one extra logit per head."""
    check_floating(xp, "sinks", sinks)
    check_broadcastable_to("sinks", sinks, (*batch, num_q_heads), "(..., Hq) heads")


def check_sinks_range(overflows: bool, sinks: Any, compute_dtype: Any) -> None:
    """Finite sinks that the cast to the compute dtype turns into ``inf`` (1e39 in float32)."""
    if overflows:
        msg = (
            f"`sinks` ({sinks.dtype}) has finite values beyond the range of the compute "
            f"dtype {compute_dtype}: they would become inf there"
        )
        raise ValueError(msg)


def check_segment_ids(xp: Any, name: str, x: Any, batch: Shape, length: int, what: str) -> None:
    """`q_segment_ids` / `kv_segment_ids`: integers (..., L) whose batch dims broadcast."""
    if not xp.isdtype(x.dtype, "integral"):
        msg = f"`{name}` must be an integer array of segment ids, but got dtype {x.dtype}"
        raise TypeError(msg)
    if x.ndim == 0 or x.shape[-1] != length:
        msg = (
            f"`{name}` must have shape (..., {what}) with {what}={length} on its last axis, "
            f"but got shape {_shape(x)}"
        )
        raise ValueError(msg)
    check_broadcastable_to(name, x, (*batch, length), f"(..., {what})")


def check_self_segments(name: str, given: str, q_len: int, kv_len: int) -> None:
    """One segment-id array serves both sides only for self-attention (Lq == Lk)."""
    if q_len != kv_len:
        msg = (
            f"only `{given}` was given, so it is used for `{name}` too, which needs "
            f"Lq == Lk, but got Lq={q_len} and Lk={kv_len}: pass both segment-id arrays"
        )
        raise ValueError(msg)


def check_merge_parts(outs: Any, lses: Any) -> tuple[list[Any], list[Any]]:
    """`merge_attention`: two sequences of arrays, as many lses as outputs, at least one."""
    parts = []
    for name, seq in (("outs", outs), ("lses", lses)):
        if not isinstance(seq, Sequence) or isinstance(seq, str) or hasattr(seq, "shape"):
            msg = (
                f"`{name}` must be a sequence (list or tuple) of arrays, one per part, "
                f"but got {type(seq).__name__}"
            )
            raise TypeError(msg)
        for i, x in enumerate(seq):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                got = "None" if x is None else type(x).__name__
                msg = f"`{name}[{i}]` must be an array, but got {got}"
                raise TypeError(msg)
        parts.append(list(seq))
    if not parts[0]:
        msg = "`outs` and `lses` must hold at least one part, but both are empty"
        raise ValueError(msg)
    if len(parts[0]) != len(parts[1]):
        msg = (
            f"`outs` and `lses` must have one entry per part, but got {len(parts[0])} "
            f"outputs and {len(parts[1])} lses"
        )
        raise ValueError(msg)
    return parts[0], parts[1]


def check_merge_shapes(outs: list[Any], lses: list[Any]) -> None:
    """Every output (..., Lq, Dv) alike, and each lse shaped like its output without Dv."""
    first = _shape(outs[0])
    if len(first) < 2:
        msg = f"`outs[0]` must have shape (..., Lq, Dv), but got shape {first}"
        raise ValueError(msg)
    for i, (out, lse) in enumerate(zip(outs, lses, strict=True)):
        if _shape(out) != first:
            msg = (
                f"every part's output must have one shape: `outs[{i}]` has shape "
                f"{_shape(out)} but `outs[0]` has shape {first}"
            )
            raise ValueError(msg)
        if _shape(lse) != first[:-1]:
            msg = (
                f"`lses[{i}]` must have the shape of `outs[{i}]` without its last axis (Dv), "
                f"{first[:-1]}, but got shape {_shape(lse)}"
            )
            raise ValueError(msg)


def check_score_mod(score_mod: Any) -> None:
    """`score_mod`: None or a callable."""
    if score_mod is not None and not callable(score_mod):
        msg = f"`score_mod` must be callable, but got {type(score_mod).__name__}"
        raise TypeError(msg)


def check_mask_mod(
    mask_mod: Any,
    *,
    name: str = "mask_mod",
    signature: str = "mask_mod(batch, head, q_idx, kv_idx)",
) -> None:
    """`mask_mod`: None or a callable `signature` ``-> bool array``."""
    if mask_mod is not None and not callable(mask_mod):
        msg = f"`{name}` must be callable as {signature}, but got {type(mask_mod).__name__}"
        raise TypeError(msg)


def check_mask_mod_result(xp: Any, result: Any, target: Shape) -> None:
    """Check that `mask_mod` returned a bool array broadcastable to the block (..., H, bq, bk)."""
    if not hasattr(result, "shape") or not hasattr(result, "dtype"):
        msg = (
            f"`mask_mod` must return a boolean array broadcastable to {tuple(target)}, "
            f"but returned {type(result).__name__} {result!r}"
        )
        raise TypeError(msg)
    check_rule_library("mask_mod", xp, result)
    if result.dtype != xp.bool:
        msg = (
            f"`mask_mod` must return a boolean array (True = may attend), but returned "
            f"dtype {result.dtype}"
        )
        raise TypeError(msg)
    check_broadcastable_to("the result of `mask_mod`", result, tuple(target), "the block")


def guarded_rule(name: str, rule: Any) -> Any:
    """`rule` (a `mask_mod` or `score_mod`) raising a clear TypeError for Python logic on arrays.

    ``q_idx >= kv_idx and ...`` or ``if ...`` asks for the truth value of an index array:
    NumPy, torch and JAX each refuse it in their own words.
    """

    def called(*args: Any) -> Any:
        try:
            return rule(*args)
        except Exception as error:
            text = f"{type(error).__name__}: {error}"
            words = ("ambiguous", "TracerBool", "bool is only allowed on arrays with 0")
            if not any(w in text for w in words):  # NumPy, torch, JAX, array-api-strict
                raise
            index = "(batch, head, q_idx, kv_idx)" if name == "mask_mod" else "(scores, ...)"
            msg = (
                f"`{name}` used Python `and`, `or`, `not` or `if` on its arguments {index}, "
                "which are arrays (q_idx (1..., bq, 1), kv_idx (1..., 1, bk): one block of "
                "positions at a time): write it with `&`, `|`, `~` and `xp.where` instead"
            )
            raise TypeError(msg) from error

    return called


def check_rule_library(name: str, xp: Any, result: Any) -> None:
    """Raise where a rule (`mask_mod`, `score_mod`) returned an array of another library.

    Its index arrays are `xp`'s: a rule that closes over arrays of another library
    (built for torch, evaluated with NumPy's indices) returns theirs.
    """
    import array_api_compat

    try:
        found = array_api_compat.array_namespace(result)
    except TypeError:
        return  # not an array at all: the caller's message says so
    if found is not xp:
        msg = (
            f"`{name}` returned an array of {getattr(found, '__name__', found)}, but it is "
            f"evaluated with {getattr(xp, '__name__', xp)} index arrays: the rule was written "
            "for another library (it closes over that library's arrays). Build the block "
            "mask with that library's namespace (`create_block_mask(..., xp=torch)`), or "
            "close over arrays of the call's library"
        )
        raise TypeError(msg)


def check_block_pair(name: str, value: Any, default: int) -> tuple[int, int]:
    """Check an int or a pair of positive ints (None: `default` for both)."""
    if value is None:
        return default, default
    sizes = value if isinstance(value, tuple) and len(value) == 2 else (value, value)
    return check_count(name, sizes[0], minimum=1), check_count(name, sizes[1], minimum=1)


def check_block_mask(
    block_mask: Any,
    mask_mod: Any,
    batch: Shape,
    num_q_heads: int,
    q_len: int,
    kv_len: int,
    *,
    kind: type,
) -> None:
    """Check that `block_mask` is a BlockMask built for this call's lengths, batch, heads."""
    if not isinstance(block_mask, kind):
        msg = (
            "`block_mask` must be a BlockMask (portable_attn.block_mask.create_block_mask), "
            f"but got {type(block_mask).__name__}"
        )
        raise TypeError(msg)
    block_mask = cast(Any, block_mask)
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        msg = (
            "got both `mask_mod` and a `block_mask` built from another mask_mod: pass the "
            "block mask alone (it carries its mask_mod), or combine them with and_masks "
            "before create_block_mask"
        )
        raise ValueError(msg)
    b, h, lq, lk = block_mask.shape
    if (lq, lk) != (q_len, kv_len):
        msg = (
            f"`block_mask` was built for (Lq, Lk) = ({lq}, {lk}), but `query` axis -2 has "
            f"Lq={q_len} and `key` axis -2 has Lk={kv_len}"
        )
        raise ValueError(msg)
    n = math.prod(batch)
    if b not in (1, n):
        msg = (
            f"`block_mask` was built for batch={b}, but the call has {n} sequences "
            f"(batch shape {tuple(batch)}): build it with batch={n} or None"
        )
        raise ValueError(msg)
    if h not in (1, num_q_heads):
        msg = (
            f"`block_mask` was built for heads={h}, but `query` axis -3 has Hq={num_q_heads}: "
            f"build it with heads={num_q_heads} or None"
        )
        raise ValueError(msg)


def check_dropout(dropout_p: Any, dropout_mask: Any | None) -> float:
    """`dropout_p` in [0, 1), given together with a `dropout_mask` exactly when > 0."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        msg = f"`dropout_p` must be a float in [0, 1), but got {dropout_p!r}"
        raise TypeError(msg)
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        msg = f"`dropout_p` must be in [0, 1), but got {dropout_p!r}"
        raise ValueError(msg)
    if (dropout_p > 0) != (dropout_mask is not None):
        given = "None" if dropout_mask is None else "an array"
        msg = (
            "`dropout_p` > 0 needs a `dropout_mask` (a boolean keep-mask from your own "
            "random generator) and a `dropout_mask` needs `dropout_p` > 0; got "
            f"dropout_p={dropout_p!r} and dropout_mask={given}"
        )
        raise ValueError(msg)
    return float(dropout_p)


def check_block_size(block_size: Any) -> str | tuple[int, int]:
    """Check `block_size`: None or "auto" give "auto", "dense" stays, an int gives a pair."""
    if block_size is None:
        return "auto"
    if isinstance(block_size, str) and block_size in ("auto", "dense"):
        return block_size
    sizes = block_size if isinstance(block_size, tuple) and len(block_size) == 2 else None
    sizes = sizes or (block_size, block_size)
    msg = (
        "`block_size` must be None, 'auto', 'dense', a positive integer or a pair "
        f"(block_q, block_k) of positive integers, but got {block_size!r}"
    )
    if not all(_is_int(n) for n in sizes):
        raise TypeError(msg)
    if not all(n >= 1 for n in sizes):
        raise ValueError(msg)
    return int(sizes[0]), int(sizes[1])


def _is_int(n: Any) -> bool:
    """Tell whether `n` is a Python or NumPy integer (not a bool)."""
    return isinstance(n, numbers.Integral) and not isinstance(n, (bool, np.bool_))


def check_implementation(implementation: Any) -> None:
    """Check that `implementation` is None, "portable" or "native"."""
    if implementation not in (None, "portable", "native"):
        msg = f"`implementation` must be None, 'portable' or 'native', but got {implementation!r}"
        raise ValueError(msg)


def check_native_route(reason: str | None) -> None:
    """Raise for ``implementation="native"`` when the kernel cannot express the call."""
    if reason is not None:
        msg = f"implementation='native': {reason}; use implementation=None or 'portable'"
        raise ValueError(msg)


def per_head(x: Any) -> bool:
    """Whether a sinks or slopes term (..., Hq|1, 1, 1) holds one value per head alone."""
    return x is None or math.prod(x.shape[:-3]) == 1


def check_invariant_call(call: Any, implementation: Any, sizes: Any, task_graphs: bool) -> None:
    """Raise for what ``batch_invariant=True`` (the paged walk) cannot take, by name."""
    terms = call.terms
    sinks = terms.sinks
    given_sinks = None if sinks is None else tuple(sinks.shape[:-2])  # the caller's shape
    refused = {
        "implementation='native'": implementation == "native",
        f"block_size={sizes!r} (the walk's tiles are fixed)": sizes != "auto",
        "dropout (`dropout_p` or `dropout_mask`)": terms.dropout_keep is not None,
        f"`sinks` that differ by sequence (shape {given_sinks}; give one per head, "
        f"shape (Hq,) = ({call.plan.num_q_heads},))": not per_head(sinks),
        "a `block_mask` without its mask_mod": terms.block_states is not None
        and terms.mask_mod is None,
        "Dask arrays (the walk takes one device's arrays)": task_graphs,
    }
    for what, given in refused.items():
        if given:
            msg = f"batch_invariant=True does not take {what}"
            raise ValueError(msg)


def check_keywords(caller: str, given: Any, known: Sequence[str]) -> None:
    """Raise TypeError naming a keyword argument that `caller` does not take."""
    unknown = [name for name in given if name not in known]
    if unknown:
        msg = (
            f"{caller}() got unknown keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"it takes {', '.join(known)}"
        )
        raise TypeError(msg)


def check_count(name: str, n: Any, *, minimum: int) -> int:
    """Check that `n` is a whole number (a size or a count) of at least `minimum`.

    A Python or NumPy integer; a wrong type is a TypeError, a wrong value a ValueError.
    """
    kind = "non-negative" if minimum == 0 else ("positive" if minimum == 1 else f">= {minimum}")
    if not _is_int(n):
        msg = f"`{name}` must be a {kind} integer, but got {n!r} of type {type(n).__name__}"
        raise TypeError(msg)
    if n < minimum:
        msg = f"`{name}` must be a {kind} integer, but got {n!r}"
        raise ValueError(msg)
    return int(n)


def check_supported_array(name: str, x: Any) -> None:
    """Reject array kinds the computation would silently misread.

    NumPy masked arrays (their mask would be ignored: pass it as `mask=`),
    sparse torch tensors, and Dask arrays of unknown (NaN) sizes.
    """
    if isinstance(x, np.ma.MaskedArray):
        msg = (
            f"`{name}` is a NumPy masked array, whose mask attention would ignore: pass "
            f"np.ma.getdata({name}) and the positions to attend as a boolean `mask=`"
        )
        raise TypeError(msg)
    if getattr(x, "is_sparse", False) or str(getattr(x, "layout", "")).startswith("torch.sparse"):
        msg = f"`{name}` is a sparse tensor ({x.layout}); pass a dense (strided) one"
        raise TypeError(msg)
    # torch.export's dynamic dimensions are SymInts (symbolic sizes): taken as sizes
    if any(not isinstance(n, int) and type(n).__name__ != "SymInt" for n in x.shape):
        if type(x.shape).__name__ == "Size":  # torch.jit.trace: sizes are traced tensors
            msg = (
                f"`{name}` has sizes that are tensors: torch.jit.trace records shapes as "
                "tensors, which this library does not trace; use torch.compile, "
                "torch.export or torch.fx (make_fx)"
            )
            raise TypeError(msg)
        msg = (
            f"`{name}` has unknown sizes {tuple(x.shape)} (a Dask array whose chunk sizes "
            "are not known): call `.compute_chunk_sizes()` on it first"
        )
        raise ValueError(msg)


def check_same_device(named: Any, reference: str, ref_device: Any, device_of: Any) -> None:
    """Check that every array of `named` (name -> array or None) is on `ref_device`."""
    for name, x in named.items():
        if x is None or name == reference:
            continue
        dev = device_of(x)
        if dev is not None and dev != ref_device:
            msg = (
                f"`{name}` is on device {dev} but `{reference}` is on device {ref_device}; "
                "move them to one device first"
            )
            raise ValueError(msg)


def check_score_mod_result(xp: Any, result: Any, scores: Any) -> None:
    """Check what `score_mod` returned: a floating array of exactly the scores' shape."""
    if not hasattr(result, "shape") or not hasattr(result, "dtype"):
        msg = (
            "`score_mod` must return an array shaped like its `scores` argument "
            f"{tuple(scores.shape)}, but returned {type(result).__name__} {result!r}"
        )
        raise TypeError(msg)
    if not xp.isdtype(result.dtype, "real floating"):
        msg = (
            "`score_mod` must return floating scores, but returned dtype "
            f"{result.dtype} (a boolean would be used as 0/1 scores: mask with `mask=` "
            "or return `where(keep, scores, -inf)`)"
        )
        raise TypeError(msg)
    if tuple(result.shape) != tuple(scores.shape):
        msg = (
            f"`score_mod` must return the shape of its `scores` argument {tuple(scores.shape)}, "
            f"but returned shape {tuple(result.shape)}"
        )
        raise ValueError(msg)


# ---------------------------------------------------------------------------
# packed and paged calls (serving.py)


def check_paged(
    xp: Any,
    key_pages: Any,
    value_pages: Any,
    page_table: Any,
    kv_lengths: Any,
    q_starts: Any,
    value_dim: Any = None,
) -> tuple[int, int, int, int, int, int]:
    """Check the pools and the metadata; return P, page_size, Hkv, Dv, R, max_pages.

    ``value_pages=None``: the values are the first `value_dim` features of the keys.
    """
    layout = "(P, page_size, Hkv, Dk)"
    n_pages, page_size, hkv, dk = _check_pool(xp, "key_pages", key_pages, layout)
    if value_pages is None:
        dv = dk if value_dim is None else check_count("value_dim", value_dim, minimum=1)
        if dv > dk:
            msg = (
                f"`value_dim` ({dv}) must be at most the keys' features (Dk = {dk}, axis 3 "
                f"of `key_pages` shape {tuple(key_pages.shape)}): with `value_pages=None` the "
                "values are the first `value_dim` features of the keys"
            )
            raise ValueError(msg)
    else:
        dv = _check_pool(xp, "value_pages", value_pages, "(P, page_size, Hkv, Dv)")[3]
        _check_same_axes(
            "key_pages",
            key_pages,
            "value_pages",
            value_pages,
            (0, 1, 2),
            ("P", "page_size", "Hkv"),
        )
        if value_dim is not None and check_count("value_dim", value_dim, minimum=1) != dv:
            msg = (
                f"`value_dim` ({value_dim}) is for `value_pages=None`; given `value_pages` of "
                f"shape {tuple(value_pages.shape)}, Dv is its axis 3 ({dv})"
            )
            raise ValueError(msg)
    n_req, max_pages = check_integer_array(xp, "page_table", page_table, 2, "(R, max_pages)")
    check_integer_array(xp, "kv_lengths", kv_lengths, 1, "(R,)", (n_req,), "page_table")
    check_integer_array(xp, "q_starts", q_starts, 1, "(R + 1,)", (n_req + 1,), "page_table")
    return n_pages, page_size, hkv, dv, n_req, max_pages


def check_exact_rank(xp: Any, name: str, x: Any, ndim: int, layout: str) -> tuple[int, ...]:
    if x.ndim != ndim:
        msg = f"`{name}` must have shape {layout}, but got shape {tuple(x.shape)}"
        raise ValueError(msg)
    check_floating(xp, name, x)
    return tuple(int(n) for n in x.shape)


def _check_pool(xp: Any, name: str, x: Any, layout: str) -> tuple[int, ...]:
    shape = check_exact_rank(xp, name, x, 4, layout)
    if shape[1] < 1 or shape[2] < 1:
        msg = f"`{name}` must have pages of at least one slot and one head, but got shape {shape}"
        raise ValueError(msg)
    return shape


def check_same_axis(a: str, x: Any, ax: int, b: str, y: Any, ay: int, what: str) -> None:
    if x.shape[ax] != y.shape[ay]:
        msg = (
            f"`{a}` axis {ax} and `{b}` axis {ay} ({what}) must agree, but got {a} shape "
            f"{tuple(x.shape)} and {b} shape {tuple(y.shape)}"
        )
        raise ValueError(msg)


def _check_same_axes(
    a: str, x: Any, b: str, y: Any, axes: tuple[int, ...], what: tuple[str, ...]
) -> None:
    for ax, w in zip(axes, what, strict=True):
        check_same_axis(a, x, ax, b, y, ax, w)


def check_head_groups(query: Any, keys: Any, hq: int, hkv: int) -> None:
    """Grouped-query attention of a packed call: Hq a multiple of Hkv (axis 1 of both)."""
    q_from, kv_from = f"from `query` shape {tuple(query.shape)}", f"shape {tuple(keys.shape)}"
    check_groups(hq, hkv, q_from, kv_from, axis=" (axis 1)")


def check_integer_array(
    xp: Any,
    name: str,
    x: Any,
    ndim: int,
    layout: str,
    shape: tuple[int, ...] | None = None,
    other: str = "",
) -> tuple[int, ...]:
    if not hasattr(x, "dtype") or not xp.isdtype(x.dtype, "integral"):
        got = getattr(x, "dtype", type(x).__name__)
        msg = f"`{name}` must be an integer array of shape {layout}, but got {got}"
        raise TypeError(msg)
    if x.ndim != ndim or (shape is not None and tuple(x.shape) != shape):
        msg = f"`{name}` must have shape {layout}, but got shape {tuple(x.shape)}"
        if shape is not None:
            msg += f" (R = {shape[0] if layout != '(R + 1,)' else shape[0] - 1} from `{other}`)"
        raise ValueError(msg)
    return tuple(int(n) for n in x.shape)


def check_positions(xp: Any, q_positions: Any, query: Any, t: int = 0) -> None:
    """Check a paged call's `q_positions`: None, or integers (T,), T from `query` or `t`."""
    if q_positions is None:
        return
    check_integer_array(xp, "q_positions", q_positions, 1, "(T,)")
    if query is not None:
        check_same_axis("query", query, 0, "q_positions", q_positions, 0, "T")
    elif q_positions.shape[0] != t:
        msg = (
            f"`q_positions` must have shape (T,) = ({t},) (`num_tokens`), but got shape "
            f"{tuple(q_positions.shape)}"
        )
        raise ValueError(msg)


def check_head_vector(xp: Any, x: Any, name: str, hq: int) -> None:
    if x is None:
        return
    check_floating(xp, name, x)
    if tuple(x.shape) != (hq,):
        msg = f"`{name}` must have shape (Hq,) = ({hq},), but got shape {tuple(x.shape)}"
        raise ValueError(msg)


def check_one_device(**named: Any) -> None:
    """Every array on one device (traced arrays, whose device is None, are not compared)."""
    placed = [n for n, x in named.items() if x is not None and device(x) is not None]
    if placed:
        check_same_device(named, placed[0], device(named[placed[0]]), device)


def check_lse_base(base: Any) -> float:
    """Check `lse_base` (a finite number above 0 other than 1); return ``ln(base)``."""
    if not isinstance(base, (int, float)) or isinstance(base, bool):
        msg = f"`lse_base` must be a Python number (e, 2), but got {type(base).__name__}"
        raise TypeError(msg)
    if not math.isfinite(base) or base <= 0 or base == 1:
        msg = f"`lse_base` must be a finite number above 0 other than 1 (e, 2), but got {base!r}"
        raise ValueError(msg)
    return 1.0 if base == math.e else math.log(base)


def check_starts(name: str, starts: Any, limit: int) -> Any:
    """Check `starts` on the host (when it has values): 0 first, nondecreasing, <= limit."""
    if not has_concrete_values(starts):
        return None
    v = np.asarray(to_host(starts), dtype=np.int64)
    if starts_fault(np, v, limit):
        msg = (
            f"`{name}` must start at 0, never decrease and end at most at {limit} (axis 0 of "
            f"the packed array), but got {v.tolist()}"
        )
        raise ValueError(msg)
    return v


def check_paged_metadata(
    q_starts: Any,
    kv_lengths: Any,
    page_table: Any,
    t: int,
    n_pages: int,
    page_size: int,
    max_pages: int,
    pages_from: str = "axis 0 of `key_pages`",
    q_positions: Any = None,
) -> None:
    """Check metadata with values: lengths that fit the table and rows, pages in the pool.

    `pages_from` says where the pool's page count comes from. `q_positions` (T,), where
    given, must place each request's rows among its keys.
    """
    starts = check_starts("q_starts", q_starts, t)
    if starts is None or not has_concrete_values(kv_lengths):
        return
    lengths = np.asarray(to_host(kv_lengths), dtype=np.int64)
    known = has_concrete_values(page_table)
    table = np.asarray(to_host(page_table) if known else np.zeros(page_table.shape), np.int64)
    _, bad_lengths, wrong = metadata_faults(
        array_namespace(kv_lengths=lengths), starts, lengths, table, t, n_pages, page_size, None
    )
    bad = np.nonzero(bad_lengths)[0]
    if len(bad):
        r = int(bad[0])
        rows = np.diff(starts)
        msg = (
            f"`kv_lengths`[{r}] = {lengths[r]} must be at least the request's {rows[r]} new "
            f"row(s) (`q_starts`) and at most max_pages * page_size = {max_pages * page_size}"
        )
        raise ValueError(msg)
    if q_positions is not None and has_concrete_values(q_positions):
        pos = np.asarray(to_host(q_positions), dtype=np.int64)[: starts[-1]]
        limit = np.repeat(lengths, np.diff(starts))
        outside = np.nonzero((pos < 0) | (pos >= limit))[0]
        if len(outside):
            i = int(outside[0])
            r = int(np.searchsorted(starts, i, side="right")) - 1
            msg = (
                f"`q_positions`[{i}] = {pos[i]} must be a position among the keys of its "
                f"request {r}: 0 <= position < `kv_lengths`[{r}] = {lengths[r]}"
            )
            raise ValueError(msg)
    if known and wrong.any():
        r, j = (int(i) for i in np.argwhere(wrong)[0])
        msg = (
            f"`page_table`[{r}, {j}] = {table[r, j]} is not a page of the pool (0 <= page < "
            f"P = {n_pages}, {pages_from}), and request {r} uses it"
        )
        raise ValueError(msg)


def starts_fault(xp: Any, starts: Any, limit: int) -> Any:
    """Whether `starts` (R + 1,) is not a packing: 0 first, nondecreasing, at most `limit`."""
    return xp.logical_or(
        xp.logical_or(starts[0] != 0, starts[-1] > limit),
        xp.any(starts[1:] < starts[:-1]),
    )


def metadata_faults(
    xp: Any,
    q_starts: Any,
    kv_lengths: Any,
    page_table: Any,
    num_tokens: int,
    num_pages: int,
    page_size: int,
    device: Any,
) -> tuple[Any, Any, Any]:
    """Return what is wrong with a paged call's metadata, by array operations (traced or not).

    Returns whether `q_starts` is not a packing of ``num_tokens`` rows (0-d), whether
    each request's length does not fit its rows and its table (R,), and whether each
    page a request uses is not a page of the pool (R, max_pages).
    """
    max_pages = page_table.shape[1]
    rows = q_starts[1:] - q_starts[:-1]
    lengths = xp.logical_or(kv_lengths < rows, kv_lengths > max_pages * page_size)
    n_used = xp.floor_divide(kv_lengths + (page_size - 1), page_size)
    logical = xp.astype(arange(xp, 0, max_pages, device), n_used.dtype)
    used = logical[None, :] < n_used[:, None]
    outside = xp.logical_or(page_table < 0, page_table >= num_pages)
    pages = xp.logical_and(used, outside)
    return starts_fault(xp, q_starts, num_tokens), lengths, pages
