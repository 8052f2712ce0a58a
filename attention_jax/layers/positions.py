"""qk-norm and rotary positions: the multi-head step after the projections.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key length, H head dim, P position axes (``Rope(sections=...)``).

Per head: qk-norm, then rotary embeddings at each token's position (qk-norm
after them with ``QKNorm(after_rope=True)``, Llama 4's order). A memory's
keys (``project_memory``) were normalised when projected and carry no
positions. The positions are the call's (``positions``, ``kv_positions``);
else, while decoding, each example's slots, counted from its first real
token when it is left-padded (``caches.Step.rotary``); else they restart
per document with segment ids; else ``arange``, queries bottom-right
aligned (``S - T + i``, the package's convention). Masks and score
modifiers never see these positions: they index tokens or cache slots.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.layers import caches
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib


def normalize_and_rotate(config, params, q: jax.Array, k: jax.Array, call,
                         step) -> tuple[jax.Array, jax.Array]:
  """``q [B, N, T, H]`` and ``k [B, K, S, H]`` normalised and rotated as
  ``config`` (a ``multi_head_config.Config``) says; ``call`` is the
  ``multi_head.Call``, ``step`` the cache's ``caches.Step`` or None."""
  norm, rope = config.qk_norm, config.rope
  # A memory's keys are normalised already (and, another layer's, rotated);
  # a shared cache's keys are that layer's, normalised and rotated there.
  keys_too = call.memory is None and not isinstance(call.cache, caches.Shared)
  if norm is not None and not norm.after_rope:  # Gemma's order
    q, k = _normalize(params, q, k, norm, keys_too)
  if rope is not None:
    q_rot, k_rot = rotary_positions(call, step, q.shape[2], k.shape[2])
    seq_len = None
    if rope.scaling in ("dynamic", "longrope"):  # one length: q and k share
      # their frequencies
      seq_len = jnp.maximum(jnp.max(q_rot), jnp.max(k_rot)) + 1
    q = rope_lib.apply_rope(q, q_rot, rope=rope, seq_len=seq_len)
    if keys_too:
      k = rope_lib.apply_rope(k, k_rot, rope=rope, seq_len=seq_len)
  if norm is not None and norm.after_rope:  # Llama 4's order
    q, k = _normalize(params, q, k, norm, keys_too)
  return q, k


def _normalize(params, q, k, norm: qk_norm_lib.QKNorm, keys_too: bool):
  q = qk_norm_lib.normalize(q, params, "q_norm", norm)
  if keys_too:
    k = qk_norm_lib.normalize(k, params, "k_norm", norm)
  return q, k


def default_positions(t: int, s: int, mask: Mask):
  """Positions of a call's queries and keys when none are given: restarting
  per document with segment ids (``[B, 1, T]``), else ``S - T + i`` for
  the queries and ``j`` for the keys."""
  if mask.q_segment_ids is not None:
    def as_heads(ids):
      ids = jnp.asarray(ids)
      positions = rope_lib.segment_positions(ids)
      return positions[:, None, :] if ids.ndim == 2 else positions
    return as_heads(mask.q_segment_ids), as_heads(mask.kv_segment_ids)
  return s - t + jnp.arange(t), jnp.arange(s)


def as_positions(name: str, positions: Any, b: int, length: int, what: str):
  """``[B, T]`` or ``[T]`` integer positions as ``[B|1, 1, T]`` (a head axis).

  Multimodal positions (``Rope(sections=...)``), ``[P, B, T]`` or ``[P, 1,
  T]``, become ``[P, B|1, 1, T]``; ``apply_rope`` checks ``P`` against the
  sections, and refuses plain positions (rank 3 here) for them.
  """
  if isinstance(positions, (list, tuple)):
    positions = jnp.asarray(positions)
  dtype = jnp.result_type(positions)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array [B, {what}] (or "
                    f"[{what}] shared by the batch), got dtype {dtype}.")
  shape = checks.shape_of(positions)
  if len(shape) == 3 and shape[1:] in ((b, length), (1, length)):
    return jnp.asarray(positions)[:, :, None, :]  # [P, B|1, 1, T]
  if shape not in ((b, length), (length,), (1, length)):
    raise ValueError(
        f"{name} has shape {shape}, expected [B, {what}] = {(b, length)} (or "
        f"[{what}] = ({length},) shared by the batch): one position per "
        f"token; multimodal ones (Rope(sections=...)) [P, B, {what}] = "
        f"(len(sections), {b}, {length}) or [P, 1, {what}].")
  return jnp.asarray(positions).reshape((-1, 1, length))  # [B|1, 1, T]


def rotary_positions(call, step, t: int, s: int):
  """The positions queries and keys are rotated at (see the module doc)."""
  b = call.query.shape[0]
  positions, kv_positions = call.positions, call.kv_positions
  if step is not None:  # keys are this call's tokens, rotated before caching
    if kv_positions is not None:
      raise ValueError(
          "kv_positions is for attention over keys other than this call's "
          "tokens; while decoding the cached keys are this call's tokens, "
          "at `positions`.")
    # Plain positions: apply_rope refuses them for Rope(sections=...),
    # which needs explicit ones.
    rot = (step.rotary[:, None, :] if positions is None  # [B, 1, T]
           else as_positions("positions", positions, b, t, "T"))
    return rot, rot
  q_rot, k_rot = default_positions(t, s, call.mask)
  if positions is not None:
    q_rot = as_positions("positions", positions, b, t, "T")
  if kv_positions is not None:
    k_rot = as_positions("kv_positions", kv_positions, b, s, "S")
  elif positions is not None and call.memory is not None:
    k_rot = q_rot  # a memory's keys are not rotated here (rotary_positions'
    # caller rotates only the queries then)
  elif positions is not None:
    if not (call.key is call.query and call.value is call.query):
      raise ValueError(
          f"positions gives the queries' positions; with keys other than the "
          f"queries (S={s}, T={t}) pass kv_positions [B, S] too (the keys "
          "take the queries' positions only in self-attention, key and value "
          "the query itself).")
    k_rot = q_rot
  return q_rot, k_rot
