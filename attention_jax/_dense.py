"""The dense kernel: the whole ``[T, S]`` score matrix of one head at once.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim.

Written for one head and lifted over leading dims by
``_broadcast.lift_heads``. Logits, softmax and the weighted sum run in the
compute dtype (float32, float64 for float64 inputs); one path whether or not
the weights are returned or dropout is on, so the numbers never change with
those options. The only kernel with dropout, weights and float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_jax import _numerics
from attention_jax import _patterns
from attention_jax import softmax


def single_head(query, key, value, mask, bias, length, q_length, keep, *,
                scale, is_causal, window, softcap, dropout_rate, out_dtype,
                compute_dtype, want_lse):
  """One head: q ``[T, H]``, k ``[S, H]``, v ``[S, Hv]``.

  ``mask``/``bias`` are ``[T|1, S|1]`` or None, ``length``/``q_length`` int
  scalars (valid keys / queries) or None, ``keep`` the ``[T, S]`` dropout
  draw or None; ``window`` and ``softcap`` as in ``_patterns`` / the flash
  core.
  Returns ``(out [T, Hv], weights [T, S], lse [T] or None)``; weights and
  lse in ``compute_dtype``, out in ``out_dtype``.
  """
  t, s = query.shape[0], key.shape[0]
  allowed = None
  if mask is not None:
    allowed = jnp.broadcast_to(mask, (t, s))
  rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  pattern = _patterns.visible(rows, cols, s - t,
                              _patterns.bounds(is_causal, window), q_length,
                              length)
  if pattern is not None:
    pattern = jnp.broadcast_to(pattern, (t, s))
    allowed = pattern if allowed is None else allowed & pattern
  if allowed is not None:  # padding may hold NaN: keep it out of every product
    key, value = _numerics.zero_unseen(jnp.any(allowed, axis=0), key, value)
  logits = jnp.einsum("TH,SH->TS", query, key,
                      preferred_element_type=compute_dtype)  # [T, S]
  logits = logits * jnp.asarray(scale, compute_dtype)
  if bias is not None:
    logits = logits + jnp.broadcast_to(bias.astype(compute_dtype), (t, s))
  if softcap is not None:
    if bias is not None:  # a -inf bias blocks; the cap would make it finite
      finite = logits > -jnp.inf
      allowed = finite if allowed is None else allowed & finite
    logits = softcap * jnp.tanh(logits / softcap)
  if allowed is None and bias is None:
    # Nothing can be blocked (finite inputs give finite logits): the plain
    # stable softmax, same numbers, fewer passes over [T, S].
    weights = jax.nn.softmax(logits, axis=-1)  # [T, S]
    lse = jax.nn.logsumexp(logits, axis=-1) if want_lse else None
  else:
    weights = softmax.masked_softmax(logits, allowed)  # [T, S]
    lse = softmax.masked_logsumexp(logits, allowed) if want_lse else None
  probs = weights
  if keep is not None:  # inverted dropout: E[probs] == weights
    probs = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("TS,SV->TV", probs, value.astype(compute_dtype),
                   preferred_element_type=compute_dtype)  # [T, Hv]
  return out.astype(out_dtype), weights, lse
