"""Cached decoding for multi-head attention: the cache, its writes, its masks.

Shape glossary: B batch, N query heads, K key/value heads, T this call's
tokens, L linear cache slots, W ring-buffer slots, S' the keys a query
attends over (``L``, or ``W + T`` for a ring buffer), H head dim.

``KVCache`` is what ``multi_head_attention`` threads through a decoding step
(``check_cache``: its fields' shapes and dtypes, a hand-built one's too);
``write`` appends this call's keys and values (``kv_cache``'s pure
updates) and returns what the queries attend over, with the call's
``Mask`` over the cache slots, so cached decoding equals the full forward.
A linear cache's slot ``j`` holds position ``j``: the mask stays the
layer's, causal, with the queries placed at ``q_offset = index`` (windows,
rules and score modifiers at those positions; no array over the slots, so
a chunked prefill into a long cache skips every block outside the band). A
ring buffer's slots hold changing positions: its causal band and window
become a per-example visibility mask over its ``W + T`` slots, a rule is
evaluated at their positions, and a score modifier sees them as
``q_idx``/``kv_idx``.

Left padding: a cache with ``left_padding [B]`` (each example's leading pad
tokens) never shows a key below it, and masks, rules and score modifiers
see positions counted from each example's first real token, so a
left-padded example decodes as the same tokens alone, in a linear cache or
a ring buffer.

Right padding needs the mask's ``q_lengths`` (each example's real new
tokens). A prefill without it caches every token; when the call's mask
hides the last new token from its own query (``kv_lengths`` or a dense
key-padding mask over the pads), pads are being cached: a ValueError at
trace time when the values are concrete, else the sticky ``pad_written``
flag that ``MultiHeadAttention.check_cache()`` raises from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.decoding import kv_cache
from attention_jax.masking import mask as mask_lib
from attention_jax.masking import selection


class KVCache(NamedTuple):
  """A key/value cache for ``multi_head_attention``'s ``cache``.

  ``key``/``value`` are ``[B, K, L, H]`` buffers: ``L`` positions of a
  linear cache, or ``W`` slots of a ring buffer when ``window`` is set (a
  sliding-window layer: position ``p`` lives in slot ``p % W`` and keys
  older than ``window`` are forgotten). ``index`` counts the tokens written
  per example (``[B]``, or a scalar for all). ``overflow`` (bool ``[B]``,
  sticky) marks examples whose write did not fit a linear cache: it is an
  error value, checked outside the step (``MultiHeadAttention.check_cache``)
  so decoding pays no host callback. ``left_padding`` (int32 ``[B]`` or
  None) counts each example's leading pad tokens: keys below it are never
  visible. ``pad_written`` (bool ``[B]``, sticky, or None) marks examples
  whose prefill without ``q_lengths`` cached a token its own query was
  masked from (right padding cached as tokens).
  """
  key: jax.Array
  value: jax.Array
  index: jax.Array
  overflow: jax.Array | None = None
  window: int | None = None
  left_padding: jax.Array | None = None
  pad_written: jax.Array | None = None


def check_cache(cache) -> None:
  """Raises unless ``cache`` is a ``KVCache`` whose fields agree.

  A layer's decoding step checks its cache here first (``layers/caches``
  ``place``), so a hand-built one is refused by field before its index
  is read: ``key``/``value`` float ``[B, K, L, H|Hv]`` sharing ``[B, K,
  L]``, ``index`` an integer scalar or ``[B]``; ``overflow`` and
  ``pad_written`` bool ``[B]``, ``left_padding`` integer ``[B]``, each
  or None.
  """
  if not isinstance(cache, KVCache):
    raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}.")
  for name, layout in (("key", "[B, K, L, H]"), ("value", "[B, K, L, Hv]")):
    x = getattr(cache, name)
    checks.check_float_array(f"cache.{name}", x)
    checks.check_rank(f"cache.{name}", x, (4,), layout)
  ck, cv = checks.shape_of(cache.key), checks.shape_of(cache.value)
  if ck[:3] != cv[:3]:
    raise ValueError(f"cache.key {ck} and cache.value {cv} must share [B, "
                     "K, L]: create both buffers with the same batch, heads "
                     "and length.")
  b = ck[0]
  kv_cache.check_index(cache.index, b, "cache.index")
  for name, kind in (("overflow", "bool"), ("pad_written", "bool"),
                     ("left_padding", "integer")):
    x = getattr(cache, name)
    if x is None:
      continue
    dtype = jnp.dtype(jnp.result_type(x))
    good = (dtype == jnp.bool_ if kind == "bool"
            else jnp.issubdtype(dtype, jnp.integer))
    if not good or checks.shape_of(x) != (b,):
      raise ValueError(
          f"cache.{name} must be {kind} [B] = [{b}] (B from cache.key "
          f"{ck}), or None, got {dtype} {checks.shape_of(x)}.")


def new_lengths(mask: mask_lib.Mask | None, b: int, t: int):
  """In decoding, the mask's ``q_lengths [B]`` is each example's new tokens."""
  lengths = None if mask is None else mask.q_lengths
  if lengths is None:
    return None
  if np.ndim(lengths) != 1 or np.shape(lengths)[0] != b:
    raise ValueError(
        f"while decoding, the mask's q_lengths is the number of real new "
        f"tokens per example (right-padded), integer [B] = [{b}]; got shape "
        f"{np.shape(lengths)}.")
  checks.check_range("the mask's q_lengths", lengths, t)
  return jnp.asarray(lengths, jnp.int32)


def _over_slots(mask: mask_lib.Mask | None, score_mod, visible, q_pos,
                key_pos, num_heads: int):
  """The call's mask and score modifier restated over cache slots.

  ``visible [B, T, S']`` says which slots each query may see, ``q_pos [B,
  T]`` and ``key_pos [B|1, S']`` are absolute positions. Returns ``(mask
  over [B, N|1, T, S'], score_mod over absolute positions)``.
  """
  mask = mask_lib.Mask() if mask is None else mask
  check_unplaced(mask)
  qp, kp = q_pos[:, :, None], key_pos[:, None, :]  # [B, T, 1], [B|1, 1, S']
  if mask.window is not None:
    left, right = mask.window
    visible = visible & (kp >= qp - left) & (kp <= qp + right)
  visible = visible[:, None]  # [B, 1, T, S']
  if mask.rule is not None:  # a rule at absolute positions, per (b, h)
    b = jnp.arange(q_pos.shape[0])[:, None, None, None]  # [B, 1, 1, 1]
    h = jnp.arange(num_heads)[None, :, None, None]  # [1, N, 1, 1]
    fn = mask_lib.rule_function(mask.rule)
    visible = visible & jnp.asarray(fn(b, h, qp[:, None], kp[:, None]))
  dense = visible if mask.dense is None else (
      visible & (jnp.asarray(mask.dense) != 0))
  out = mask_lib.Mask(q_lengths=mask.q_lengths, kv_lengths=mask.kv_lengths,
                      dense=dense)
  if score_mod is not None:
    q_abs = jnp.asarray(q_pos, jnp.int32)  # [B, T]
    k_abs = jnp.asarray(key_pos, jnp.int32)  # [B|1, S']
    inner = score_mod

    def absolute(score, b, h, q_idx, kv_idx):
      # Padded block rows (past T) clip: their outputs are dropped.
      k_row = k_abs[b] if k_abs.shape[0] > 1 else k_abs[0]
      return inner(score, b, h, jnp.take(q_abs[b], q_idx, mode="clip"),
                   jnp.take(k_row, kv_idx, mode="clip"))

    score_mod = absolute
  return out, score_mod


def check_unplaced(mask: mask_lib.Mask, *, key_selection: bool = False
                   ) -> None:
  """What a cache's slots cannot carry: segment ids, unions, positions, a
  selection (but, with ``key_selection``, a paged step's key-only one:
  its key blocks are the slots')."""
  if mask.q_segment_ids is not None:
    raise ValueError(
        "segment ids are not supported while decoding with a KV cache (the "
        "cache holds no segment ids): mask cache slots with a dense mask "
        "instead.")
  if isinstance(mask.rule, mask_lib.Union):
    raise ValueError("a union (|) of masks is not supported while "
                     "decoding (cache slots hold other positions than "
                     "its members' arrays): write it as one rule, "
                     "aj.MaskRule(fn, params).")
  if selection.is_selection(mask.rule) and not (
      key_selection and mask_lib.key_only(mask.rule)):
    raise ValueError(
        "the mask holds a selection (aj.select_blocks/select_tokens), whose "
        "rows are the call's query rows, while a KV-cache step places its "
        "queries at positions: pass the selection as an aj.MaskRule over "
        "positions (as aj.moba_attention does while decoding) or attend "
        "without the cache; a paged cache's step takes a selection of key "
        "blocks with one row for all its queries (query_block >= T).")
  if mask.positioned:
    raise ValueError(
        "the mask gives positions (q_offset/kv_offset), but while decoding "
        "the cache places the queries and keys (each example's tokens so "
        "far; init_cache(left_padding=) for left-padded prompts): drop them "
        "from the mask.")


def _at_positions(mask: mask_lib.Mask | None, index, pads, num_slots: int):
  """The call's mask over a linear cache's ``L`` slots, kept analytic.

  Slot ``j`` holds position ``j``: the queries stand at ``index + i``
  (``q_offset = index``), causality hides the slots not written yet, and
  the window and a rule compare and see those positions, so no ``[T, L]``
  array is built and the blockwise kernels skip every block outside the
  band. With ``left_padding`` positions count from each example's first
  real token (both offsets shifted by the pads) and the pad slots are
  hidden by a key-padding mask ``[B, 1, 1, L]``.
  """
  mask = mask_lib.Mask() if mask is None else mask
  check_unplaced(mask)
  q_offset, kv_offset, dense = index, None, mask.dense
  if pads is not None:
    shift = jnp.asarray(pads, jnp.int32)  # [B]
    q_offset, kv_offset = index - shift, -shift
    real = jnp.arange(num_slots)[None, :] >= shift[:, None]  # [B, L]
    real = real[:, None, None, :]  # [B, 1, 1, L]
    dense = real if dense is None else (jnp.asarray(dense) != 0) & real
  return mask_lib.Mask(
      causal=True, window=mask.window, q_lengths=mask.q_lengths,
      kv_lengths=mask.kv_lengths, dense=dense,
      rule=mask_lib.rule_function(mask.rule), q_offset=q_offset,
      kv_offset=kv_offset)


def _right_padding_hint(t: int, rows, left_padding: bool = True) -> str:
  """What a right-padded prefill did and how to fix it; ``left_padding``:
  whether this layer's cache takes ``init_cache(left_padding=)``."""
  return (
      f"a prefill of T={t} tokens without the mask's q_lengths caches all "
      f"T tokens of every example, but this call's mask hides the last of "
      f"them from its own query in examples {rows} (the mask's kv_lengths "
      "or a dense key-padding mask marks them as padding): right-padded "
      "prompts would put their pad tokens into the cache, each example's "
      "cache_index would advance by T, and later steps would attend to the "
      "pads. Pass the real lengths as mask=aj.Mask(q_lengths=lengths) (while "
      "decoding, each example's number of new tokens: only those are "
      "cached)" + (", or left-pad the prompts and give "
                   "init_cache(..., left_padding=pads)" if left_padding
                   else ""))


def _last_token_hidden(mask: mask_lib.Mask, index, t: int, num_slots: int,
                       pads, num_heads: int) -> jax.Array:
  """bool ``[B]``: no head lets the last new query see its own slot.

  ``mask`` is the call's (over the linear cache's slots: a dense part
  ``[B|1, N|1, T|1, L|1]``, ``kv_lengths``, a rule at positions);
  causality and windows show every query its own slot, so only the call's
  padding (or a rule) can hide it.
  """
  b = index.shape[0]
  slot = jnp.minimum(index + t - 1, num_slots - 1)  # [B]
  seen = jnp.ones((b, 1), bool)  # [B, N|1]
  if mask.dense is not None:
    dense = jnp.asarray(mask.dense) != 0
    dense = dense.reshape((1,) * (4 - dense.ndim) + dense.shape)
    last = dense[:, :, -1, :]  # [B|1, N|1, L|1]
    last = jnp.broadcast_to(last, (b, last.shape[1], num_slots))
    seen = seen & jnp.take_along_axis(last, slot[:, None, None],
                                      axis=2)[..., 0]
  if mask.kv_lengths is not None:  # scalar, [B] or [B, N]
    lengths = jnp.asarray(mask.kv_lengths)
    lengths = lengths.reshape(lengths.shape + (1,) * (2 - lengths.ndim))
    seen = seen & (slot[:, None] < lengths)  # [B, N|1]
  fn = mask_lib.rule_function(mask.rule)
  if fn is not None:  # at positions, per (b, h)
    shift = 0 if pads is None else jnp.asarray(pads, jnp.int32)
    q_at = (index + t - 1 - shift)[:, None]  # [B, 1]
    kv_at = (slot - shift)[:, None]
    seen = seen & jnp.asarray(fn(jnp.arange(b)[:, None],
                                 jnp.arange(num_heads)[None, :], q_at, kv_at))
  return ~jnp.any(seen, axis=1)


def _check_right_padding(mask: mask_lib.Mask, index, t: int, num_slots: int,
                         overflow, pads, num_heads: int,
                         left_padding_hint: bool = True) -> jax.Array:
  """``pad_written [B]`` of this call; raises when it is concrete and set.

  Concrete ``kv_lengths`` below ``T`` hide the last token whatever the
  (possibly traced) index, since its slot is at least ``T - 1``.
  """
  b = index.shape[0]
  if mask.kv_lengths is not None:
    try:
      lengths = np.asarray(mask.kv_lengths)
    except jax.errors.TracerArrayConversionError:
      lengths = None
    if lengths is not None:  # scalar, [B] or [B, N]: the most over heads
      most = lengths.reshape(lengths.shape[:1] + (-1,)).max(axis=1) if (
          lengths.ndim) else lengths
      short = np.flatnonzero(np.broadcast_to(most, (b,)) < t)
      if short.size:
        raise ValueError(_right_padding_hint(
            t, short.tolist(), left_padding_hint) + ".")
  hidden = _last_token_hidden(mask, index, t, num_slots, pads,
                              num_heads) & ~overflow
  if pads is not None:  # a left pad is hidden by design
    hidden = hidden & (index + t - 1 >= pads)
  if not isinstance(hidden, jax.core.Tracer) and np.asarray(hidden).any():
    raise ValueError(_right_padding_hint(
        t, np.flatnonzero(np.asarray(hidden)).tolist(),
        left_padding_hint) + ".")
  return hidden


def write(cache: KVCache, k, v, mask: mask_lib.Mask | None, bias,
          score_mod: Any, index, lengths, q_pos, num_heads: int,
          left_padding_hint: bool = True):
  """Writes this call's keys/values; what the queries attend over.

  ``lengths`` are the real new tokens per example (``new_lengths``) or
  None. ``q_pos [B, T]`` are the queries' slot positions (``index + i``);
  with ``cache.left_padding`` the masks and score modifiers see them, and
  the keys', counted from each example's first real token. Returns
  ``(keys, values, mask, score_mod, new cache)`` with keys and values
  ``[B, K, S', H]``: ``L`` slots of a linear cache (``write_linear``),
  ``W + T`` for a ring buffer (``write_ring``: its old slots, then the new
  keys).

  Raises:
    ValueError: a right-padded prefill without ``q_lengths`` whose mask
      shows it (concrete values; see ``_check_right_padding``).
  """
  if cache.window is None:
    return write_linear(cache, k, v, mask, score_mod, index, lengths,
                        num_heads, left_padding_hint)
  return write_ring(cache, k, v, mask, bias, score_mod, index, lengths, q_pos,
                    num_heads)


def write_linear(cache: KVCache, k, v, mask: mask_lib.Mask | None,
                 score_mod: Any, index, lengths, num_heads: int,
                 left_padding_hint: bool = True):
  """``write`` into a linear cache: slot ``j`` holds position ``j``, so the
  mask stays analytic (``_at_positions``); a right-padded prefill without
  ``q_lengths`` is caught here (``pad_written``)."""
  t = k.shape[2]
  pads = cache.left_padding
  ck, cv, _ = kv_cache.update_kv_cache(
      cache.key, cache.value, index, k, v, new_lengths=lengths,
      left_padding=pads)  # [B, K, L, H]
  overflow = kv_cache.cache_overflow(index, t if lengths is None else lengths,
                                     ck.shape[2])
  if cache.overflow is not None:
    overflow = overflow | cache.overflow
  pad_written = cache.pad_written
  # A right-padded prefill shows itself by masking the pads as keys.
  if lengths is None and t > 1 and mask is not None and (
      mask.kv_lengths is not None or mask.dense is not None):
    hidden = _check_right_padding(mask, index, t, ck.shape[2], overflow,
                                  pads, num_heads, left_padding_hint)
    pad_written = hidden if pad_written is None else pad_written | hidden
  new_cache = KVCache(ck, cv, index + (t if lengths is None else lengths),
                      overflow, None, pads, pad_written)
  return (ck, cv, _at_positions(mask, index, pads, ck.shape[2]), score_mod,
          new_cache)


def write_ring(cache: KVCache, k, v, mask: mask_lib.Mask | None, bias,
               score_mod: Any, index, lengths, q_pos, num_heads: int):
  """``write`` into a ring buffer of ``W`` slots: the queries attend over
  its old slots and the new keys (``W + T``), whose positions change per
  slot, so the band, window, rule and score modifier are restated over
  them (``_over_slots``)."""
  for name, x in (("a dense mask", None if mask is None else mask.dense),
                  ("bias", bias),
                  ("the mask's kv_lengths",
                   None if mask is None else mask.kv_lengths)):
    if x is not None:
      raise ValueError(
          f"{name} is not supported with a ring-buffer (sliding-window) "
          "cache, whose slots hold changing positions: the window and "
          "the per-example positions already say what each query sees. "
          "For left-padded prompts give the pad counts once, "
          "init_cache(..., left_padding=pads); for right-padded ones "
          "the mask's q_lengths.")
  pads = cache.left_padding
  keys, values, visible, key_pos, ck, cv = kv_cache.update_ring_cache(
      cache.key, cache.value, index, k, v, window=cache.window,
      new_lengths=lengths,
      left_padding=pads)  # [B, K, W + T, H]; visible [B, T, W + T]
  overflow = jnp.zeros(index.shape, bool)
  if cache.overflow is not None:
    overflow = overflow | cache.overflow
  if pads is not None:  # positions from each example's first real token
    shift = jnp.asarray(pads, jnp.int32)[:, None]  # [B, 1]
    q_pos, key_pos = q_pos - shift, key_pos - shift  # [B, T], [B, S']
  mask, score_mod = _over_slots(mask, score_mod, visible, q_pos, key_pos,
                                num_heads)
  count = k.shape[2] if lengths is None else lengths
  new_cache = KVCache(ck, cv, index + count, overflow, cache.window, pads,
                      cache.pad_written)
  return keys, values, mask, score_mod, new_cache


def cache_slots(layer_mask: mask_lib.Mask | None, max_length: int | None,
                window: int | None) -> tuple[int, int | None]:
  """A new cache's slots ``L`` and, for a ring buffer, the window it serves.

  A linear cache holds ``max_length`` tokens; a ring buffer holds ``window``
  slots (default: the layer mask's causal window ``(w, 0)`` plus one) and
  needs ``w < window``, since it forgets older keys. Shared by the modules'
  ``init_cache``.

  Returns:
    ``(L, w)``: ``w`` the layer window's left side for a ring buffer, None
    for a linear cache.
  """
  layer_window = None if layer_mask is None else layer_mask.window
  left = None if layer_window is None else layer_window[0]
  if max_length is not None and window is not None:
    raise ValueError(
        f"init_cache takes max_length (a linear cache) or window (a ring "
        f"buffer), not both; got max_length={max_length}, window={window}.")
  if max_length is None and window is None:
    if left is None:
      raise ValueError(
          "init_cache needs max_length, the most tokens the cache will "
          "hold (a ring buffer, without one, needs a layer mask with a "
          "window: mask=aj.Mask(causal=True, window=(w, 0))).")
    window = left + 1
  if window is None:
    checks.check_positive_int("max_length", max_length)
    return max_length, None
  checks.check_positive_int("window", window)
  if left is None or not window > left:
    raise ValueError(
        f"a ring buffer of window={window} slots forgets keys older than "
        f"{window - 1} positions, so the module must attend within that: "
        f"its mask's window is {layer_window}. Build the module with "
        f"mask=aj.Mask(causal=True, window=({window - 1}, 0)) (or "
        "smaller), or use init_cache(batch_size, max_length) for a "
        "linear cache.")
  return window, left


def raise_if_overflowed(overflow, index, capacity: int, what: str,
                        hint: str = "") -> None:
  """The modules' ``check_cache``: a ValueError naming the examples that
  overflowed (``overflow [B]``, sticky) and the positions they reached."""
  if overflow is None:
    raise ValueError("no cache: call init_cache(batch_size, max_length) "
                     "first.")
  over = np.asarray(overflow)
  if over.any():
    rows = np.flatnonzero(over).tolist()
    reached = np.asarray(index)[rows].tolist()
    raise ValueError(
        f"{what} overflow in examples {rows}: they reached positions "
        f"{reached}, but max_length is {capacity}; the tokens past it were "
        "not cached and those examples' outputs are not meaningful. Call "
        f"init_cache with a larger max_length{hint}.")


def raise_if_pads_written(pad_written) -> None:
  """``check_cache``'s second half: a ValueError naming the examples whose
  right-padded prefill cached its pads (``pad_written [B]``, sticky)."""
  written = np.asarray(pad_written)
  if written.any():
    raise ValueError(
        f"examples {np.flatnonzero(written).tolist()} cached pad tokens: a "
        "prefill without the mask's q_lengths wrote every token, but its "
        "mask hid the last ones from their own queries (kv_lengths or a "
        "key-padding mask shorter than the call), as right padding does. "
        "Those pads now count as cached tokens and later steps attend to "
        "them. Pass the real lengths as mask=aj.Mask(q_lengths=lengths) in "
        "the prefill (only those tokens are cached, each example advances "
        "by its own length), then init_cache again.")
