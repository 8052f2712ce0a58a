"""GRU encoder-decoders: no attention (the bottleneck), Bahdanau, Luong.

Shape glossary: B batch, S source length, T target length, E embedding size,
He encoder output size (GRU size, doubled when bidirectional), Hd decoder GRU
size, V vocabulary size.

All three models share the encoder and the decoder loop; they differ only in
what the decoder sees of the encoder at each step:

* ``none``: the final encoder state only, fed to every step (Cho et al. 2014);
  everything the decoder knows about the input is in that one vector.
* ``bahdanau``: ``aj.BahdanauAttention`` from the *previous* decoder state;
  the context goes into the GRU and the output layer (Bahdanau et al. 2015).
* ``luong``: the GRU runs first, ``aj.LuongAttention`` from the *current*
  state, ``h~ = tanh(W_c [context; state])`` predicts and is fed to the next
  step ("input feeding", Luong et al. 2015).

The time loops are ``jax.lax.scan`` over a step function; modules are only
read inside them.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

import attention_jax as aj
from attention_jax.layers import luong as aj_luong
from experiments import config_flags
from experiments import data

ATTENTIONS = ("none", "bahdanau", "luong")
ENCODERS = ("forward", "bidirectional")


@dataclasses.dataclass(frozen=True)
class RNNConfig:
  """The GRU architecture; the attention and vocabulary come per model."""
  encoder: str = config_flags.field("forward", "GRU encoder direction.",
                                    choices=ENCODERS)
  luong_score: str = config_flags.field(
      "general", "Score of the luong model.", choices=aj_luong.SCORES)
  embed_dim: int = 32  # E
  encoder_dim: int = 64  # GRU size per direction
  decoder_dim: int = 128  # Hd


def _run_gru(cell: nnx.GRUCell, inputs, mask, initial):
  """Runs ``cell`` over time, holding the state still at padded steps.

  Args:
    cell: the GRU cell.
    inputs: ``[B, S, E]``.
    mask: bool ``[B, S]``, True at real tokens.
    initial: ``[B, H]``.

  Returns:
    ``(states [B, S, H] (zero at padding), final [B, H])``.
  """
  def step(h, xs):
    x, m = xs
    new, _ = cell(h, x)
    h = jnp.where(m[:, None], new, h)
    return h, jnp.where(m[:, None], new, 0.0)

  final, states = jax.lax.scan(
      step, initial, (jnp.swapaxes(inputs, 0, 1), jnp.swapaxes(mask, 0, 1)))
  return jnp.swapaxes(states, 0, 1), final


def _reverse_within_length(x, lengths):
  """Reverses each row's first ``lengths[b]`` entries, leaves padding in place."""
  s = x.shape[1]
  t = jnp.arange(s)[None, :]
  idx = jnp.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)  # [B, S]
  idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


class Encoder(nnx.Module):
  """Embedding + GRU (forward, or forward and backward)."""

  def __init__(self, config: RNNConfig, *, vocab_size: int, rngs: nnx.Rngs):
    vocab = vocab_size + data.NUM_SPECIAL
    self.embed = nnx.Embed(vocab, config.embed_dim, rngs=rngs)
    self.forward = nnx.GRUCell(config.embed_dim, config.encoder_dim,
                               rngs=rngs)
    self.backward = nnx.data(
        nnx.GRUCell(config.embed_dim, config.encoder_dim, rngs=rngs)
        if config.encoder == "bidirectional" else None)
    self.hidden = config.encoder_dim

  def __call__(self, src, src_len):
    """``src [B, S]`` -> ``(states [B, S, He], final [B, He], mask [B, S])``."""
    b, s = src.shape
    mask = jnp.arange(s)[None, :] < src_len[:, None]  # [B, S]
    x = self.embed(src)  # [B, S, E]
    h0 = jnp.zeros((b, self.hidden), x.dtype)
    states, final = _run_gru(self.forward, x, mask, h0)
    if self.backward is not None:
      rev_states, rev_final = _run_gru(
          self.backward, _reverse_within_length(x, src_len), mask, h0)
      states = jnp.concatenate(
          [states, _reverse_within_length(rev_states, src_len)], -1)
      final = jnp.concatenate([final, rev_final], -1)
    return states, final, mask


class RNNSeq2Seq(nnx.Module):
  """GRU encoder-decoder with no, Bahdanau or Luong attention.

  Args:
    config: the architecture.
    attention: one of ``ATTENTIONS``.
    vocab_size: content tokens (PAD/BOS/EOS come on top).
    rngs: parameter initialisation.
  """

  def __init__(self, config: RNNConfig, *, attention: str, vocab_size: int,
               rngs: nnx.Rngs):
    if attention not in ATTENTIONS:
      raise ValueError(f"attention must be one of {ATTENTIONS}, got "
                       f"{attention!r}.")
    if config.encoder not in ENCODERS:
      raise ValueError(f"encoder must be one of {ENCODERS}, got "
                       f"{config.encoder!r}.")
    self.config = config
    self.kind = attention
    vocab = vocab_size + data.NUM_SPECIAL
    enc = config.encoder_dim * (2 if config.encoder == "bidirectional" else 1)
    dec, emb = config.decoder_dim, config.embed_dim
    self.encoder = Encoder(config, vocab_size=vocab_size, rngs=rngs)
    self.embed = nnx.Embed(vocab, emb, rngs=rngs)
    self.init_state = nnx.Linear(enc, dec, rngs=rngs)
    memory = combine = module = None
    if attention == "none":
      cell = nnx.GRUCell(emb + enc, dec, rngs=rngs)
      output = nnx.Linear(dec + enc, vocab, rngs=rngs)
    elif attention == "bahdanau":
      cell = nnx.GRUCell(emb + enc, dec, rngs=rngs)
      module = aj.BahdanauAttention(dec, enc, dec, rngs=rngs)
      output = nnx.Linear(dec + enc, vocab, rngs=rngs)
    else:
      keys = enc
      if config.luong_score == "dot" and enc != dec:
        # dot needs keys of the decoder's size: a learned memory projection.
        memory = nnx.Linear(enc, dec, use_bias=False, rngs=rngs)
        keys = dec
      cell = nnx.GRUCell(emb + dec, dec, rngs=rngs)
      module = aj.LuongAttention(dec, keys, score=config.luong_score,
                                 hidden_features=dec, rngs=rngs)
      combine = nnx.Linear(enc + dec, dec, rngs=rngs)
      output = nnx.Linear(dec, vocab, rngs=rngs)
    self.cell, self.output = cell, output
    self.attention = nnx.data(module)
    self.memory = nnx.data(memory)
    self.combine = nnx.data(combine)

  def _prepare(self, src, src_len):
    """Encodes once per sequence; returns the step function and its carry."""
    states, final, mask = self.encoder(src, src_len)
    b = src.shape[0]
    h0 = jnp.tanh(self.init_state(final))  # [B, Hd]
    kind = self.kind
    keys = self.memory(states) if self.memory is not None else states
    projected = None
    if kind != "none":
      projected = self.attention.precompute_keys(keys)  # once per sequence
    feed0 = jnp.zeros((b, self.config.decoder_dim), h0.dtype)

    def step(carry, token):
      h, feed = carry
      e = self.embed(token)  # [B, E]
      if kind == "none":
        weights = jnp.zeros(mask.shape, jnp.float32)
        h, _ = self.cell(h, jnp.concatenate([e, final], -1))
        logits = self.output(jnp.concatenate([h, final], -1))
      elif kind == "bahdanau":
        context, weights = self.attention(h, keys, states, mask,
                                          projected_keys=projected,
                                          return_weights=True)
        h, _ = self.cell(h, jnp.concatenate([e, context], -1))
        logits = self.output(jnp.concatenate([h, context], -1))
      else:
        h, _ = self.cell(h, jnp.concatenate([e, feed], -1))
        context, weights = self.attention(h, keys, states, mask,
                                          projected_keys=projected,
                                          return_weights=True)
        feed = jnp.tanh(self.combine(jnp.concatenate([context, h], -1)))
        logits = self.output(feed)
      return (h, feed), (logits, weights)

    return step, (h0, feed0)

  def __call__(self, src, src_len, tgt_in):
    """Teacher forcing: ``(logits [B, T, V], attention [B, T, S])``."""
    step, carry = self._prepare(src, src_len)
    _, (logits, weights) = jax.lax.scan(step, carry, jnp.swapaxes(tgt_in, 0, 1))
    return jnp.swapaxes(logits, 0, 1), jnp.swapaxes(weights, 0, 1)

  def greedy(self, src, src_len, num_steps: int):
    """Greedy decoding: ``(tokens [B, num_steps], attention [B, num_steps, S])``."""
    step, carry = self._prepare(src, src_len)
    bos = jnp.full((src.shape[0],), data.BOS, jnp.int32)

    def greedy_step(state, _):
      carry, token = state
      carry, (logits, weights) = step(carry, token)
      token = jnp.argmax(logits, -1).astype(jnp.int32)
      return (carry, token), (token, weights)

    _, (tokens, weights) = jax.lax.scan(greedy_step, (carry, bos), None,
                                        length=num_steps)
    return jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(weights, 0, 1)
