"""One attention call, validated and prepared once: :class:`AttentionCall` and :func:`prepare`.

Every entry point (the two public functions, the partial attention behind
sequence parallelism, ``jax_parallel``, ``diagnostics``, the KV cache through the
public function) turns its arguments into an :class:`AttentionCall` with one
:func:`prepare` call and hands that object on. The keyword list of the attention
arguments is written here once, as the signature of :func:`prepare`; adding an
argument touches the public signatures, :func:`prepare` and the code that uses
it, nothing else.

What :func:`prepare` does, in order: resolve the one namespace of all arrays,
validate every argument (the checks and their messages are in
:mod:`._validation`), decide the static facts (:class:`AttentionPlan`, cached by
shapes, dtypes, device and scalar options), gather the score terms
(:class:`ScoreTerms`), and give Q, K, V and the bias an explicit head axis.

Q, K, V and the bias keep their input dtype here: whether half-precision inputs
are cast to the float32 compute dtype depends on the path
(:func:`~._path.keeps_input_dtype`): a native kernel that accumulates in float32
takes them as they are, the portable paths call :meth:`AttentionCall.in_compute_dtype`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _route
from . import _validation as v
from ._block_states import BlockMask, LazyHostStates
from ._compat import (
    array_namespace,
    concrete_float,
    default_integer_dtype,
    device,
    has_concrete_values,
    ids_in_one_dtype,
    is_compiling,
    library_name,
    on_device,
    reads_host_values,
    result_type,
    stop_gradient,
    to_host,
)
from ._fields import FIELDS, axis_of
from ._masks import arange
from ._scores import PLAIN_TERMS, AttentionPlan, ScoreTerms, empty_result

__all__ = [
    "ATTENTION_KEYWORDS",
    "AttentionCall",
    "compute_dtype_of",
    "heads_first",
    "no_dropout_and_none_of",
    "prepare",
    "scalar_option",
    "name_swapped_shapes",
    "signed_lengths",
    "swap_heads",
]

Array = Any


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call: the namespace, prepared arrays, plan and score terms.

    Attributes
    ----------
    xp : namespace
        The array-API namespace of every array argument.
    query : array, shape (B..., Hq, Lq, Dk)
        In its input dtype, with an explicit head axis (a 2-D input gains one);
        :meth:`in_compute_dtype` casts Q, K, V and the bias to the compute dtype.
    key : array, shape (B..., Hkv, Lk, Dk)
    value : array, shape (B..., Hkv, Lk, Dv), or None
        None for :func:`portable_attn.attention_weights` and the diagnostics.
    bias : array broadcastable to (B..., Hq, Lq, Lk) with at least 2 dims, or None
        In its input dtype, like Q, K and V.
    plan : AttentionPlan
        The static facts: shapes, scale, softcap, causal/window, dtypes, device.
    terms : ScoreTerms
        Mask, lengths, ALiBi slopes, ``score_mod``, dropout keep-mask.
    drop_head : bool
        Every input was 2-D: the result loses its head axis again.
    """

    xp: Any
    query: Array
    key: Array
    value: Array  # None for the weights alone
    bias: Array  # None when not given
    plan: AttentionPlan
    terms: ScoreTerms
    drop_head: bool

    @property
    def is_empty(self) -> bool:
        """No query, key, query head or sequence: the result is zeros, nothing is computed."""
        plan = self.plan
        return 0 in (plan.q_len, plan.kv_len, plan.num_q_heads, math.prod(plan.batch))

    def in_compute_dtype(self) -> AttentionCall:
        """Return this call with Q, K, V and bias in the compute dtype (itself if they are).

        Half precision becomes float32 (a copy of each such array); float32 and
        float64 inputs are returned as they are, so calling it twice costs nothing.
        """
        dt, xp = self.plan.compute_dtype, self.xp
        arrays = {"query": self.query, "key": self.key, "value": self.value, "bias": self.bias}
        changes = {
            name: xp.astype(x, dt) for name, x in arrays.items() if x is not None and x.dtype != dt
        }
        return dataclasses.replace(self, **changes) if changes else self

    def zeros(self, *shape: int) -> Array:
        """Zeros of ``(*batch, Hq, *shape)`` in the compute dtype, on the inputs' device."""
        plan = self.plan
        full = (*plan.batch, plan.num_q_heads, *shape)
        return self.xp.zeros(full, dtype=plan.compute_dtype, **on_device(plan.device))

    def empty_result(self) -> tuple[Array, Array]:
        """Output and lse of a call none of whose rows sees a key (:func:`empty_result`)."""
        return empty_result(self.xp, self.plan, self.terms.sinks)

    def flatten(self) -> tuple[dict[str, Array], AttentionCall]:
        """Split the call into its arrays and a skeleton that holds everything else.

        Returns
        -------
        arrays : dict of str to array
            Every field of :data:`~._fields.FIELDS` that holds an array (a float
            `scale` is static, not an array), by name, in declaration order.
        skeleton : AttentionCall
            The call with those fields set to None: the static part, for
            :meth:`unflatten` (a JAX custom-VJP closure, a Dask task's argument).
        """
        arrays: dict[str, Array] = {}
        changes: dict[str, dict[str, Any]] = {"call": {}, "terms": {}, "plan": {}}
        owners = {"call": self, "terms": self.terms, "plan": self.plan}
        for f in FIELDS:
            x = getattr(owners[f.owner], f.name)
            if x is not None and not isinstance(x, (int, float)):
                arrays[f.name] = x
                changes[f.owner][f.name] = None
        plan = dataclasses.replace(self.plan, **changes["plan"]) if changes["plan"] else self.plan
        terms = self.terms
        if changes["terms"]:
            terms = dataclasses.replace(terms, **changes["terms"])
        skeleton = dataclasses.replace(self, plan=plan, terms=terms, **changes["call"])
        return arrays, skeleton

    def unflatten(self, arrays: dict[str, Array], **plan_changes: Any) -> AttentionCall:
        """Put `arrays` (by field name) into this call (a skeleton); inverse of :meth:`flatten`.

        `plan_changes` replace static plan fields too (the shapes of a part).
        """
        changes: dict[str, dict[str, Any]] = {"call": {}, "terms": {}, "plan": plan_changes}
        for f in FIELDS:
            if f.name in arrays:
                changes[f.owner][f.name] = arrays[f.name]
        plan = dataclasses.replace(self.plan, **changes["plan"]) if changes["plan"] else self.plan
        terms = self.terms
        if changes["terms"]:
            terms = dataclasses.replace(terms, **changes["terms"])
        return dataclasses.replace(self, plan=plan, terms=terms, **changes["call"])

    def sliced(self, ranges: dict[str, tuple[int, int]], **sizes: int) -> AttentionCall:
        """Return the call with every array field sliced to `ranges` (grid axis -> range).

        Each field is sliced along the axes its declaration names (size-one axes stay
        broadcast; views); `sizes` set the plan's lengths. Nothing is placed: a part's
        positions are the caller's business (``_paths/_partial.place_block``).
        """
        arrays, skeleton = self.flatten()
        parts = {}
        for name, x in arrays.items():
            for axis, (start, stop) in ranges.items():
                d = axis_of(name, x, axis)
                if d is not None:
                    x = x[(slice(None),) * d + (slice(start, stop), ...)]
            parts[name] = x
        return skeleton.unflatten(parts, **sizes)

    def first_keys(self, kv_len: int) -> AttentionCall:
        """Return the call with only its first `kv_len` keys: still a whole call, not a part.

        For calls whose `kv_lengths` hide every key from `kv_len` on (the policy's
        :func:`~portable_attn._lib._route.kept_keys`): their rows are aligned by the
        lengths, which the cut leaves as they are. Gradients of the keys cut off are zeros.
        """
        return self.sliced({"lk": (0, kv_len)}, kv_len=kv_len)

    def finish(self, out: Array) -> Array:
        """Cast a result to the promoted input dtype and drop the head axis of 2-D calls."""
        if out.dtype != self.plan.result_dtype:
            out = self.xp.astype(out, self.plan.result_dtype)
        return out[0, ...] if self.drop_head else out

    def with_row_max(self) -> AttentionCall:
        """Return this call asking every path for each row's largest score too."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, row_max=True))

    def finish_lse(self, stats: Array, column: int = 0) -> Array:
        """Return a column of the row statistics (..., Hq, Lq, 1|2) as (..., Hq, Lq).

        Column 0 is the lse, 1 the row max (:func:`~._scores.row_stats`), which has
        no gradient. In the compute dtype (``torch.autocast`` runs the products in
        its own dtype: the statistics are cast back).
        """
        x = stats[..., column]
        if column == 1:
            x = stop_gradient(x)
        if x.dtype != self.plan.compute_dtype:
            x = self.xp.astype(x, self.plan.compute_dtype)
        return x[0, ...] if self.drop_head else x


def prepare(
    query: Array,
    key: Array,
    value: Array | None,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    scale: float | Array | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | Array | None = None,
    q_lengths: Array | None = None,
    kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None,
    score_mod: Callable[..., Array] | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Array | None = None,
    sinks: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    mask_mod: Callable[..., Array] | None = None,
    block_mask: Any = None,
    static: tuple[Any, AttentionPlan] | None = None,
) -> AttentionCall:
    """Validate the arguments of one attention call and prepare its arrays.

    The arguments are those of :func:`portable_attn.scaled_dot_product_attention`
    (without the path choices `block_size` and `implementation`); `value` is None
    for the weights alone. `static`: the namespace and plan of a call with the same
    signature (``_lib/_cache.py``), whose static checks this call passes too: they
    are not repeated (the score terms are still checked and gathered).

    Returns
    -------
    AttentionCall

    Raises
    ------
    TypeError, ValueError
        As documented for :func:`portable_attn.scaled_dot_product_attention`.
    """
    if static is None:
        arrays = {
            "query": query,
            "key": key,
            "value": value,
            "mask": mask,
            "bias": bias,
            "q_lengths": q_lengths,
            "kv_lengths": kv_lengths,
            "alibi_slopes": alibi_slopes,
            "dropout_mask": dropout_mask,
            "sinks": sinks,
            "q_segment_ids": q_segment_ids,
            "kv_segment_ids": kv_segment_ids,
            # a learned temperature or cap: a 0-d array joins the namespace and device checks
            "scale": v.array_or_none(scale),
            "softcap": v.array_or_none(softcap),
        }
        static = _checked_static(
            arrays, is_causal=is_causal, scale=scale, window=window, softcap=softcap
        )
    xp, plan = static
    model = {  # by name, not locals(): torch.compile (torch <= 2.11) cannot trace that
        "q_lengths": q_lengths,
        "kv_lengths": kv_lengths,
        "alibi_slopes": alibi_slopes,
        "score_mod": score_mod,
        "dropout_p": dropout_p,
        "dropout_mask": dropout_mask,
        "sinks": sinks,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
        "mask_mod": mask_mod,
        "block_mask": block_mask,
    }
    plan, terms = _score_terms(xp, plan, mask, model)
    # Q, K, V and the bias keep their dtype: the path casts them where it needs to
    return AttentionCall(
        xp=xp,
        query=_with_head_axis(xp, query),
        key=_with_head_axis(xp, key),
        value=None if value is None else _with_head_axis(xp, value),
        bias=None if bias is None else _at_least_2d(xp, bias),
        plan=plan,
        terms=terms,
        drop_head=query.ndim == key.ndim == 2 and (value is None or value.ndim == 2),
    )


def heads_first(
    layout: Any, query: Array, key: Array, value: Array | None
) -> tuple[Array, Array, Array | None]:
    """Return Q, K and V in the order the library computes in, (B..., H, L, D).

    `layout` is checked (:func:`~._validation.check_layout`): "bhld" returns the
    arrays as they are, "blhd" (B..., L, H, D) swaps their head and sequence axes
    (:func:`swap_heads`, views). `value` may be None (the weights alone).
    """
    if v.check_layout(layout) == "bhld":
        return query, key, value
    xp = array_namespace(query=query, key=key, value=value)
    swapped = None if value is None else swap_heads(xp, value)
    return swap_heads(xp, query), swap_heads(xp, key), swapped


def name_swapped_shapes(error: ValueError, layout: str) -> None:
    """Add to `error` (raised by the checks) that ``layout="blhd"`` swapped the shapes it names.

    The checks see Q, K and V with their head and sequence axes swapped
    (:func:`heads_first`): the shapes a message names are those, not the caller's.
    """
    if layout != "bhld" and error.args and isinstance(error.args[0], str):
        note = (
            f" (with layout={layout!r}, the shapes named are those of query, key and value "
            "with their axes -3 and -2 swapped; arrays already (B..., H, L, D) take the "
            "default layout)"
        )
        error.args = (error.args[0] + note, *error.args[1:])


def swap_heads(xp: Any, x: Array, *, features: bool = True) -> Array:
    """Swap the head and sequence axes of `x`: (..., L, H, D) <-> (..., H, L, D).

    Its own inverse: it takes ``layout="blhd"`` inputs to the library's order and
    the results back. With `features`, `x` ends with a feature axis (Q, K, V, the
    output: axes -3 and -2); without, it is a row statistic (..., H, L) (the lse, the
    row max: axes -2 and -1). An array without a head axis (a 2-D input (L, D), the
    result of 2-D inputs) is returned as it is.
    """
    head = x.ndim - (3 if features else 2)
    if head < 0:
        return x
    axes = list(range(x.ndim))
    axes[head], axes[head + 1] = head + 1, head
    return xp.permute_dims(x, tuple(axes))


#: The attention keyword arguments :func:`prepare` takes, in order (for callers that
#: forward ``**kwargs`` and must name an unknown one, like the diagnostics).
ATTENTION_KEYWORDS = tuple(
    name
    for name, p in inspect.signature(prepare).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


def signed_lengths(xp: Any, x: Array) -> Array:
    """Lengths in the default integer dtype, so ``kv_len - q_len`` can go below zero.

    Narrow dtypes are widened too: ``Lk - q_len`` overflowed int8 lengths (Lq = 300).
    """
    common = default_integer_dtype(xp)
    return x if x.dtype == common else xp.astype(x, common)


# ---------------------------------------------------------------------------
# the static facts


def _checked_static(arrays: dict[str, Array | None], **options: Any) -> tuple[Any, AttentionPlan]:
    """Check the static facts of a call; return its namespace and plan.

    The namespace of the arrays, their kinds (:func:`~._validation.check_supported_array`),
    devices, shapes and dtypes and the scalar options are checked, and the plan
    decided: what the cache (``_lib/_cache.py``) keeps per call signature.
    """
    xp = array_namespace(**arrays)
    for name, x in arrays.items():
        if x is not None:
            v.check_supported_array(name, x)
    query = arrays["query"]
    if _route.library(query).pins_devices:
        v.check_same_device(arrays, "query", device(query), device)
    names = ("query", "key", "value", "mask", "bias")
    plan = _build_plan(xp, *(arrays[n] for n in names), **options)
    return xp, plan


def _build_plan(
    xp: Any,
    query: Array,
    key: Array,
    value: Array | None,
    mask: Array | None,
    bias: Array | None,
    *,
    is_causal: bool,
    scale: float | None,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
) -> AttentionPlan:
    """Validate Q, K, V, mask, bias and the scalar options; decide the static facts."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is not None:
            v.check_floating(xp, name, x)
    q_shape, k_shape, v_shape = v.check_attention_arrays(query, key, value)
    batch = v.broadcast_batch_shapes(
        [("query", q_shape[:-3]), ("key", k_shape[:-3])]
        + ([("value", v_shape[:-3])] if value is not None else [])
    )
    hq, lq, dk = q_shape[-3:]
    hkv, lk = k_shape[-3], k_shape[-2]
    qk_batch = v.broadcast_batch_shapes([("query", q_shape[:-3]), ("key", k_shape[:-3])])
    logits_shape = (*qk_batch, hq, lq, lk)
    if mask is not None:
        v.check_mask_dtype(xp, "mask", mask)
        v.check_broadcastable_to("mask", mask, logits_shape, "logits (..., Hq, Lq, Lk)")
    if bias is not None:
        v.check_bias_dtype(xp, bias)
        v.check_broadcastable_to("bias", bias, logits_shape, "logits (..., Hq, Lq, Lk)")
    is_causal = v.check_is_causal(is_causal)
    dtypes = [query.dtype, key.dtype] + ([value.dtype] if value is not None else [])
    result_dtype = result_type(xp, *dtypes)
    compute_dtype = compute_dtype_of(xp, result_dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(dk)
    else:
        scale = scalar_option(xp, "scale", scale, compute_dtype)
    if softcap is not None:
        softcap = scalar_option(xp, "softcap", softcap, compute_dtype)
    if window is not None:
        window = v.check_window(window)
    return AttentionPlan(
        batch=batch,
        num_q_heads=hq,
        num_kv_heads=hkv,
        q_len=lq,
        kv_len=lk,
        value_dim=v_shape[-1],
        scale=scale,
        softcap=softcap,
        is_causal=is_causal,
        window=window,
        compute_dtype=compute_dtype,
        result_dtype=result_dtype,
        device=device(query),
        key_dim=dk,
    )


def compute_dtype_of(xp: Any, dtype: Any) -> Any:
    """Return the dtype a call computes in: float16/bfloat16 in float32, others as is."""
    return result_type(xp, dtype, xp.float32)


def scalar_option(xp: Any, name: str, value: Any, compute_dtype: Any) -> Any:
    """`scale` / `softcap` as a float, or as a 0-d array in the compute dtype (learned)."""
    read = concrete_float if v.array_or_none(value) is None or has_concrete_values(value) else None
    return v.check_scalar_option(xp, name, value, compute_dtype, read=read)


# ---------------------------------------------------------------------------
# the score terms: the model-building arguments, shaped to broadcast with a block


def no_dropout_and_none_of(dropout_p: Any, *arguments: Any) -> bool:
    """Whether `dropout_p` is the default 0 and every one of `arguments` is None (not given)."""
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return False
    return all(x is None for x in arguments)


def _score_terms(
    xp: Any, plan: AttentionPlan, mask: Array | None, model: dict[str, Any]
) -> tuple[AttentionPlan, ScoreTerms]:
    """Validate the model-building arguments (`model`, by name) and gather the score terms."""
    mask = None if mask is None else _at_least_2d(xp, mask)
    dropout_p = model.pop("dropout_p")
    if no_dropout_and_none_of(dropout_p, *model.values()):  # the common call: none given
        return plan, (PLAIN_TERMS if mask is None else ScoreTerms(mask=mask))
    q_lengths, kv_lengths = model["q_lengths"], model["kv_lengths"]
    alibi_slopes, score_mod = model["alibi_slopes"], model["score_mod"]
    dropout_mask, sinks = model["dropout_mask"], model["sinks"]
    q_segment_ids, kv_segment_ids = model["q_segment_ids"], model["kv_segment_ids"]
    mask_mod, block_mask = model["mask_mod"], model["block_mask"]
    logits_shape = (*plan.batch, plan.num_q_heads, plan.q_len, plan.kv_len)
    lengths = {}
    length_values = None
    for name, x, axis in (("q_lengths", q_lengths, "Lq"), ("kv_lengths", kv_lengths, "Lk")):
        if x is None:
            continue
        v.check_lengths(xp, name, x, plan.batch)
        if reads_host_values(x):  # free: no sync, no trace
            found = frozenset(np.asarray(to_host(x)).reshape(-1).tolist())
            limit = plan.q_len if axis == "Lq" else plan.kv_len
            v.check_length_values(name, found, limit, axis)
            if name == "kv_lengths":  # None for an empty batch, which has no value to read
                length_values = found or None
        x = signed_lengths(xp, x)
        lengths[name] = xp.reshape(x, (*x.shape, 1, 1, 1))  # (*batch, 1, 1, 1)
    if lengths:  # i' = i + kv_len[b] - q_len[b] (Alignment.offset)
        plan = dataclasses.replace(plan, has_lengths=True)
    slopes = alibi_slopes
    if slopes is not None:
        v.check_alibi_slopes(xp, slopes, plan.batch, plan.num_q_heads)
        slopes = xp.reshape(xp.astype(slopes, plan.compute_dtype), (*slopes.shape, 1, 1))
    v.check_score_mod(score_mod)
    if score_mod is not None:
        score_mod = _checked_score_mod(xp, score_mod)
    if not (type(dropout_p) is float and dropout_p == 0.0 and dropout_mask is None):
        dropout_p = v.check_dropout(dropout_p, dropout_mask)  # the default needs no check
    keep = dropout_mask
    if keep is not None:
        v.check_mask_dtype(xp, "dropout_mask", keep)
        v.check_broadcastable_to("dropout_mask", keep, logits_shape, "weights (..., Hq, Lq, Lk)")
        keep = _at_least_2d(xp, keep)
    if sinks is not None:
        v.check_sinks(xp, sinks, plan.batch, plan.num_q_heads)
        largest = float(xp.finfo(plan.compute_dtype).max)
        if float(xp.finfo(sinks.dtype).max) > largest and has_concrete_values(sinks):
            # a wider dtype: finite values past the compute dtype's range would become inf;
            # read on the host (under jax.jit, operations on a closed-over array trace)
            host = np.asarray(to_host(sinks), dtype=np.float64)
            beyond = bool(np.any(np.isfinite(host) & (np.abs(host) > largest)))
            v.check_sinks_range(beyond, sinks, plan.compute_dtype)
        cast = xp.astype(sinks, plan.compute_dtype)
        sinks = xp.reshape(cast, (*sinks.shape, 1, 1))
    segments = _segments(xp, plan, q_segment_ids, kv_segment_ids)
    batch_index = None
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        n = math.prod(plan.batch)
        batch_index = xp.reshape(arange(xp, 0, n, plan.device), (*plan.batch, 1, 1, 1))
    masking = _mask_mod_terms(xp, plan, mask_mod, block_mask, batch_index)
    terms = ScoreTerms(
        mask=mask,
        q_lengths=lengths.get("q_lengths"),
        kv_lengths=lengths.get("kv_lengths"),
        kv_length_values=length_values,
        alibi_slopes=slopes,
        score_mod=score_mod,
        batch_index=batch_index,
        dropout_keep=keep,
        dropout_scale=1.0 / (1.0 - dropout_p),
        sinks=sinks,
        **segments,
        **masking,
    )
    return plan, terms


def _segments(
    xp: Any, plan: AttentionPlan, q_ids: Array | None, kv_ids: Array | None
) -> dict[str, Any]:
    """Segment ids shaped to broadcast with a block: (*batch, 1, Lq, 1) and (*batch, 1, 1, Lk)."""
    if q_ids is None and kv_ids is None:
        return {}
    if q_ids is not None:
        v.check_segment_ids(xp, "q_segment_ids", q_ids, plan.batch, plan.q_len, "Lq")
    if kv_ids is not None:
        v.check_segment_ids(xp, "kv_segment_ids", kv_ids, plan.batch, plan.kv_len, "Lk")
    if q_ids is None:
        v.check_self_segments("q_segment_ids", "kv_segment_ids", plan.q_len, plan.kv_len)
        q_ids = kv_ids
    elif kv_ids is None:
        v.check_self_segments("kv_segment_ids", "q_segment_ids", plan.q_len, plan.kv_len)
        kv_ids = q_ids
    # one dtype, compared by value (torch and array-api-strict refuse some promotions)
    q_ids, kv_ids = ids_in_one_dtype(xp, q_ids, kv_ids, names=("q_segment_ids", "kv_segment_ids"))
    return {
        "q_segments": xp.reshape(q_ids, (*q_ids.shape[:-1], 1, plan.q_len, 1)),
        "kv_segments": xp.reshape(kv_ids, (*kv_ids.shape[:-1], 1, 1, plan.kv_len)),
    }


def _mask_mod_terms(
    xp: Any, plan: AttentionPlan, mask_mod: Any, block_mask: Any, batch_index: Any
) -> dict[str, Any]:
    """Return the checked ``mask_mod`` and what a block mask (given or built) says of blocks.

    A `block_mask` gives its states: NumPy copies read on the host for the eager
    paths (its cached :meth:`BlockMask.host`), and for libraries that trace loops
    (JAX) the states themselves, which the traced loop reads by value. A ready rule
    (``_lib/_rules.py``) brings states from arithmetic on the block bounds (exact at a
    static alignment; per sequence, by value, with traced lengths). A `mask_mod`
    alone gets states built lazily, on the host, the first time a tiled path asks
    (eager libraries with concrete values only; under ``jax.jit`` and for Dask it is
    evaluated per block, and only the band skips blocks).
    """
    v.check_mask_mod(mask_mod)
    if block_mask is None and mask_mod is None:
        return {}
    if block_mask is not None:
        v.check_block_mask(
            block_mask,
            mask_mod,
            plan.batch,
            plan.num_q_heads,
            plan.q_len,
            plan.kv_len,
            kind=BlockMask,
        )
        mask_mod = block_mask.mask_mod
    target = (*plan.batch, plan.num_q_heads)

    rule_of = v.guarded_rule("mask_mod", mask_mod)

    def checked(batch: Array, head: Array, q_idx: Array, kv_idx: Array) -> Array:
        result = rule_of(batch, head, q_idx, kv_idx)
        v.check_mask_mod_result(xp, result, (*target, q_idx.shape[-2], kv_idx.shape[-1]))
        return result

    checked.rule = rule_of  # type: ignore[attr-defined]  # unchecked: flex's scalar indices
    # a ready rule aligned by the call's lengths reads them per sequence, as arrays
    checked.per_sequence = hasattr(mask_mod, "length_states")  # type: ignore[attr-defined]
    checked.original = mask_mod  # type: ignore[attr-defined]  # the caller's, kept per call
    rule: Any = checked
    if is_compiling(batch_index):  # evaluated outside inductor's codegen (its // bug)
        from .._paths._opaque import opaque_rule

        rule = opaque_rule(checked, mask_mod)
    out: dict[str, Any] = {"mask_mod": rule}
    if block_mask is not None:
        out["block_host"] = block_mask.host()
        out["state_block"] = block_mask.block_size
        if _route.library(batch_index).walk == "traced":  # the traced loop reads them by value
            states = block_mask.states
            if library_name(states) != library_name(batch_index):  # built elsewhere: copy
                states = xp.asarray(to_host(states))
            b = states.shape[0]
            lead = plan.batch if b != 1 else (1,) * len(plan.batch)
            out["block_states"] = xp.reshape(states, (*lead, *states.shape[1:]))
    elif getattr(mask_mod, "block_states", None) is not None:  # a ready rule's, by arithmetic
        out["block_host"] = mask_mod.block_states
    elif has_concrete_values(batch_index) and not _route.library(batch_index).task_graphs:
        out["block_host"] = LazyHostStates(
            xp, checked, batch_index, plan.num_q_heads, plan.q_len, plan.kv_len, plan.device
        )
    elif getattr(mask_mod, "rough_states", None) is not None:  # a rule with values: sound
        out["block_host"] = mask_mod.rough_states
    elif (
        getattr(mask_mod, "length_states", None) is not None
        and _route.library(batch_index).walk == "traced"
    ):  # a rule aligned by traced lengths: its states by value, in the program
        block = (_route.DEFAULT_MASK_BLOCK, _route.DEFAULT_MASK_BLOCK)
        states = mask_mod.length_states(xp, block)  # (*lengths' batch, nq, nk)
        grid = tuple(states.shape[-2:])
        states = xp.reshape(states, (*states.shape[:-2], 1, *grid))  # a head axis
        out["block_states"] = xp.broadcast_to(states, (*plan.batch, 1, *grid))
        out["state_block"] = block
    return out


def _with_head_axis(xp: Any, x: Array) -> Array:
    """Give a 2-D input its head axis (a view; the dtype is kept)."""
    return xp.expand_dims(x, axis=0) if x.ndim == 2 else x  # (1, L, D)


def _at_least_2d(xp: Any, x: Array) -> Array:
    """Give a 0-d or (Lk,) mask or bias its query (and key) axes, so blocks can slice it."""
    if x.ndim >= 2:
        return x
    return xp.reshape(x, (1, 1)) if x.ndim == 0 else xp.expand_dims(x, axis=0)


def _checked_score_mod(xp: Any, score_mod: Callable[..., Array]) -> Callable[..., Array]:
    """`score_mod`, with its result checked (static metadata only, so jit-safe)."""
    rule = v.guarded_rule("score_mod", score_mod)

    def checked(scores: Array, *index: Array) -> Array:
        result = rule(scores, *index)
        v.check_score_mod_result(xp, result, scores)
        return result

    return checked
