"""Ready adapters that put portable_attn where frameworks call attention.

Each submodule imports its framework only when it is used, and names the extra
to install when it is missing:

================================ ============================================ ==============
module                           what it gives                                extra
================================ ============================================ ==============
``integrations.transformers``    ``register(name)``: an ``attn_implementation``  ``transformers``
                                 for Hugging Face models
``integrations.flax``            ``attention_fn``: for ``flax.nnx`` and          ``flax``
                                 ``flax.linen`` multi-head attention
``integrations.keras``           ``MultiHeadAttention``: a                      ``keras``
                                 ``keras.layers.MultiHeadAttention``
================================ ============================================ ==============

What the frameworks mean by their arguments (masks, causal alignment, layouts,
dropout) and how each maps onto :func:`portable_attn.scaled_dot_product_attention`
is written in each module's docstring; the one conversion they share, the
top-left causal convention, is :func:`portable_attn.integrations._common.top_left_causal`.
"""
