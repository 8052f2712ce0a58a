"""The cuDNN kernel: ``jax.nn.dot_product_attention(implementation="cudnn")``.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim.

Our layout is ``[B, N, T, H]``, jax.nn's ``[B, T, N, H]``; jax.nn does
grouped-query attention itself (``K`` dividing ``N``). Not run on a GPU in
this project's CI: the dispatcher only picks it where ``problem`` finds
nothing in the way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_jax import _checks
from attention_jax import masks


def problem(query, key, value, mask, bias, lengths, return_lse,
            structured=()) -> str | None:
  """Why the cuDNN kernel cannot take these inputs, or None if it can.

  ``structured`` names the pattern arguments in use; none goes to cuDNN yet
  (its window and query lengths align top-left, ours bottom-right), so the
  automatic choice falls back to blockwise and never changes the numbers.
  """
  if jax.default_backend() != "gpu":
    return f"it needs a GPU, the backend is {jax.default_backend()!r}"
  dtype = jnp.result_type(query, key, value)
  if dtype not in (jnp.float16, jnp.bfloat16):
    return f"it needs float16/bfloat16 inputs, got {dtype}"
  shapes = [_checks.shape_of(x) for x in (query, key, value)]
  if any(len(s) != 4 for s in shapes) or shapes[1] != shapes[2]:
    return f"it needs [B, N, T, H] inputs with equal key/value shapes: {shapes}"
  h = shapes[0][-1]
  if h > 128 or h % 8:
    return f"it needs a head dim <= 128 and a multiple of 8, got {h}"
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None and x.ndim != 4:
      return f"{name} must be 4-D [B|1, N|1, T|1, S|1], got {x.shape}"
  if lengths is not None and (lengths.ndim != 2 or lengths.shape[1] != 1):
    return ("it takes one key/value length per example: "
            f"key_value_seq_lengths must be [B, 1], got {lengths.shape}")
  if return_lse:
    return "it does not return the log-sum-exp"
  if structured:
    return f"{', '.join(structured)} not wired to cuDNN here"
  return None


def attention(query, key, value, mask, bias, lengths, *, scale, is_causal):
  """jax.nn's fused kernel; our bottom-right causal mask made explicit."""
  t, s = query.shape[-2], key.shape[-2]
  if is_causal and t != s:  # jax.nn aligns top-left; ours is bottom-right
    causal = masks.causal_mask(t, s)[None, None]
    mask = causal if mask is None else mask & causal
    is_causal = False
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # [B, N, T, H] <-> [B, T, N, H]
  if mask is not None:
    mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))
  if lengths is not None:
    lengths = jnp.broadcast_to(lengths[:, 0], (query.shape[0],))
  out = jax.nn.dot_product_attention(
      swap(query), swap(key), swap(value), bias=bias, mask=mask, scale=scale,
      is_causal=is_causal, key_value_seq_lengths=lengths,
      implementation="cudnn")
  return swap(out)
