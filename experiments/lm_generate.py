"""Batched generation with the KV cache, and the same by full recomputation.

Shape glossary: B batch (prompts), P longest prompt, G generated tokens,
V vocabulary size, C = P + G context (cache capacity L = C).

``generate``: prompts of different lengths are right-padded to ``P`` and
prefilled in one ``decode`` call with ``lengths`` (each example's cache
position then sits where its own prompt ends); the first token is sampled
from each example's last prompt logits, then one ``decode`` call per token
(a ``lax.scan``). Prefill and decode each run once untimed first (the
compile), so the reported tokens/s exclude compilation.

``recompute_greedy``: no cache; each step runs the full causal forward over
a ``[B, C]`` buffer (prompt, then the tokens so far; causal attention makes
the padding after an example's last token invisible to it) and takes the
argmax at each example's last position. Cached greedy decoding must give the
same tokens, and logits equal up to float32 rounding (``LOGIT_TOL``).
"""

from __future__ import annotations

import dataclasses
import functools
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from experiments import lm_data

# Cached decoding and full recomputation run different XLA:CPU kernels for
# [B, 1, D] and [B, C, D] operands (matmuls and row reductions such as
# LayerNorm's mean pick their vectorisation by shape, so the same row can
# round differently), whichever attention implementation runs: logits may
# differ by float32 rounding: up to ~1e-5 on logits of magnitude ~10 for
# the experiment's two layers. A wrong context moves them much further: on
# the trained model, one padding token wrongly cached changes the first
# generated logits by 3.5-6.2, one prompt character changed or dropped by
# 0.018-0.75. The greedy tokens must be identical.
LOGIT_TOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Generation:
  """What ``generate`` produced.

  Attributes:
    tokens: int32 ``[B, G]``.
    logits: float32 ``[B, G, V]``: the logits each token was drawn from.
    prefill_seconds / decode_seconds: wall time of the compiled prefill call
      and of the decode loop.
    prefill_tokens: real prompt tokens (padding not counted).
    decode_tokens: tokens fed through ``decode`` one at a time,
      ``B * (G - 1)``.
  """
  tokens: np.ndarray
  logits: np.ndarray
  prefill_seconds: float
  decode_seconds: float
  prefill_tokens: int
  decode_tokens: int


def pad_prompts(prompts) -> tuple[np.ndarray, np.ndarray]:
  """Id sequences -> ``(tokens [B, P] right-padded with PAD, lengths [B])``.

  Raises:
    ValueError: no prompts, or an empty one.
  """
  if not len(prompts) or min(len(p) for p in prompts) < 1:
    raise ValueError("need at least one prompt, each of one token or more.")
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.full((len(prompts), lengths.max()), lm_data.PAD, np.int32)
  for row, prompt in zip(tokens, prompts):
    row[:len(prompt)] = prompt
  return tokens, lengths


def sample(logits, key, temperature, top_k):
  """``logits [B, V]`` -> int32 ``[B]``: the argmax when ``temperature`` is
  0, else a draw at that temperature from the ``top_k`` most likely tokens
  (all of them for 0 or >= V).

  ``temperature`` and ``top_k`` may be traced, so greedy and sampled
  generation share one compiled program.
  """
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)
  k = jnp.clip(top_k, 0, logits.shape[-1])
  kth = -jnp.sort(-logits, -1)[:, jnp.maximum(k, 1) - 1]  # [B]
  logits = jnp.where((k > 0) & (logits < kth[:, None]), -jnp.inf, logits)
  safe = jnp.where(temperature > 0, temperature, 1.0)
  drawn = jax.random.categorical(key, logits / safe).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, tokens, lengths):
  model = nnx.merge(graphdef, state)
  logits = model.decode(tokens, lengths)  # [B, P, V]
  last = logits[jnp.arange(tokens.shape[0]), lengths - 1]  # [B, V]
  return nnx.state(model), last


@functools.partial(jax.jit, static_argnums=(0, 4))
def _decode_loop(graphdef, state, last, key, num_tokens: int, temperature,
                 top_k):
  first = sample(last, jax.random.fold_in(key, 0), temperature, top_k)

  def step(carry, i):
    state, token = carry
    model = nnx.merge(graphdef, state)
    logits = model.decode(token[:, None])[:, 0]  # [B, V]
    token = sample(logits, jax.random.fold_in(key, i), temperature, top_k)
    return (nnx.state(model), token), (token, logits)

  (state, _), (tokens, logits) = jax.lax.scan(
      step, (state, first), jnp.arange(1, num_tokens))
  tokens = jnp.concatenate([first[None], tokens])  # [G, B]
  logits = jnp.concatenate([last[None], logits])  # [G, B, V]
  return state, jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(logits, 0, 1)


def _timed(fn, *args):
  """Runs ``fn`` twice: the first call compiles (or finds the compiled
  program), the second is timed. Returns its output and seconds."""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def generate(model: nnx.Module, prompts, num_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0,
             seed: int = 0) -> Generation:
  """Samples ``num_tokens`` after each prompt with the model's KV caches.

  Args:
    model: a ``lm_model.DecoderLM``; its caches are (re)created here and
      checked for overflow afterwards.
    prompts: id sequences (BOS first), of different lengths.
    num_tokens: ``G`` >= 1.
    temperature: 0 for greedy decoding.
    top_k: sample among the ``top_k`` most likely tokens (0: all).
    seed: the sampling key.
  """
  if num_tokens < 1:
    raise ValueError(f"num_tokens must be positive, got {num_tokens}.")
  tokens, lengths = pad_prompts(prompts)
  model.init_cache(tokens.shape[0], tokens.shape[1] + num_tokens)
  graphdef, state = nnx.split(model)
  tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
  (state, last), prefill_s = _timed(_prefill, graphdef, state, tokens,
                                    lengths)
  key = jax.random.key(seed)
  (state, out, logits), decode_s = _timed(
      _decode_loop, graphdef, state, last, key, num_tokens,
      jnp.float32(temperature), jnp.int32(top_k))
  nnx.update(model, state)
  model.check_cache()
  return Generation(np.asarray(out), np.asarray(logits), prefill_s, decode_s,
                    int(np.sum(lengths)), out.shape[0] * (num_tokens - 1))


@nnx.jit(static_argnums=3)
def _recompute(model, tokens, lengths, num_tokens):
  batch = jnp.arange(tokens.shape[0])
  buffer = jnp.pad(tokens, ((0, 0), (0, num_tokens)),
                   constant_values=lm_data.PAD)  # [B, C]

  def step(buffer, i):
    at = lengths - 1 + i  # [B]: each example's last position so far
    row = model(buffer)[batch, at]  # [B, V]
    token = jnp.argmax(row, -1).astype(jnp.int32)
    return buffer.at[batch, at + 1].set(token), (token, row)

  _, (out, logits) = jax.lax.scan(step, buffer, jnp.arange(num_tokens))
  return jnp.swapaxes(out, 0, 1), jnp.swapaxes(logits, 0, 1)


def recompute_greedy(model: nnx.Module, prompts,
                     num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
  """Greedy decoding without a cache: ``(tokens [B, G], logits [B, G, V])``."""
  tokens, lengths = pad_prompts(prompts)
  out, logits = _recompute(model, jnp.asarray(tokens), jnp.asarray(lengths),
                           num_tokens)
  return np.asarray(out), np.asarray(logits)


def check_cached_greedy(model: nnx.Module, prompts,
                        num_tokens: int) -> tuple[Generation, dict]:
  """Cached greedy generation against full recomputation.

  The tokens must be identical. Were two logits of a step within float32
  rounding of each other, the two paths could pick different tokens
  without either being wrong; such a near tie (the recomputed logits of
  both picks within ``LOGIT_TOL``) is reported in ``ties`` and the
  example's later steps, which then continue from different tokens, are
  not compared.

  Returns:
    The cached ``Generation`` and ``{"passed", "tokens_equal",
    "logits_bitwise_equal", "max_abs_logit_diff", "logit_tol", "ties",
    "steps", "prompts"}``; passed: every step's tokens equal (or a near
    tie) and logits within ``LOGIT_TOL``.
  """
  cached = generate(model, prompts, num_tokens)
  tokens, logits = recompute_greedy(model, prompts, num_tokens)
  same = cached.tokens == tokens  # [B, G]
  first = np.where(same.all(1), num_tokens, np.argmin(same, 1))  # [B]
  compared = np.arange(num_tokens)[None] <= first[:, None]  # [B, G]
  diff = float(np.max(np.abs(cached.logits - logits)[compared]))
  ties = [float(logits[b, s, tokens[b, s]] - logits[b, s, cached.tokens[b, s]])
          for b, s in enumerate(first.tolist()) if s < num_tokens]
  check = {"tokens_equal": bool(same.all()),
           "logits_bitwise_equal": bool(np.array_equal(cached.logits,
                                                       logits)),
           "max_abs_logit_diff": diff, "logit_tol": LOGIT_TOL, "ties": ties,
           "steps": num_tokens, "prompts": len(prompts)}
  check["passed"] = diff <= LOGIT_TOL and all(t <= LOGIT_TOL for t in ties)
  return cached, check
