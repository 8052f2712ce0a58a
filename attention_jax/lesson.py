"""The lesson's two functions, as the textbook writes them: read this first.

Shape glossary: B batch, T query length, S key/value length, N heads, H head
dim (``d_k``), D model dim.

``scaled_dot_product_attention`` is ``softmax(Q K^T / sqrt(d_k)) V`` in the
lesson's four steps; ``multi_head_attention`` is its ``MultiHeadAttention``:
project, split into heads, attend, concatenate, project out. Nothing else:
no kernels, no cache, no rotary positions, no sharding, no checks. The
library's ``aj.scaled_dot_product_attention`` and ``aj.multi_head_attention``
compute the same numbers (``docs/lesson.md`` runs both side by side) and add
what this leaves out: one ``aj.Mask`` for every pattern, rows that may see
nothing (here they average every value, as the textbook's ``-1e9`` does;
there they give 0), blockwise and fused kernels, grouped heads, decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scaled_dot_product_attention(q, k, v, mask=None):
  """``softmax(q k^T / sqrt(d_k)) v``: ``[B, T, H] x [B, S, H] x [B, S, H]``.

  Args:
    q: queries ``[..., T, H]``: what each position is looking for.
    k: keys ``[..., S, H]``: what each input position offers.
    v: values ``[..., S, Hv]``: what it hands over.
    mask: optional bool ``[..., T, S]`` (broadcastable), True = may attend.

  Returns:
    ``(output [..., T, Hv], weights [..., T, S])``.

  Example:
    >>> q = k = v = jnp.eye(3)[None]  # [B=1, T=3, H=3]
    >>> out, weights = scaled_dot_product_attention(q, k, v)
    >>> bool(jnp.allclose(weights.sum(-1), 1.0))  # each row sums to 1
    True
  """
  d_k = q.shape[-1]
  # 1. Scores: how well each query matches each key, scaled by sqrt(d_k).
  scores = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(d_k)  # [..., T, S]
  # 2. Mask: a position that may not be seen gets a score of -1e9.
  if mask is not None:
    scores = jnp.where(mask, scores, -1e9)
  # 3. Softmax over the keys: the attention weights, each row sums to 1.
  weights = jax.nn.softmax(scores, axis=-1)
  # 4. The output: the values, weighted.
  return weights @ v, weights


def multi_head_attention(params, query, key, value, num_heads, mask=None):
  """The lesson's ``MultiHeadAttention.forward`` on ``aj`` parameters.

  Args:
    params: ``{"W_q", "W_k", "W_v", "W_o"}``, each ``{"kernel", "bias"}``,
      from ``aj.init_multi_head_params`` (or a module's ``params_dict()``):
      kernels ``[D, N, H]`` (``[N, H, D]`` for ``W_o``), read here as the
      lesson's ``[D, D]`` matrices.
    query: ``[B, T, D]``.
    key: ``[B, S, D]``.
    value: ``[B, S, D]``.
    num_heads: ``N``.
    mask: optional bool, broadcastable to ``[B, N, T, S]``.

  Returns:
    ``[B, T, D]``.

  Example:
    >>> import attention_jax as aj
    >>> p = aj.init_multi_head_params(jax.random.key(0), 8, 2)
    >>> x = jnp.ones((1, 3, 8))
    >>> multi_head_attention(p, x, x, x, num_heads=2).shape
    (1, 3, 8)
  """
  def linear(x, layer):  # x @ W + b, with W as one [in, out] matrix
    w = layer["kernel"].reshape(x.shape[-1], -1)  # [in, out]
    b = layer["bias"].reshape(1, 1, -1)  # [1, 1, out]
    return x @ w + b

  def split_heads(x):  # [B, L, D] -> [B, N, L, D / N]
    b, length, d = x.shape
    return x.reshape(b, length, num_heads, d // num_heads).transpose(0, 2, 1, 3)

  q = split_heads(linear(query, params["W_q"]))  # [B, N, T, H]
  k = split_heads(linear(key, params["W_k"]))  # [B, N, S, H]
  v = split_heads(linear(value, params["W_v"]))  # [B, N, S, H]
  out, _ = scaled_dot_product_attention(q, k, v, mask)  # every head at once
  b, _, t, h = out.shape
  out = out.transpose(0, 2, 1, 3).reshape(b, t, num_heads * h)  # concat heads
  return linear(out, params["W_o"])  # [B, T, D]
