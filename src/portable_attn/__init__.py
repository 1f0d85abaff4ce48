"""portable_attn: one scaled-dot-product attention for every array-API library.

Write it once against the Python array API standard, run it unchanged on NumPy,
PyTorch, JAX, CuPy, array-api-strict and Dask.
"""

from ._attention import attention_weights, scaled_dot_product_attention
from .alibi import get_alibi_slopes
from .kv_cache import KVCache, kv_cache_append, kv_cache_attention, kv_cache_init
from .masks import causal_mask
from .merge import merge_attention
from .mha import init_mha_params, multi_head_attention
from .norms import l2_normalize, rms_norm
from .rope import apply_rope, rope_frequencies
from .serving import (
    PagedPlan,
    paged_kv_write,
    plan_ragged,
    ragged_paged_attention,
    varlen_attention,
)

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "PagedPlan",
    "__version__",
    "apply_rope",
    "attention_weights",
    "causal_mask",
    "get_alibi_slopes",
    "init_mha_params",
    "kv_cache_append",
    "kv_cache_attention",
    "kv_cache_init",
    "l2_normalize",
    "merge_attention",
    "multi_head_attention",
    "paged_kv_write",
    "plan_ragged",
    "ragged_paged_attention",
    "rms_norm",
    "rope_frequencies",
    "scaled_dot_product_attention",
    "varlen_attention",
]


def __dir__() -> list[str]:
    # The public namespace is __all__: the submodules imported above (rope, mha...)
    # stay attributes, for `import portable_attn.rope`, but are not listed.
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
