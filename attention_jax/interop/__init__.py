"""Meeting other libraries: their signatures, weights and checkpoints.

``jax_nn`` (``jax.nn.dot_product_attention``'s signature), ``flax_fn``
(flax's ``attention_fn``), ``torch_convert`` (``torch.nn.MultiheadAttention``
weights) and ``checkpoints`` (one attention layer of a Hugging Face
checkpoint).
"""
