"""Attention dropout as a counter-based draw: one bit per (seed, b, h, q, kv).

Shape glossary: bq, bk the rows and columns of one block of scores (any
block: the whole ``[T, S]`` of the dense kernel or a ``[bq, bk]`` tile of
the flash walk).

Every kernel with dropout draws its keep mask here, so that the same seed
and rate drop the same entries whichever kernel runs, and a blockwise
kernel regenerates a block's mask in its backward pass instead of storing
``[T, S]`` bits (FlashAttention and torch's fused SDPA do the same with
Philox). The draw is a hash of the entry's coordinates:

* ``seed_words(rng)``: two uint32 words from the call's ``dropout_rng``;
* ``row_keys(seed, b, h, q_idx)``: one uint32 per query row of head
  ``(b, h)`` (``q_idx`` the row's index as ``score_mod`` sees it: global
  under a ring or a decoding offset);
* ``keep(rows, kv_idx, threshold)``: the ``[bq, bk]`` bool keep mask;
  ``threshold(rate)`` is the int32 below which a 24-bit draw is dropped.

The mixing function is MurmurHash3's 32-bit finaliser (a bijection with
full avalanche); each column index enters by XOR before the last mix, so
no two rows' masks are shifted copies of each other. Only uint32 multiply,
xor and shift: the same code runs in XLA and inside a Pallas kernel.

A draw keeps an entry when its top 24 bits reach ``floor(rate * 2**24)``:
the kept fraction is ``1 - rate`` to within ``2**-24``, and kernels scale
kept probabilities by ``1 / (1 - rate)`` (inverted dropout: the expected
output is the output without dropout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_U32 = jnp.uint32
# Odd multipliers: MurmurHash3's finaliser constants and the golden ratio.
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_B, _H, _Q, _KV = 0x9E3779B1, 0x7FEB352D, 0x846CA68B, 0x9E3779B9


def _mix(x):
  """MurmurHash3's fmix32 on uint32 arrays."""
  x = x ^ (x >> 16)
  x = x * _U32(_M1)
  x = x ^ (x >> 13)
  x = x * _U32(_M2)
  return x ^ (x >> 16)


def seed_words(rng) -> jax.Array:
  """Two uint32 words drawn from ``rng`` (a ``jax.random.key``): the call's
  seed, the same for every head and block."""
  return jax.random.bits(rng, (2,), _U32)  # [2]


def row_keys(seed, b, h, q_idx) -> jax.Array:
  """One uint32 per query row of head ``(b, h)``; broadcasts like ``q_idx``.

  ``b`` and ``h`` are the head's indices (``base.Head.index``, as
  ``score_mod`` sees them), ``q_idx`` the rows' indices.
  """
  u = lambda x: jnp.asarray(x).astype(_U32)  # noqa: E731 (wraps negatives)
  x = _mix(seed[0] ^ (u(b) * _U32(_B)))
  x = _mix(x ^ seed[1] ^ (u(h) * _U32(_H)))
  return _mix(x ^ (u(q_idx) * _U32(_Q)))


def threshold(rate) -> jax.Array:
  """The int32 draw below which an entry is dropped: ``floor(rate * 2**24)``
  (exact in float32 for a rate in [0, 1))."""
  return jnp.floor(jnp.asarray(rate, jnp.float32) * (1 << 24)).astype(
      jnp.int32)


def keep(rows, kv_idx, cut) -> jax.Array:
  """The keep mask: ``rows`` (``row_keys``, ``[bq, 1]``) against columns
  ``kv_idx`` (``[1, bk]``), ``cut`` a ``threshold``; ``[bq, bk]`` bool."""
  bits = _mix(rows ^ (jnp.asarray(kv_idx).astype(_U32) * _U32(_KV)))
  return (bits >> 8).astype(jnp.int32) >= cut


def keep_mask(seed, b, h, q_idx, kv_idx, rate) -> jax.Array:
  """``keep(row_keys(seed, b, h, q_idx), kv_idx, threshold(rate))``."""
  return keep(row_keys(seed, b, h, q_idx), kv_idx, threshold(rate))
