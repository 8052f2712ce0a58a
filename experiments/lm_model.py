"""A small decoder-only Transformer (GPT-style) from ``aj.MultiHeadAttention``.

Shape glossary: B batch, T length, D model dim, N heads, V vocabulary size,
L cache capacity.

Pre-LayerNorm residual blocks of causal self-attention (rotary positions,
optional qk-norm, an optional sliding window) and a GELU feed-forward block;
no position embedding (RoPE puts positions into the scores). A row of packed
documents comes with segment ids: with them no token sees another document
and rotary positions restart at each document; ids that are all equal make
the row one sequence (what a model unaware of the packing does).

The same module generates with the KV cache of each attention layer
(``init_cache``, then ``decode``); a window layer gets a ring buffer. Or
with a paged cache (``init_paged_cache``): one pool of pages per layer shared
by the rows, ``decode`` with per-row ``lengths`` appending each row's new
tokens (0: the row is idle this call), ``release`` freeing finished rows'
pages for new requests (continuous batching, ``experiments/serve.py``).
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

import attention_jax as aj
from experiments import config_flags
from experiments import transformer


@dataclasses.dataclass(frozen=True)
class LMModelConfig:
  """The architecture; each field is also a ``run.py`` flag."""
  d_model: int = config_flags.field(  # D
      128, "lm: model width D.", name="lm_d_model", lower_bound=1)
  num_heads: int = config_flags.field(  # N
      4, "lm: attention heads per layer (divides --lm_d_model).",
      name="lm_heads", lower_bound=1, divides="d_model")
  num_layers: int = config_flags.field(
      2, "lm: Transformer blocks.", name="lm_layers", lower_bound=1)
  ffn_dim: int = config_flags.field(
      512, "lm: hidden units of each feed-forward block.",
      name="lm_ffn_dim", lower_bound=1)
  normalize_qk: bool = config_flags.field(
      False, "lm: RMS-normalise queries and keys per head (qk-norm).",
      name="qk_norm")
  rope_base: float = config_flags.field(
      10000.0, "lm: rotary position base.", lower_bound=1.0)


class Block(nnx.Module):
  """``x + attention(norm(x))``, then ``x + ffn(norm(x))``."""

  def __init__(self, config: LMModelConfig, *, window: int | None,
               implementation: str | None, rngs: nnx.Rngs,
               model_axis: str | None = None):
    d = config.d_model
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.attention = aj.MultiHeadAttention(
        d, config.num_heads, rngs=rngs, normalize_qk=config.normalize_qk,
        rope=aj.Rope(base=config.rope_base), attention_fn=implementation,
        # A causal window: each token sees itself and `window` before it.
        mask=None if window is None else aj.Mask(causal=True,
                                                 window=(window, 0)),
        head_axis=model_axis)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.ffn = transformer.FeedForward(d, config.ffn_dim, rngs=rngs,
                                       model_axis=model_axis)

  def __call__(self, x, *, segment_ids=None, positions=None, decode=False,
               lengths=None, rows=None, rule=None, return_weights=False):
    """``x [B, T, D]`` -> ``(x, aux)``: ``aux`` is the attention output
    ``[B, T, D]`` when decoding, else the weights ``[B, N, T, S]`` with
    ``return_weights`` or None. ``positions [B, T]``: the rotary positions
    (None: restarting at each document of ``segment_ids``; decoding: the
    cache slots). ``rule``: a decoding step's mask rule at the cache's
    positions (a drafted tree's ``aj.tree_rule``)."""
    h = self.norm1(x)
    if decode:
      mask = None
      if lengths is not None or rule is not None:
        mask = aj.Mask(q_lengths=lengths, rule=rule)
      out = self.attention(h, decode=True, cache_rows=rows, mask=mask,
                           positions=positions)
      weights = out
    else:
      # kv_segment_ids default to the queries' (packed self-attention).
      mask = (None if segment_ids is None
              else aj.Mask(q_segment_ids=segment_ids))
      out = self.attention(h, mask=mask, is_causal=True, positions=positions,
                           return_weights=return_weights)
      out, weights = out if return_weights else (out, None)
    x = x + out
    return x + self.ffn(self.norm2(x)), weights


class DecoderLM(nnx.Module):
  """Next-token logits of a character sequence.

  Args:
    config: the architecture.
    vocab_size: ``V``.
    window: a causal sliding window of this many previous tokens in every
      layer, or None.
    rngs: parameter initialisation.
    implementation: ``aj.MultiHeadAttention``'s ``attention_fn`` (an
      implementation such as ``"flash"``, an ``aj.SequenceParallel``;
      None: automatic).
    model_axis: mesh axis to split heads and FFN units over, or None.
  """

  def __init__(self, config: LMModelConfig, *, vocab_size: int,
               window: int | None = None, rngs: nnx.Rngs,
               implementation: str | None = None,
               model_axis: str | None = None):
    self.config, self.window = config, window
    self.embed = nnx.Embed(vocab_size, config.d_model, rngs=rngs)
    self.blocks = nnx.List([
        Block(config, window=window, implementation=implementation,
              rngs=rngs, model_axis=model_axis)
        for _ in range(config.num_layers)])
    self.final_norm = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.output = nnx.Linear(config.d_model, vocab_size, rngs=rngs)

  def set_attention(self, attention_fn) -> None:
    """Every layer's ``attention_fn`` replaced (e.g. a sequence-parallel
    model's, for analyses that need weights or a KV cache)."""
    for block in self.blocks:
      block.attention.attention_fn = attention_fn

  def _logits(self, x):
    return self.output(self.final_norm(x))  # [B, T, V]

  def __call__(self, tokens, segment_ids=None, positions=None, *,
               return_weights=False):
    """The full causal forward.

    Args:
      tokens: int ``[B, T]``.
      segment_ids: int ``[B, T]`` documents of a packed row (None: one
        sequence per row).
      positions: int ``[B, T]`` rotary positions (None: each document's
        from 0). A sequence-parallel model in the zigzag layout gets its
        tokens, ids and positions permuted alike (``aj.zigzag``).
      return_weights: also return each layer's attention weights.

    Returns:
      ``logits [B, T, V]``, and with ``return_weights`` a list of
      ``[B, N, T, T]`` per layer.
    """
    x = self.embed(tokens)  # [B, T, D]
    weights = []
    for block in self.blocks:
      x, w = block(x, segment_ids=segment_ids, positions=positions,
                   return_weights=return_weights)
      weights.append(w)
    logits = self._logits(x)
    return (logits, weights) if return_weights else logits

  def init_cache(self, batch_size: int, max_length: int) -> None:
    """Empty KV caches: linear of ``max_length``, or with a window a ring
    buffer of ``window + 1`` slots (memory independent of the length)."""
    for block in self.blocks:
      if self.window is None:
        block.attention.init_cache(batch_size, max_length)
      else:
        block.attention.init_cache(batch_size)

  def init_paged_cache(self, batch_size: int, num_pages: int, page_size: int,
                       max_pages: int, dtype=None) -> None:
    """Empty paged KV caches, one pool per layer (``aj.MultiHeadAttention.
    init_paged_cache``): ``num_pages`` pages of ``page_size`` tokens shared
    by ``batch_size`` rows, each holding at most ``max_pages`` pages, stored
    as ``dtype`` (None: the layer's; ``"int8"`` or ``"float8_e4m3fn"``:
    quantised with a scale per token and head).

    ``decode(tokens, lengths)`` then appends ``lengths[b]`` tokens to row
    ``b`` (0: idle this call); ``release(done)`` empties finished rows.
    """
    for block in self.blocks:
      block.attention.init_paged_cache(batch_size, num_pages=num_pages,
                                       page_size=page_size,
                                       max_pages=max_pages, dtype=dtype)

  def release(self, done) -> None:
    """Frees the pages of the rows where ``done`` (bool ``[B]``), in every
    layer; those rows are empty again (length 0), ready for new requests."""
    for block in self.blocks:
      block.attention.update_paged_cache(aj.paged_cache.release, done)

  def move_slots(self, start, source, count) -> None:
    """Keeps ``count[b]`` slots of row ``b`` from ``source [B, A]``, moved to
    ``start[b]`` on, in every layer (``aj.move_slots``: a verified tree's
    accepted path; pages past the new length return to the pool)."""
    for block in self.blocks:
      block.attention.update_paged_cache(aj.move_slots, start, source, count)

  def pages_in_use(self) -> jax.Array:
    """int32 scalar: pages of the pool held by some row (every layer holds
    the same pages of its own pool; the first layer's are counted)."""
    refcount = self.blocks[0].attention.cache_refcount
    if refcount is None:
      raise ValueError("pages_in_use needs a paged cache: call "
                       "init_paged_cache(...) first.")
    return jnp.sum(refcount[...] > 0, dtype=jnp.int32)

  def check_cache(self) -> None:
    """Raises if a decoding call overflowed a linear or paged cache."""
    for block in self.blocks:
      block.attention.check_cache()

  def decode(self, tokens, lengths=None, *, rows=None, positions=None,
             parents=None, return_attention=False):
    """Appends ``tokens [B, T]`` to the caches; logits ``[B, T, V]``, and
    with ``return_attention`` each layer's attention output ``[B, T, D]``.

    ``rows [B']`` (a paged cache): ``tokens [B', T]`` are for these rows of
    the cache only; the others are not computed (``cache_rows``).

    ``lengths [B]``: real tokens per example of a right-padded prefill
    (each example then continues from its own position); with a paged
    cache, the tokens each row appends this call (0: idle), so one call can
    prefill new rows while the others decode one token each.

    ``positions [B, T]``: rotary positions of the new tokens (None: their
    cache slots); a compacted cache (``aj.move_slots`` after eviction)
    decodes on at the positions the tokens would have had.

    ``parents [B, T]`` (a paged cache, every row): each row's new tokens
    are a drafted tree (``experiments/speculative.py``): token ``i`` sees
    the row's cache and its ancestors in the tree (``aj.tree_rule``) at
    position ``prefix + depth`` (``aj.tree_positions``, offset by
    ``positions[:, :1]`` minus the prefix when positions are given).
    """
    rule = None
    if parents is not None:
      if rows is not None:
        raise ValueError("parents (a drafted tree) needs every row of the "
                         "cache: pass rows=None.")
      prefix = self.blocks[0].attention.cache_index[...]  # [B] before
      rule = aj.tree_rule(parents, prefix)
      tree_positions = aj.tree_positions(parents, prefix)
      positions = (tree_positions if positions is None else
                   tree_positions - prefix[:, None] + positions[:, :1])
    x = self.embed(tokens)
    outs = []
    for block in self.blocks:
      x, out = block(x, decode=True, lengths=lengths, rows=rows,
                     positions=positions, rule=rule)
      outs.append(out)
    logits = self._logits(x)
    return (logits, outs) if return_attention else logits
