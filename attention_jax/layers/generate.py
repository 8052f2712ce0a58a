"""Token generation with the KV caches of a model's attention layers.

Shape glossary: B batch, P padded prompt length, T tokens of one decoding
call, G new tokens (``max_new_tokens``), V vocabulary size, L linear cache
slots.

``generate`` is the loop every user of ``MultiHeadAttention``'s cache
writes: the right-padded prompts are prefilled in one ``decode_fn`` call
with their lengths (``aj.Mask(q_lengths=lengths)`` in each attention
layer: only the real tokens are cached, each example then continues from
where its own prompt ended), the first token is drawn from each example's
last prompt logits, then one ``decode_fn`` call per token, a
``jax.lax.scan`` over the steps carrying the model's non-parameter state
(its caches). Greedy (temperature 0) or sampled (temperature, top-k, a
key folded with the step); with ``eos_id`` a finished example emits
``pad_id`` from then on. Nothing is jitted here: wrap the call in
``nnx.jit`` with ``decode_fn`` and ``max_new_tokens`` static.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.layers import multi_head_module as mha_module

# decode_fn(model, tokens [B, T], lengths [B] or None) -> logits [B, T, V]
DecodeFn = Callable[[Any, jax.Array, jax.Array | None], jax.Array]


def _concrete_value(x):
  """``x`` as NumPy when it is concrete, else None (traced)."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return None


def check_tokens(prompts, prompt_lengths):
  """``(prompts [B, P], prompt_lengths [B])`` checked, as int32 (also
  speculative_generate's)."""
  if isinstance(prompts, (list, tuple)):
    prompts = np.asarray(prompts)
  if isinstance(prompt_lengths, (list, tuple)):
    prompt_lengths = np.asarray(prompt_lengths)
  shape = checks.shape_of(prompts)
  if (len(shape) != 2 or not jnp.issubdtype(jnp.result_type(prompts),
                                            jnp.integer)):
    raise ValueError(
        f"prompts must be integer token ids [B, P] (right-padded), got "
        f"dtype {jnp.result_type(prompts)} with shape {shape}.")
  b, p = shape
  if p < 1:
    raise ValueError(f"prompts must hold at least one token per example, "
                     f"got shape {shape}.")
  l_shape = checks.shape_of(prompt_lengths)
  if (l_shape != (b,) or not jnp.issubdtype(jnp.result_type(prompt_lengths),
                                            jnp.integer)):
    raise ValueError(
        f"prompt_lengths must be integer [B] = [{b}] (real tokens per "
        f"prompt), got dtype {jnp.result_type(prompt_lengths)} with shape "
        f"{l_shape}.")
  lengths = _concrete_value(prompt_lengths)
  if lengths is not None and (lengths.min() < 1 or lengths.max() > p):
    raise ValueError(
        f"prompt_lengths must lie in [1, P] = [1, {p}] (an empty prompt has "
        f"no logits to draw the first token from), got {lengths.tolist()}.")
  return jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lengths,
                                                      jnp.int32)


def _check_sampling(temperature, top_k, key, eos_id, pad_id) -> bool:
  """Validates the sampling options; True when tokens are drawn at random."""
  for name, x in (("temperature", temperature), ("top_k", top_k),
                  ("eos_id", eos_id), ("pad_id", pad_id)):
    if x is not None and checks.shape_of(x) != ():
      raise ValueError(f"{name} must be a scalar, got shape "
                       f"{checks.shape_of(x)}.")
  for name, x in (("top_k", top_k), ("eos_id", eos_id), ("pad_id", pad_id)):
    if x is not None and (isinstance(x, bool) or not jnp.issubdtype(
        jnp.result_type(x), jnp.integer)):
      raise TypeError(f"{name} must be an integer, got {x!r}.")
    value = None if x is None else _concrete_value(x)
    if value is not None and value < 0:
      raise ValueError(f"{name} must be non-negative, got {int(value)}.")
  t = _concrete_value(temperature)
  if t is not None and not t >= 0:  # NaN too
    raise ValueError(f"temperature must be >= 0 (0: greedy), got "
                     f"{float(t)}.")
  sampling = t is None or t > 0
  if sampling and key is None:
    raise ValueError(
        f"temperature={temperature!r} samples at random: pass key= (e.g. "
        "jax.random.key(0)), or temperature=0 for greedy decoding.")
  return bool(sampling)


def _check_caches(model, batch: int, prompt_length: int,
                  max_new_tokens: int) -> None:
  """Every KV cache of ``model``'s ``MultiHeadAttention`` layers fits.

  Layers without one are left alone (an encoder's, or a decoding layer,
  which then refuses ``decode=True`` itself). Shapes are static, so this
  holds under ``jit`` too; a cache that starts part-filled can still
  overflow, which ``check_cache()`` reports.
  """
  need = prompt_length + max_new_tokens - 1  # the last token is not fed
  for path, node in nnx.iter_graph(model):
    if (not isinstance(node, mha_module.MultiHeadAttention)
        or node.cache_index is None):
      continue
    where = "/".join(map(str, path)) or "the model"
    if node.cached_key.shape[0] != batch:
      raise ValueError(
          f"the KV cache of {where} holds {node.cached_key.shape[0]} "
          f"examples, but prompts has B = {batch}: call "
          f"init_cache(batch_size={batch}, ...) on it.")
    length = node.cached_key.shape[2]
    if node.cache_window is None and length < need:
      raise ValueError(
          f"the linear KV cache of {where} holds L = {length} tokens, but "
          f"prompts of P = {prompt_length} and max_new_tokens = "
          f"{max_new_tokens} need P + max_new_tokens - 1 = {need}: call "
          f"init_cache(batch_size={batch}, max_length={need}) on it.")


def _sample(logits, key, step, temperature, top_k, sampling: bool):
  """``logits [B, V]`` -> int32 ``[B]``: the argmax, or a draw at
  ``temperature`` among the ``top_k`` most likely (0: all) tokens."""
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)
  if not sampling:
    return greedy
  logits = logits.astype(jnp.float32)
  v = logits.shape[-1]
  k = jnp.clip(jnp.asarray(top_k, jnp.int32), 0, v)
  kth = -jnp.sort(-logits, -1)[:, jnp.maximum(k, 1) - 1]  # [B]
  logits = jnp.where((k > 0) & (logits < kth[:, None]), -jnp.inf, logits)
  temperature = jnp.asarray(temperature, jnp.float32)
  safe = jnp.where(temperature > 0, temperature, 1.0)  # 0 (traced): greedy
  drawn = jax.random.categorical(jax.random.fold_in(key, step),
                                 logits / safe).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def generate(
    decode_fn: DecodeFn,
    model: Any,
    prompts: ArrayLike,
    prompt_lengths: ArrayLike,
    max_new_tokens: int,
    *,
    temperature: float | ArrayLike = 0.0,
    top_k: int | ArrayLike | None = None,
    key: jax.Array | None = None,
    eos_id: int | ArrayLike | None = None,
    pad_id: int | ArrayLike = 0,
    return_logits: bool = False,
) -> tuple[jax.Array, ...]:
  """Generates ``max_new_tokens`` after each prompt with the model's KV caches.

  Args:
    decode_fn: ``decode_fn(model, tokens, lengths) -> logits``: feeds
      ``tokens`` int32 ``[B, T]`` through ``model`` with ``decode=True`` in
      every attention layer and returns ``[B, T, V]``. Called once with the
      prompts (``T = P``) and ``lengths = prompt_lengths``, which the
      attention layers take as ``mask=aj.Mask(q_lengths=lengths)``, then
      once per new token (``T = 1``) with ``lengths=None``. Static under
      ``jit``.
    model: an ``nnx.Module`` (or graph of them) whose attention layers hold
      fresh caches: ``init_cache(B, max_length)`` with ``max_length >= P +
      max_new_tokens - 1`` (a linear cache), or ``init_cache(B)`` for a
      sliding-window layer (a ring buffer). Its caches are advanced in
      place; call each layer's ``check_cache()`` afterwards, outside
      ``jit``.
    prompts: integer ``[B, P]``, right-padded (what follows an example's
      length is never cached nor seen).
    prompt_lengths: integer ``[B]`` in ``[1, P]``, each prompt's real
      tokens (checked when concrete; a traced length outside that range
      makes its example generate nothing, length 0).
    max_new_tokens: ``G >= 1``, static.
    temperature: 0 for greedy decoding (argmax), else the softmax
      temperature to sample at (may be traced).
    top_k: sample among the ``top_k`` most likely tokens (None or 0: all;
      1 is greedy up to exact ties). May be traced.
    key: a ``jax.random`` key; required when sampling. Step ``g`` draws
      with ``fold_in(key, g)``: the same key gives the same tokens.
    eos_id: an example that emits this token has finished: it emits
      ``pad_id`` from then on (it still steps through the model, as the
      batch does). None: every example generates ``G`` tokens.
    pad_id: the token finished examples emit (and are fed).
    return_logits: also return the logits each token was drawn from.

  Returns:
    ``(tokens, lengths)``: int32 ``[B, G]`` new tokens (``pad_id`` after an
    example's ``eos_id``), int32 ``[B]`` tokens generated per example (its
    ``eos_id`` included); with ``return_logits`` also ``logits [B, G, V]``
    (float32; meaningless past an example's length).

  Raises:
    TypeError, ValueError: bad prompts, lengths or options, sampling
      without a key, or a linear cache too small for ``P + max_new_tokens -
      1`` tokens or of another batch (a decoding layer without a cache
      refuses ``decode=True`` itself).

  Example:
    >>> class LM(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.embed = nnx.Embed(11, 8, rngs=rngs)
    ...     self.attn = aj.MultiHeadAttention(8, 2, rope=aj.Rope(base=100.0),
    ...                                    rngs=rngs)
    ...     self.out = nnx.Linear(8, 11, rngs=rngs)
    ...   def __call__(self, tokens, lengths=None):
    ...     x = self.embed(tokens)
    ...     mask = None if lengths is None else aj.Mask(q_lengths=lengths)
    ...     return self.out(x + self.attn(x, mask=mask, decode=True))
    >>> lm = LM(nnx.Rngs(0))
    >>> lm.attn.init_cache(batch_size=2, max_length=8)
    >>> prompts = jnp.array([[1, 2, 3], [4, 5, 0]])  # right-padded
    >>> tokens, lengths = generate(lambda m, t, n: m(t, n), lm, prompts,
    ...                            jnp.array([3, 2]), 4)
    >>> tokens.shape, lengths.tolist()
    ((2, 4), [4, 4])
    >>> lm.attn.cache_index[...].tolist()  # prompt + 3 fed tokens each
    [6, 5]
  """
  if isinstance(max_new_tokens, bool) or not isinstance(
      max_new_tokens, (int, np.integer)):
    raise TypeError(f"max_new_tokens must be a Python int (static under "
                    f"jit), got {max_new_tokens!r}.")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  checks.check_static_bool("return_logits", return_logits)
  prompts, lengths = check_tokens(prompts, prompt_lengths)
  sampling = _check_sampling(temperature, top_k, key, eos_id, pad_id)
  b, p = prompts.shape
  _check_caches(model, b, p, max_new_tokens)
  top_k = 0 if top_k is None else top_k
  pad = jnp.asarray(pad_id, jnp.int32)

  logits = decode_fn(model, prompts, lengths)
  if checks.shape_of(logits)[:2] != (b, p) or np.ndim(logits) != 3:
    raise ValueError(
        f"decode_fn returned logits of shape {checks.shape_of(logits)} for "
        f"prompts {prompts.shape}: expected [B, T, V] = [{b}, {p}, V].")
  rows = jnp.arange(b)
  last = logits[rows, jnp.clip(lengths - 1, 0, p - 1)].astype(
      jnp.float32)  # [B, V]: each example's last real prompt token
  finished = (lengths < 1) | (lengths > p)  # traced misfits generate nothing

  def emit(logits, step, finished):
    token = _sample(logits, key, step, temperature, top_k, sampling)
    token = jnp.where(finished, pad, token)
    count = (~finished).astype(jnp.int32)
    if eos_id is not None:
      finished = finished | (token == jnp.asarray(eos_id, jnp.int32))
    return token, finished, count

  first, finished, count = emit(last, 0, finished)
  # The scan carries what decoding changes (caches, dropout counts); the
  # parameters are closed over.
  graphdef, params, state = nnx.split(model, nnx.Param, ...)

  def step(carry, g):
    state, token, finished, count = carry
    m = nnx.merge(graphdef, params, state)
    out = decode_fn(m, token[:, None], None)  # [B, 1, V]
    if checks.shape_of(out) != (b, 1, last.shape[-1]):
      raise ValueError(
          f"decode_fn returned logits of shape {checks.shape_of(out)} for "
          f"one token per example: expected [B, 1, V] = [{b}, 1, "
          f"{last.shape[-1]}].")
    out = out[:, 0].astype(jnp.float32)
    token, finished, more = emit(out, g, finished)
    _, _, state = nnx.split(m, nnx.Param, ...)
    return (state, token, finished, count + more), (token, out)

  (state, _, _, count), (tokens, step_logits) = jax.lax.scan(
      step, (state, first, finished, count), jnp.arange(1, max_new_tokens))
  nnx.update(model, state)
  tokens = jnp.concatenate([first[:, None], jnp.swapaxes(tokens, 0, 1)], 1)
  if not return_logits:
    return tokens, count
  logits = jnp.concatenate([last[:, None], jnp.swapaxes(step_logits, 0, 1)],
                           1)  # [B, G, V]
  return tokens, count, logits
