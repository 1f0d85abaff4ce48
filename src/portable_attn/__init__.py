"""portable_attn: one scaled-dot-product attention for every array-API library.

Write it once against the Python array API standard, run it unchanged on NumPy,
PyTorch, JAX, CuPy, array-api-strict and Dask.
"""

from __future__ import annotations

from ._attention import attention_weights, scaled_dot_product_attention
from ._causal import causal_mask
from .alibi import get_alibi_slopes

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "attention_weights",
    "causal_mask",
    "get_alibi_slopes",
    "scaled_dot_product_attention",
]
