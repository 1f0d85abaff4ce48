"""Rotary position embeddings (RoPE), in the half-split and the interleaved layout.

The context-extension schemes of current checkpoints (YaRN, Llama 3, LongRoPE,
dynamic NTK), partial rotary embeddings and Qwen2-VL's multimodal RoPE, with
the inverse frequencies and attention factor of Hugging Face transformers'
``ROPE_INIT_FUNCTIONS`` (``transformers.modeling_rope_utils``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._lib._compat import array_namespace, device, namespace_or_numpy, on_device, result_type
from ._lib._masks import at_rank
from ._lib._validation import check_positive_scalar

__all__ = ["apply_rope", "rope_frequencies"]

#: the kinds of `scaling`; "default" (transformers' name for plain RoPE) scales nothing
_KINDS = ("default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")
#: transformers' other names of a kind: Qwen2-VL's configs read 'mrope' as "default"
_ALIASES = {"mrope": "default"}
_DEFAULT_BASE = 10000.0
_WITH_LENGTH = (
    "pass `scaling={**config.rope_parameters, "
    "'max_position_embeddings': config.max_position_embeddings}`"
)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any, minimum: int) -> bool:
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and int(value) >= minimum
    )


@dataclass(frozen=True)
class _Scaling:
    """A checked `scaling` dict: its kind, the numbers it reads, and its model fields."""

    kind: str
    params: dict[str, Any]
    theta: float | None = None  # "rope_theta"
    partial: float | None = None  # "partial_rotary_factor"
    mrope_section: tuple[int, ...] | None = None  # "mrope_section"


def _scaling_error(scaling: Any, kind: str, key: str, need: str, hint: str = "") -> ValueError:
    return ValueError(
        f"`scaling` of type {kind!r} needs `scaling[{key!r}]` to be {need}, "
        f"but got {scaling.get(key)!r} (in {scaling!r}){hint}"
    )


def _number(
    scaling: dict[str, Any],
    kind: str,
    key: str,
    *,
    required: bool = True,
    integer: bool = False,
    positive: bool = True,
) -> Any:
    """`scaling[key]`: a positive (or any) real or integer; None when optional and absent."""
    value: Any = scaling.get(key)
    if value is None and not required:
        return None
    need = "a positive integer" if integer else ("a number > 0" if positive else "a number")
    if integer:
        ok = _is_int(value, 1)
    else:
        ok = _is_real(value) and math.isfinite(value) and (value > 0 or not positive)
    if not ok:
        raise _scaling_error(scaling, kind, key, need)
    return int(value) if integer else float(value)


def _parse_scaling(scaling: Any) -> _Scaling | None:
    """Check `scaling` and read the keys its kind uses (see :func:`apply_rope`)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        msg = (
            "`scaling` must be None or a dict such as {'type': 'yarn', 'factor': 4.0, ...}, "
            f"but got {scaling!r} of type {type(scaling).__name__}"
        )
        raise TypeError(msg)
    # as transformers: 'rope_type' is the kind, 'type' (its old name) only where it is absent;
    # transformers keeps a stale 'type' beside it (Qwen2-VL's 'mrope', Phi-3's 'su')
    named = scaling.get("rope_type", scaling.get("type"))
    if named is None and scaling and all(isinstance(v, dict | None) for v in scaling.values()):
        msg = (
            "`scaling` holds one dict per layer type, as transformers' `config.rope_parameters` "
            f"of a model with per-layer RoPE (Gemma 3, ModernBERT), keys {list(scaling)}: pass "
            "the dict of the layer, e.g. `scaling=config.rope_parameters['full_attention']`"
        )
        raise ValueError(msg)
    kind = _ALIASES.get(named, named) if isinstance(named, str) else named
    if kind not in _KINDS:
        msg = (
            "`scaling` must name its kind in 'rope_type' (or the older 'type'), one of "
            f"{', '.join(map(repr, _KINDS))} (or Qwen2-VL's 'mrope', plain RoPE with "
            f"'mrope_section'), but got {scaling!r}"
        )
        raise ValueError(msg)
    if named == "mrope" and scaling.get("mrope_section") is None:
        raise _scaling_error(scaling, "mrope", "mrope_section", "3 non-negative integers")
    p: dict[str, Any] = {}
    if kind in ("linear", "ntk", "dynamic", "llama3"):
        p["factor"] = _number(scaling, kind, "factor")
    if kind == "dynamic":
        orig = _number(
            scaling, kind, "original_max_position_embeddings", required=False, integer=True
        )
        mpe = _number(scaling, kind, "max_position_embeddings", required=False, integer=True)
        if orig is None and mpe is None:
            raise _scaling_error(
                scaling,
                kind,
                "original_max_position_embeddings",
                "a positive integer (or 'max_position_embeddings' given)",
                "; transformers reads `config.max_position_embeddings`, which "
                f"`config.rope_parameters` does not hold: {_WITH_LENGTH}",
            )
        if orig is not None and mpe is not None and orig != mpe:
            msg = (
                "`scaling` of type 'dynamic' reads one length, but got both "
                f"'original_max_position_embeddings' = {orig} and 'max_position_embeddings' = "
                f"{mpe}: pass only the length the frequencies start to stretch at"
            )
            raise ValueError(msg)
        p["original"] = orig if orig is not None else mpe
    if kind in ("yarn", "llama3", "longrope"):
        p["original"] = _number(scaling, kind, "original_max_position_embeddings", integer=True)
    if kind in ("yarn", "longrope"):
        p["factor"] = _number(scaling, kind, "factor", required=False)
        p["attention_factor"] = _number(scaling, kind, "attention_factor", required=False)
        needs_factor = kind == "yarn" or p["attention_factor"] is None
        if p["factor"] is None and needs_factor:
            # transformers' fallback: config.max_position_embeddings / original length
            if scaling.get("max_position_embeddings") is None:
                raise _scaling_error(
                    scaling,
                    kind,
                    "factor",
                    "a number > 0 (or absent with 'max_position_embeddings' given)",
                    "; without it transformers reads factor = config.max_position_embeddings / "
                    "original_max_position_embeddings, and `config.rope_parameters` (Phi-3's) "
                    f"does not hold that length: {_WITH_LENGTH}",
                )
            mpe = _number(scaling, kind, "max_position_embeddings", integer=True)
            p["factor"] = mpe / p["original"]
    if kind == "yarn":
        p["beta_fast"] = _number(scaling, kind, "beta_fast", required=False) or 32.0
        p["beta_slow"] = _number(scaling, kind, "beta_slow", required=False) or 1.0
        p["mscale"] = _number(scaling, kind, "mscale", required=False, positive=False)
        p["mscale_all_dim"] = _number(
            scaling, kind, "mscale_all_dim", required=False, positive=False
        )
        truncate = scaling.get("truncate", True)
        if not isinstance(truncate, bool):
            raise _scaling_error(scaling, kind, "truncate", "True or False")
        p["truncate"] = truncate
    if kind == "llama3":
        p["low_freq_factor"] = _number(scaling, kind, "low_freq_factor")
        p["high_freq_factor"] = _number(scaling, kind, "high_freq_factor")
        if p["high_freq_factor"] <= p["low_freq_factor"]:
            raise _scaling_error(
                scaling, kind, "high_freq_factor", f"> 'low_freq_factor' = {p['low_freq_factor']}"
            )
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            value: Any = scaling.get(key)
            ok = isinstance(value, Sequence) and not isinstance(value, str)
            if not ok or not all(_is_real(v) and math.isfinite(v) and v > 0 for v in value):
                raise _scaling_error(scaling, kind, key, "a list of numbers > 0, one per pair")
            p[key] = tuple(float(v) for v in value)
    theta = scaling.get("rope_theta")
    if theta is not None:
        theta = _number(scaling, kind, "rope_theta")
    partial = scaling.get("partial_rotary_factor")
    if partial is not None and not (_is_real(partial) and 0 < partial <= 1):
        raise _scaling_error(scaling, kind, "partial_rotary_factor", "a number in (0, 1]")
    section = scaling.get("mrope_section")
    if section is not None:
        section = _check_section("scaling['mrope_section']", section)
    if scaling.get("mrope_interleaved"):
        msg = (
            "`scaling['mrope_interleaved']`: the interleaved M-RoPE of Qwen3-VL is not "
            f"supported; `mrope_section` is Qwen2-VL's contiguous layout (got {scaling!r})"
        )
        raise ValueError(msg)
    return _Scaling(
        kind,
        p,
        theta=theta,
        partial=None if partial is None else float(partial),
        mrope_section=section,
    )


def _check_section(name: str, section: Any) -> tuple[int, int, int]:
    ok = isinstance(section, Sequence) and not isinstance(section, str) and len(section) == 3
    if not ok or not all(_is_int(s, 0) for s in section):
        msg = (
            f"`{name}` must be 3 non-negative integers (temporal, height, width frequency "
            f"pairs), but got {section!r}"
        )
        raise ValueError(msg)
    return int(section[0]), int(section[1]), int(section[2])


def _resolve_base(base: float, parsed: _Scaling | None) -> float:
    """Return `base`, or the dict's ``rope_theta`` (a `base` passed must agree with it)."""
    base = check_positive_scalar("base", base)
    if parsed is None or parsed.theta is None:
        return base
    if base not in (_DEFAULT_BASE, parsed.theta):
        msg = (
            f"`base` = {base!r} and `scaling['rope_theta']` = {parsed.theta!r} disagree: "
            "pass one of them"
        )
        raise ValueError(msg)
    return parsed.theta


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_ramp_range(p: dict[str, Any], dim: int, base: float) -> tuple[float, float]:
    """Return the pair indices between which YaRN ramps from extrapolation to interpolation."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(p["original"] / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    return low, high


def _frequencies(
    xp: Any, dim: int, base: float, parsed: _Scaling | None, seq_len: Any, dtype: Any, dev: Any
) -> tuple[Any, float]:
    """(inv_freq of shape (dim/2,), attention factor): the one place they are computed.

    `seq_len` is None (transformers' value at initialisation), a Python number, or
    a 0-d array of `dtype` (``max(positions) + 1``, traced or lazy: no branching).
    """
    kw = on_device(dev)
    kind = "default" if parsed is None else parsed.kind
    p = {} if parsed is None else parsed.params
    if kind in ("ntk", "dynamic") and dim == 2:
        msg = (
            f"NTK-aware `scaling` needs D > 2 ({kind!r} raises `base` to the power R / (R - 2), "
            f"R the rotary dimension), but R = {dim}"
        )
        raise ValueError(msg)
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(p[key]) != dim // 2:
                msg = (
                    f"`scaling[{key!r}]` must have one number per rotated pair, "
                    f"{dim // 2} (rotary dimension {dim}), but has {len(p[key])}"
                )
                raise ValueError(msg)
    exponents = xp.arange(0, dim, 2, dtype=dtype, **kw) / dim  # (dim/2,)
    if kind == "ntk":
        base = base * p["factor"] ** (dim / (dim - 2))
    if kind == "dynamic" and seq_len is not None:
        factor, orig = p["factor"], p["original"]
        if isinstance(seq_len, numbers.Real):
            if seq_len > orig:
                base = base * (factor * seq_len / orig - (factor - 1)) ** (dim / (dim - 2))
        else:
            stretch = xp.where(
                seq_len > orig,
                factor * seq_len / orig - (factor - 1),
                xp.ones_like(seq_len),
            )
            grown = base * stretch ** (dim / (dim - 2))  # 0-d: base at this length
            return 1.0 / xp.pow(grown, exponents), 1.0
    inv_freq = 1.0 / xp.pow(xp.asarray(base, dtype=dtype, **kw), exponents)
    attention = 1.0
    if kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind == "llama3":
        factor, orig = p["factor"], p["original"]
        low_wavelen = orig / p["low_freq_factor"]
        high_wavelen = orig / p["high_freq_factor"]
        wavelen = (2 * math.pi) / inv_freq
        scaled = xp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - p["low_freq_factor"]) / (
            p["high_freq_factor"] - p["low_freq_factor"]
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = xp.logical_and(wavelen >= high_wavelen, wavelen <= low_wavelen)
        inv_freq = xp.where(medium, smoothed, scaled)
    elif kind == "yarn":
        factor = p["factor"]
        attention = p["attention_factor"]
        if attention is None:
            if p["mscale"] and p["mscale_all_dim"]:
                attention = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(
                    factor, p["mscale_all_dim"]
                )
            else:
                attention = _yarn_mscale(factor)
        low, high = _yarn_ramp_range(p, dim, base)
        ramp = xp.clip((xp.arange(0, dim // 2, dtype=dtype, **kw) - low) / (high - low), 0.0, 1.0)
        extrapolated = 1 - ramp  # the share of the original frequency
        inv_freq = (inv_freq / factor) * ramp + inv_freq * extrapolated
    elif kind == "longrope":
        attention = p["attention_factor"]
        if attention is None:
            factor = p["factor"]
            attention = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(p["original"]))
            )
        short = xp.asarray(p["short_factor"], dtype=dtype, **kw)
        long = xp.asarray(p["long_factor"], dtype=dtype, **kw)
        if seq_len is None or isinstance(seq_len, numbers.Real):
            ext = long if seq_len is not None and seq_len > p["original"] else short
        else:
            ext = xp.where(seq_len > p["original"], long, short)
        inv_freq = inv_freq / ext
    return inv_freq, float(attention)


def rope_frequencies(
    dim: int,
    *,
    base: float = 10000.0,
    scaling: dict[str, Any] | None = None,
    seq_len: Any = None,
    xp: Any = None,
    device: Any = None,
    dtype: Any = None,
) -> tuple[Any, float]:
    """Return the inverse frequencies and the attention factor of RoPE with `scaling`.

    The values transformers' ``ROPE_INIT_FUNCTIONS[kind](config, device, seq_len)``
    returns for the same parameters; :func:`apply_rope` rotates feature pair ``p``
    of the token at position ``t`` by ``t · inv_freq[p]`` and multiplies cos and
    sin by the attention factor.

    Parameters
    ----------
    dim : int
        The rotary dimension, even: transformers' ``int(head_dim * partial_rotary_factor)``
        (``scaling["partial_rotary_factor"]`` is not read here).
    base : float, default 10000.0
        Frequency base (``scaling["rope_theta"]`` when the dict has it).
    scaling : dict, optional
        As in :func:`apply_rope`.
    seq_len : int or 0-d array, optional
        The sequence length, ``max(positions) + 1``, read by "dynamic" and
        "longrope". None: transformers' value at initialisation (the original
        frequencies; LongRoPE's short factors). An array may be traced.
    xp : namespace, optional
        Array namespace of the result; that of `seq_len` when it is an array,
        else NumPy.
    device : device, optional
        Device of the result.
    dtype : dtype, optional
        Floating dtype of the result; float32 by default (as transformers).

    Returns
    -------
    inv_freq : array, shape (dim / 2,)
    attention_factor : float
        1.0 except for "yarn" and "longrope".

    Examples
    --------
    >>> from portable_attn import rope_frequencies
    >>> inv_freq, attention = rope_frequencies(
    ...     8, scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    ... )
    >>> inv_freq.shape, round(attention, 4)
    ((4,), 1.1386)
    """
    parsed = _parse_scaling(scaling)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2 or dim % 2:
        msg = f"`dim` must be an even integer >= 2, but got {dim!r}"
        raise ValueError(msg)
    if xp is None and seq_len is not None and not isinstance(seq_len, numbers.Real):
        xp = array_namespace(seq_len=seq_len)
    xp = namespace_or_numpy(xp, caller="rope_frequencies")
    dtype = xp.float32 if dtype is None else dtype
    if seq_len is not None and not isinstance(seq_len, numbers.Real):
        seq_len = xp.astype(seq_len, dtype)
    return _frequencies(xp, int(dim), _resolve_base(base, parsed), parsed, seq_len, dtype, device)


def _check_rotary_dim(rotary_dim: Any, parsed: _Scaling | None, x: Any) -> int:
    head_dim = x.shape[-1]
    from_dict = None
    if parsed is not None and parsed.partial is not None:
        from_dict = int(head_dim * parsed.partial)  # as transformers
    if rotary_dim is None:
        rotary_dim = head_dim if from_dict is None else from_dict
        if rotary_dim % 2 or rotary_dim == 0:
            what = "D" if from_dict is None else "int(D * scaling['partial_rotary_factor'])"
            msg = (
                f"`x` must have shape (..., L, D) with an even D >= 2 ({what} = {rotary_dim} "
                f"features rotated), but got shape {tuple(x.shape)}"
            )
            raise ValueError(msg)
        return int(rotary_dim)
    ok = isinstance(rotary_dim, numbers.Integral) and not isinstance(rotary_dim, bool)
    if not ok or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        msg = (
            f"`rotary_dim` must be an even integer in [2, D] with D = {head_dim} (axis -1 of "
            f"`x`, shape {tuple(x.shape)}), but got {rotary_dim!r}"
        )
        raise ValueError(msg)
    if from_dict is not None and from_dict != rotary_dim:
        msg = (
            f"`rotary_dim` = {rotary_dim} and `scaling['partial_rotary_factor']` = "
            f"{parsed.partial if parsed else None} (int(D * factor) = {from_dict} with "
            f"D = {head_dim}) disagree: pass one of them"
        )
        raise ValueError(msg)
    return int(rotary_dim)


def apply_rope(
    x: Any,
    positions: Any,
    *,
    base: float = 10000.0,
    interleaved: bool = False,
    scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
    mrope_section: Sequence[int] | None = None,
) -> Any:
    """Rotate pairs of features of `x` by position-dependent angles (RoPE).

    Feature pair ``p`` (``p = 0 .. R/2 - 1``, ``R`` the rotary dimension, `D` by
    default) of the token at position ``t`` is rotated by ``t · inv_freq[p]``,
    ``inv_freq[p] = base^(-2p/R)`` without `scaling`. So ``rope(q, s) · rope(k, t)``
    depends on the positions only through ``s - t``.

    Parameters
    ----------
    x : floating array, shape (..., H, L, D)
        Queries or keys.
    positions : integer or floating array, shape (L,) or (B..., L)
        Position of each token, e.g. ``arange(offset, offset + L)`` for tokens
        appended to a KV cache at ``offset``. Broadcast over heads. With
        `mrope_section`: shape (3, L) or (3, B..., L), one row per component.
    base : float, default 10000.0
        Frequency base (transformers' ``rope_theta``).
    interleaved : bool, default False
        False: the half-split layout of GPT-NeoX/LLaMA, pairs ``(x[p], x[p + R/2])``.
        True: the interleaved layout of GPT-J and GLM, pairs ``(x[2p], x[2p + 1])``.
    scaling : dict, optional
        Context extension, as transformers computes it (``ROPE_INIT_FUNCTIONS``).
        The kind is ``scaling["rope_type"]``, or ``scaling["type"]`` where it is
        absent (as transformers, which keeps a checkpoint's old ``"type"`` beside it:
        Qwen2-VL's ``"mrope"``, Phi-3's ``"su"``); ``"mrope"`` is plain RoPE with
        ``mrope_section``. So a transformers ``config.rope_parameters`` dict can be
        passed as it is, but for what it does not hold: the length
        ``config.max_position_embeddings`` that "dynamic" and a "longrope" dict
        without ``factor`` (Phi-3's) read, to add as ``"max_position_embeddings"``;
        and a model with RoPE per layer type (Gemma 3, ModernBERT) holds one dict per
        layer type: pass ``config.rope_parameters[layer_type]``. Keys read:

        - ``"default"``: nothing (plain RoPE).
        - ``"linear"``: ``factor``; divides the frequencies by it (position interpolation).
        - ``"ntk"``: ``factor``; raises the base to ``base · factor^(R / (R - 2))``.
        - ``"dynamic"`` (dynamic NTK): ``factor`` and ``original_max_position_embeddings``
          (transformers' ``config.max_position_embeddings``; ``max_position_embeddings``
          is read when it is absent). With ``S = max(positions) + 1`` (over the whole
          array, batch included, as transformers' ``torch.max(position_ids) + 1``) above
          the original length ``O``, the base becomes
          ``base · (factor · S / O - (factor - 1))^(R / (R - 2))``; plain RoPE up to ``O``.
          Computed without branching (traceable). Unlike transformers' module, which
          keeps the frequencies of the longest sequence seen until a sequence shorter
          than ``O`` comes, each call uses its own ``S``.
        - ``"yarn"``: ``factor``, ``original_max_position_embeddings``; optional
          ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``, ``mscale_all_dim``,
          ``attention_factor``, ``truncate`` (True). Without ``factor``,
          ``max_position_embeddings / original_max_position_embeddings``.
        - ``"llama3"``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
          ``original_max_position_embeddings``.
        - ``"longrope"``: ``short_factor``, ``long_factor`` (``R/2`` numbers each),
          ``original_max_position_embeddings``; optional ``factor``, ``attention_factor``
          (without both, ``max_position_embeddings`` gives ``factor``). The long factors
          when ``max(positions) + 1 > original_max_position_embeddings``, else the
          short ones (traceable).

        Every kind also reads ``rope_theta`` (the base; a `base` other than the
        default must agree with it), ``partial_rotary_factor`` (``R = int(D · factor)``,
        as transformers; a `rotary_dim` passed must agree with it) and
        ``mrope_section`` (as the argument, which must agree with it). Other keys
        are ignored. The attention factor of "yarn" and "longrope" multiplies cos
        and sin, so queries and keys are both scaled by it.
    rotary_dim : int, optional
        ``R``, even, at most ``D``: only the first ``R`` features are rotated (partial
        rotary embeddings, transformers' ``int(head_dim * partial_rotary_factor)``),
        with frequencies of dimension ``R``; the others pass through unchanged.
    mrope_section : sequence of 3 ints, optional
        Multimodal RoPE (Qwen2-VL): the numbers of frequency pairs, summing to ``R/2``,
        that take their positions from ``positions[0]`` (temporal), ``positions[1]``
        (height) and ``positions[2]`` (width), in that order.

    Returns
    -------
    array, shape (..., H, L, D)
        Same dtype and device as `x`; computed in at least float32.

    Examples
    --------
    >>> import numpy as np
    >>> from portable_attn import apply_rope
    >>> x = np.ones((1, 3, 4))                          # (H, L, D)
    >>> apply_rope(x, np.arange(3)).shape
    (1, 3, 4)
    >>> yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2}
    >>> apply_rope(x, np.arange(3), scaling=yarn, rotary_dim=2).shape
    (1, 3, 4)
    """
    xp = array_namespace(x=x, positions=positions)
    if x.ndim < 2 or x.shape[-1] == 0:
        msg = (
            f"`x` must have shape (..., L, D) with an even D >= 2, but got shape {tuple(x.shape)}"
        )
        raise ValueError(msg)
    if not xp.isdtype(x.dtype, "real floating"):
        msg = f"`x` must have a real floating dtype, but got dtype {x.dtype}"
        raise TypeError(msg)
    parsed = _parse_scaling(scaling)
    base = _resolve_base(base, parsed)
    rot = _check_rotary_dim(rotary_dim, parsed, x)
    length, dim, half = x.shape[-2], x.shape[-1], rot // 2
    section: tuple[int, ...] | None = None
    if mrope_section is not None:
        section = _check_section("mrope_section", mrope_section)
        if parsed is not None and parsed.mrope_section not in (None, section):
            msg = (
                f"`mrope_section` = {section} and `scaling['mrope_section']` = "
                f"{parsed.mrope_section} disagree: pass one of them"
            )
            raise ValueError(msg)
    elif parsed is not None:
        section = parsed.mrope_section
    if section is not None and sum(section) != half:
        msg = (
            f"`mrope_section` = {section} must sum to R/2 = {half} frequency pairs "
            f"(rotary dimension R = {rot}, `x` shape {tuple(x.shape)}), but sums to {sum(section)}"
        )
        raise ValueError(msg)
    if section is not None and (positions.ndim < 2 or positions.shape[0] != 3):
        msg = (
            "`positions` must have shape (3, L) or (3, B..., L) with `mrope_section` "
            f"(temporal, height, width rows), but got shape {tuple(positions.shape)}"
        )
        raise ValueError(msg)
    if positions.ndim < 1 or positions.shape[-1] != length:
        msg = (
            f"`positions` must have shape (..., L) with L = {length} (axis -2 of `x`), "
            f"but got shape {tuple(positions.shape)} for `x` shape {tuple(x.shape)}"
        )
        raise ValueError(msg)
    compute = result_type(xp, x.dtype, xp.float32)
    pos = xp.astype(positions, compute)
    seq_len = None
    if parsed is not None and parsed.kind in ("dynamic", "longrope"):
        seq_len = xp.max(pos) + 1  # 0-d, as transformers: over every row and sequence
    inv_freq, attention = _frequencies(xp, rot, base, parsed, seq_len, compute, device(x))
    if section is None:
        pos = xp.reshape(pos, (*pos.shape[:-1], 1, length, 1))  # (B..., 1, L, 1): over H
        angles = pos * at_rank(xp, inv_freq, pos.ndim)  # (B..., 1, L, R/2)
    else:
        parts, start = [], 0
        for row, size in enumerate(section):  # frequency pairs of row `row` of positions
            p_row = xp.reshape(pos[row, ...], (*pos.shape[1:-1], 1, length, 1))
            parts.append(p_row * at_rank(xp, inv_freq[start : start + size], p_row.ndim))
            start += size
        angles = xp.concat(parts, axis=-1)  # (B..., 1, L, R/2)
    cos, sin = xp.cos(angles), xp.sin(angles)
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    xc = xp.astype(x, compute, copy=False)
    xr = xc[..., :rot] if rot < dim else xc
    rank = max(xr.ndim, cos.ndim)  # one rank for every operand (jax_numpy_rank_promotion)
    xr, cos, sin = (at_rank(xp, a, rank) for a in (xr, cos, sin))
    if interleaved:
        pairs = xp.reshape(xr, (*xr.shape[:-1], half, 2))  # (..., L, R/2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = xp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        out = xp.reshape(rotated, xr.shape)
    else:
        first, second = xr[..., :half], xr[..., half:]
        out = xp.concat([first * cos - second * sin, second * cos + first * sin], axis=-1)
    if rot < dim:
        out = xp.concat([out, xc[..., rot:]], axis=-1)
    return xp.astype(out, x.dtype, copy=False)
