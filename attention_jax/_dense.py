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
from attention_jax import masks
from attention_jax import softmax


def single_head(query, key, value, mask, bias, length, keep, *, scale,
                is_causal, dropout_rate, out_dtype, compute_dtype, want_lse):
  """One head: q ``[T, H]``, k ``[S, H]``, v ``[S, Hv]``.

  ``mask``/``bias`` are ``[T|1, S|1]`` or None, ``length`` an int scalar
  (valid keys) or None, ``keep`` the ``[T, S]`` dropout draw or None.
  Returns ``(out [T, Hv], weights [T, S], lse [T] or None)``; weights and
  lse in ``compute_dtype``, out in ``out_dtype``.
  """
  t, s = query.shape[0], key.shape[0]
  allowed = None
  if mask is not None:
    allowed = jnp.broadcast_to(mask, (t, s))
  if length is not None:
    valid = jnp.broadcast_to(jnp.arange(s)[None, :] < length, (t, s))
    allowed = valid if allowed is None else allowed & valid
  if allowed is not None:  # padding may hold NaN: keep it out of every product
    key, value = _numerics.zero_unseen(jnp.any(allowed, axis=0), key, value)
  if is_causal:
    causal = masks.causal_mask(t, s)
    allowed = causal if allowed is None else allowed & causal
  logits = jnp.einsum("TH,SH->TS", query, key,
                      preferred_element_type=compute_dtype)  # [T, S]
  logits = logits * jnp.asarray(scale, compute_dtype)
  if bias is not None:
    logits = logits + jnp.broadcast_to(bias.astype(compute_dtype), (t, s))
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
