"""``torch.compile``: a ``mask_mod`` evaluated as one opaque operation, not in the graph.

Inductor (torch 2.13, CPU) miscompiles a floor division of positions built in its
graph: a document rule ``q_idx // 300 == kv_idx // 300`` gave wrong masks, and so
errors of 2.4 or NaN in the attention (reproducible with torch alone). Under
``torch.compile`` the rule is therefore called through a custom operator, which
inductor runs as it is, on the index tensors its graph built: the same values as
eager. The operator broadcasts the rule's result to the block's full shape
(``(*batch, Hq, bq, bk)``), which its fake implementation states without calling
the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["opaque_rule"]

#: the rules a compiled graph calls, by the identity of the user's ``mask_mod``
_RULES: dict[int, Callable[..., Any]] = {}
_DEFINED: list[bool] = []


def opaque_rule(rule: Callable[..., Any], user_rule: Any) -> Callable[..., Any]:
    """Return `rule` (of `user_rule`) as a call of the opaque operator."""
    import torch

    _define()
    key = id(user_rule)
    _RULES[key] = rule

    def evaluated(batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.ops.portable_attn.mask_rule(batch, head, q_idx, kv_idx, key)

    return evaluated


def _define() -> None:
    """Define the operator once (a flag, not ``functools.cache``: dynamo warns of that)."""
    if _DEFINED:
        return
    _DEFINED.append(True)
    import torch

    def shape(*index: Any) -> Any:
        return torch.broadcast_shapes(*(x.shape for x in index))

    schema = "(Tensor batch, Tensor head, Tensor q_idx, Tensor kv_idx, int rule) -> Tensor"

    @torch.library.custom_op("portable_attn::mask_rule", mutates_args=(), schema=schema)
    def mask_rule(batch: Any, head: Any, q_idx: Any, kv_idx: Any, rule: int) -> Any:
        out = _RULES[rule](batch, head, q_idx, kv_idx)
        return torch.broadcast_to(out, shape(batch, head, q_idx, kv_idx)).clone()

    @mask_rule.register_fake
    def _(batch: Any, head: Any, q_idx: Any, kv_idx: Any, rule: int) -> Any:
        return batch.new_empty(shape(batch, head, q_idx, kv_idx), dtype=torch.bool)
