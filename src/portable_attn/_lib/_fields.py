"""Every array field of an attention call, declared once with its role.

A call (:class:`portable_attn._lib._call.AttentionCall`) carries Q, K, V and the
model-building arrays. Each is declared here, once: where it lives (the call,
its :class:`~._scores.ScoreTerms` or its :class:`~._scores.AttentionPlan`), its
role and the grid axes of its trailing dimensions (leading ones are the batch).
The drivers of the kernel -- the torch and JAX autodiff wrappers, the Dask tasks,
the mesh code -- loop over :data:`FIELDS` through
:meth:`~._call.AttentionCall.flatten` / :meth:`~._call.AttentionCall.unflatten`
instead of naming fields, so adding a field touches its declaration here, its
validation and the kernel code that uses it.

Roles
-----
operand
    Q, K, V: the kernel slices them along their sequence axis.
block
    Sliced per (query block, key block) with the scores: bias, mask, dropout
    keep-mask, segment ids.
whole
    Read whole by every block: lengths, the ALiBi slopes, the batch index of
    ``score_mod``.
learned
    A learned scalar or logit that receives gradients: an array `scale` or
    `softcap` (0-d, in the plan) and the `sinks`.

Static facts (shapes, a float scale, causal/window, dtypes, device, the
alignment) are the plan's fields; callables and host objects (``score_mod``,
the dropout factor, the host segment skipper) stay in the terms as they are.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FIELDS", "SCORE_AXES", "Field", "Role", "axis_of", "field"]


class Role(enum.Enum):
    """What the kernel does with a field (see the module docstring)."""

    OPERAND = "operand"
    BLOCK = "block"
    WHOLE = "whole"
    LEARNED = "learned"


#: Grid axes of everything shaped like the scores (..., Hq, Lq, Lk), size-1 axes broadcast.
SCORE_AXES = ("hq", "lq", "lk")


@dataclass(frozen=True)
class Field:
    """One array field of a call.

    Attributes
    ----------
    name : str
        Its attribute name on its owner.
    owner : {"call", "terms", "plan"}
        Where it lives.
    role : Role
    differentiable : bool
        Receives a gradient under torch autograd and ``jax.grad``.
    axes : tuple of str
        Grid axes of its trailing dimensions: ``hq``/``hkv`` heads, ``lq``/``lk``
        positions, ``dk``/``dv`` features. Leading dimensions are batch axes.
        An axis of size one broadcasts.
    once_per_row : float or None
        A term of every row's softmax that belongs to no key (the sink logit): when
        the keys are split into parts (Dask chunk pairs, devices of a mesh), only one
        part of a row may count it; the others get this neutral value (``-inf``:
        ``exp(-inf) = 0``) or leave it out. None for every other field.
    """

    name: str
    owner: Literal["call", "terms", "plan"]
    role: Role
    differentiable: bool = False
    axes: tuple[str, ...] = SCORE_AXES
    once_per_row: float | None = None


FIELDS: tuple[Field, ...] = (
    Field("query", "call", Role.OPERAND, True, ("hq", "lq", "dk")),
    Field("key", "call", Role.OPERAND, True, ("hkv", "lk", "dk")),
    Field("value", "call", Role.OPERAND, True, ("hkv", "lk", "dv")),
    Field("bias", "call", Role.BLOCK, True),  # (..., Hq|1, Lq|1, Lk|1)
    Field("mask", "terms", Role.BLOCK),  # (..., Hq|1, Lq|1, Lk|1)
    Field("dropout_keep", "terms", Role.BLOCK),  # (..., Hq|1, Lq|1, Lk|1)
    Field("q_segments", "terms", Role.BLOCK),  # (*batch, 1, Lq, 1)
    Field("kv_segments", "terms", Role.BLOCK),  # (*batch, 1, 1, Lk)
    Field("q_lengths", "terms", Role.WHOLE),  # (*batch, 1, 1, 1)
    Field("kv_lengths", "terms", Role.WHOLE),  # (*batch, 1, 1, 1)
    Field("batch_index", "terms", Role.WHOLE),  # (*batch, 1, 1, 1), for score_mod
    # a block mask's states (*batch|1, Hq|1, nq, nk), read by value in the traced loop
    Field("block_states", "terms", Role.WHOLE, axes=("hq", "q_blocks", "k_blocks")),
    Field("alibi_slopes", "terms", Role.WHOLE, True),  # (..., Hq, 1, 1)
    Field("sinks", "terms", Role.LEARNED, True, once_per_row=-math.inf),  # (..., Hq, 1, 1)
    Field("scale", "plan", Role.LEARNED, True, ()),  # 0-d when learned
    Field("softcap", "plan", Role.LEARNED, True, ()),  # 0-d when learned
)

_BY_NAME = {f.name: f for f in FIELDS}


def field(name: str) -> Field:
    """Return the declaration of the field `name`."""
    return _BY_NAME[name]


def axis_of(name: str, x: Any, axis: str) -> int | None:
    """Return the dimension of field `name`'s array `x` along grid `axis`, or None.

    None when the field has no such axis or broadcasts along it (size one).
    """
    axes = field(name).axes
    if axis not in axes:
        return None
    d = x.ndim - len(axes) + axes.index(axis)
    return None if d < 0 or x.shape[d] == 1 else d
