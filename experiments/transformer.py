"""A small Transformer encoder-decoder built from ``aj.MultiHeadAttention``.

Shape glossary: B batch, S source length, T target length, D model dim,
N heads, V vocabulary size, L KV-cache capacity.

Every row of the lesson's table of attention types appears: self-attention in
the encoder, causal self-attention in the decoder (a KV cache when decoding
greedily), cross-attention from the decoder to the encoder. Pre-LayerNorm
residual blocks, sinusoidal positions (so evaluation lengths beyond the
training lengths still have positions).
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from experiments import data


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The architecture; vocabulary and mesh axis come with each model."""
  d_model: int = 64  # D
  num_heads: int = 4  # N
  num_layers: int = 2  # per stack
  ffn_dim: int = 128  # hidden units of each feed-forward block
  attention_scale: float | None = None  # None: 1/sqrt(d_k); 1.0: unscaled


def sinusoidal_positions(length: int, dim: int) -> jax.Array:
  """Vaswani et al.'s position encodings, ``[length, dim]``."""
  pos = np.arange(length)[:, None]
  rates = 1.0 / (10000.0 ** (np.arange(0, dim, 2) / dim))
  table = np.zeros((length, dim), np.float32)
  table[:, 0::2] = np.sin(pos * rates)
  table[:, 1::2] = np.cos(pos * rates)
  return jnp.asarray(table)


class FeedForward(nnx.Module):

  def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs,
               model_axis: str | None = None):
    up, down = {}, {}
    if model_axis:  # Megatron: hidden units split, one all-reduce after down
      init = nnx.initializers.lecun_normal()
      up = {"kernel_init": nnx.with_partitioning(init, (None, model_axis)),
            "bias_init": nnx.with_partitioning(nnx.initializers.zeros_init(),
                                               (model_axis,))}
      down = {"kernel_init": nnx.with_partitioning(init, (model_axis, None))}
    self.up = nnx.Linear(d_model, hidden, rngs=rngs, **up)
    self.down = nnx.Linear(hidden, d_model, rngs=rngs, **down)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


class EncoderLayer(nnx.Module):

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs,
               model_axis: str | None = None):
    d = config.d_model
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.self_attention = aj.MultiHeadAttention(
        d, config.num_heads, scale=config.attention_scale,
        head_axis=model_axis, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.ffn = FeedForward(d, config.ffn_dim, rngs=rngs,
                           model_axis=model_axis)

  def __call__(self, x, mask):
    x = x + self.self_attention(self.norm1(x), mask=mask)
    return x + self.ffn(self.norm2(x))


class DecoderLayer(nnx.Module):

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs,
               model_axis: str | None = None):
    d = config.d_model
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.self_attention = aj.MultiHeadAttention(
        d, config.num_heads, scale=config.attention_scale,
        head_axis=model_axis, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.cross_attention = aj.MultiHeadAttention(
        d, config.num_heads, scale=config.attention_scale,
        head_axis=model_axis, rngs=rngs)
    self.norm3 = nnx.LayerNorm(d, rngs=rngs)
    self.ffn = FeedForward(d, config.ffn_dim, rngs=rngs,
                           model_axis=model_axis)

  def __call__(self, x, memory, memory_mask, decode: bool):
    """Returns the new ``x`` and the cross-attention weights ``[B, N, T, S]``."""
    x = x + self.self_attention(self.norm1(x), is_causal=not decode,
                                decode=decode)
    # Decoding: the memory's keys and values were projected once
    # (init_cache -> init_cross_cache); decode=True attends to them.
    attended, weights = self.cross_attention(
        self.norm2(x), None if decode else memory, mask=memory_mask,
        return_weights=True, decode=decode)
    x = x + attended
    return x + self.ffn(self.norm3(x)), weights


class TransformerSeq2Seq(nnx.Module):
  """Encoder-decoder Transformer for the copy/reverse tasks.

  Args:
    config: the architecture.
    vocab_size: content tokens (PAD/BOS/EOS come on top).
    rngs: parameter initialisation.
    model_axis: mesh axis to split heads and FFN units over (tensor
      parallelism; build under ``jax.set_mesh``), or None.
  """

  def __init__(self, config: TransformerConfig, *, vocab_size: int,
               rngs: nnx.Rngs, model_axis: str | None = None):
    self.config = config
    vocab = vocab_size + data.NUM_SPECIAL
    self.src_embed = nnx.Embed(vocab, config.d_model, rngs=rngs)
    self.tgt_embed = nnx.Embed(vocab, config.d_model, rngs=rngs)
    self.encoder = nnx.List([
        EncoderLayer(config, rngs=rngs, model_axis=model_axis)
        for _ in range(config.num_layers)])
    self.decoder = nnx.List([
        DecoderLayer(config, rngs=rngs, model_axis=model_axis)
        for _ in range(config.num_layers)])
    self.final_norm = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.output = nnx.Linear(config.d_model, vocab, rngs=rngs)

  def _embed(self, embed, tokens, positions):
    """``tokens [B, T]`` and their position encodings ``[T, D]``."""
    d = self.config.d_model
    return embed(tokens) * jnp.sqrt(float(d)) + positions[None]

  def encode(self, src, src_len):
    """``src [B, S]`` -> ``(memory [B, S, D], key mask [B, 1, 1, S])``."""
    valid = aj.padding_mask(src_len, src.shape[1])  # [B, S]
    x = self._embed(self.src_embed, src,
                    sinusoidal_positions(src.shape[1], self.config.d_model))
    self_mask = aj.make_attention_mask(valid, valid)  # [B, 1, S, S]
    for layer in self.encoder:
      x = layer(x, self_mask)
    return x, valid[:, None, None, :]

  def _decode(self, tokens, memory, memory_mask, positions, decode):
    x = self._embed(self.tgt_embed, tokens, positions)
    weights = None
    for layer in self.decoder:
      x, weights = layer(x, memory, memory_mask, decode)
    return self.output(self.final_norm(x)), weights

  def __call__(self, src, src_len, tgt_in):
    """Teacher forcing: ``(logits [B, T, V], cross-attention [B, N, T, S])``.

    The weights are the last decoder layer's, one map per head.
    """
    memory, memory_mask = self.encode(src, src_len)
    positions = sinusoidal_positions(tgt_in.shape[1], self.config.d_model)
    return self._decode(tgt_in, memory, memory_mask, positions, decode=False)

  def init_cache(self, batch_size: int, max_length: int, memory) -> None:
    """KV caches for the decoder's self-attention; the encoder's ``memory
    [B, S, D]`` projected once for each cross-attention."""
    for layer in self.decoder:
      layer.self_attention.init_cache(batch_size, max_length)
      layer.cross_attention.init_cross_cache(memory)


def greedy(model: TransformerSeq2Seq, src, src_len, num_steps: int):
  """Greedy decoding with the decoder's caches, one token per step.

  The caches (self-attention keys/values, and the memory's projections for
  cross-attention, computed once) are created here; the step loop is a
  ``jax.lax.scan`` whose carry is the model's state (``nnx.split``/
  ``nnx.merge``), so this function can sit inside ``nnx.jit``.

  Returns:
    ``(tokens [B, num_steps], cross-attention [B, N, num_steps, S])``.
  """
  memory, memory_mask = model.encode(src, src_len)
  model.init_cache(src.shape[0], num_steps, memory)
  graphdef, state = nnx.split(model)
  bos = jnp.full((src.shape[0], 1), data.BOS, jnp.int32)
  table = sinusoidal_positions(num_steps, model.config.d_model)

  def step(carry, position):
    state, token = carry
    m = nnx.merge(graphdef, state)
    here = jax.lax.dynamic_slice_in_dim(table, position, 1)  # [1, D]
    logits, weights = m._decode(token, memory, memory_mask, here, True)
    token = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, 1]
    return (nnx.state(m), token), (token[:, 0], weights[:, :, 0])

  (state, _), (tokens, weights) = jax.lax.scan(
      step, (state, bos), jnp.arange(num_steps))
  nnx.update(model, state)
  return jnp.swapaxes(tokens, 0, 1), jnp.transpose(weights, (1, 2, 0, 3))
