"""Score modifiers: one contract, and the built-ins (ALiBi, T5, soft cap).

Shape glossary: B batch, N query heads; T query length, S key/value length.

A score modifier is called as ``score_mod(score, b, h, q_idx, kv_idx)``:
float32 scores after scale and bias (``[T, S]`` in the dense kernel, one
visited ``[bq, bk]`` block in the blockwise ones), the int32 batch and
query-head indices of this head (scalars), and broadcast integer query and
key indices (``[T, 1]``/``[1, S]``, or the block's). It returns the
modified scores, float and of the score's shape; ``-inf`` blocks an entry.
It must be elementwise: entry ``(i, j)`` reads ``score[i, j]``, ``b``,
``h``, ``q_idx[i]``, ``kv_idx[j]`` and arrays indexed by them, never other
scores (the kernels hold different scores at once); every call checks
this (``checks.check_score_mod``). Every implementation applies it
alike and differentiates the arrays it uses.

Arrays travel with the function as one value: ``ScoreMod(fn, params)`` is a
pytree (``fn`` static, ``params`` leaves), so it passes through ``jax.jit``
and into modules, and ``chain`` composes several. A plain function closing
over arrays works too in the dense and blockwise kernels (the flash kernel
hoists what it closes over out of its custom VJP); ring attention needs a
``ScoreMod``. Built-ins: ``alibi(slopes)`` (ALiBi; ``alibi_slopes(N,
max_bias)`` the paper's, BLOOM's and MPT's slopes),
``t5_relative_bias(table)`` (T5's bucketed relative positions) and
``soft_cap(cap)`` (Gemma 2's logit soft-capping).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"],
                   meta_fields=["fn", "blocks"])
@dataclasses.dataclass(frozen=True, eq=False)
class ScoreMod:
  """A score modifier and the arrays it uses, as one pytree.

  Attributes:
    fn: ``fn(score, b, h, q_idx, kv_idx, params) -> score``; static (part
      of the pytree's structure, so keep one function object per rule).
    params: any pytree of arrays ``fn`` reads (e.g. a ``[buckets, N]``
      table, per-head slopes ``[N]``); differentiated like ``bias``.
    blocks: whether ``fn`` may write ``-inf`` (block an entry): the
      kernels then check its output. False (the built-ins) saves that pass;
      a modifier that says False and writes ``-inf`` anyway gets wrong
      numbers.

  Example:
    >>> table = jnp.zeros((3,))  # [N] one learned offset per head
    >>> mod = ScoreMod(lambda s, b, h, q, k, t: s + t[h], table)
    >>> q = k = v = jnp.ones((1, 3, 4, 8))  # [B, N, T, H]
    >>> import attention_jax as aj
    >>> aj.scaled_dot_product_attention(q, k, v, score_mod=mod).shape
    (1, 3, 4, 8)
  """
  fn: Callable[..., jax.Array]
  params: Any = None
  blocks: bool = True

  def __call__(self, score, b, h, q_idx, kv_idx):
    return self.fn(score, b, h, q_idx, kv_idx, self.params)


def _chained(score, b, h, q_idx, kv_idx, mods):
  blocked = None  # what a blocking modifier wrote -inf into stays blocked
  for mod in mods:
    score = mod(score, b, h, q_idx, kv_idx)
    if mod.blocks:
      hit = score == -jnp.inf
      blocked = hit if blocked is None else blocked | hit
  return score if blocked is None else jnp.where(blocked, -jnp.inf, score)


def chain(*mods: Callable[..., jax.Array]) -> ScoreMod:
  """Score modifiers applied in order, as one (e.g. ALiBi, then a cap).

  Example:
    >>> mod = chain(alibi(alibi_slopes(2)), lambda s, b, h, q, k: 2.0 * s)
    >>> # (1 - slope 0.0625 * distance 2) * 2, for head 0
    >>> float(mod(jnp.ones(()), 0, 0, jnp.int32(3), jnp.int32(1)))
    1.75
  """
  for n, mod in enumerate(mods):
    if not callable(mod):
      raise TypeError(f"chain's argument {n} must be a score modifier "
                      f"(callable), got {type(mod).__name__}.")
  # Plain functions become ScoreMods, so that the params are arrays only.
  mods = tuple(
      m if isinstance(m, ScoreMod) else ScoreMod(functools.partial(plain_fn, m))
      for m in mods)
  return ScoreMod(_chained, mods, blocks=any(m.blocks for m in mods))


def plain_fn(mod, score, b, h, q_idx, kv_idx, params):
  """A plain ``mod(score, b, h, q_idx, kv_idx)`` as a ``ScoreMod.fn``."""
  del params  # a plain function carries no parameters of its own
  return mod(score, b, h, q_idx, kv_idx)


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> jax.Array:
  """ALiBi's per-head slopes (Press et al. 2022), float32 ``[N]``.

  With ``c`` the largest power of two ``<= N`` and ``m = max_bias``: the
  geometric sequence ``2**(-m k / c)``, ``k = 1 .. c``, then (``N`` not a
  power of two) the odd powers ``2**(-m j / (2 c))``, ``j = 1, 3, 5,
  ...``, for the other ``N - c`` heads: the paper's interleaving of the two
  nearest powers, BLOOM's and Falcon's order. Each slope is computed in
  float64 and rounded once to float32 (BLOOM's own float32 arithmetic
  differs by a few ulps from 11 heads on; the checkpoint loader reproduces
  that where it matters).

  MPT's ``build_mpt_alibi_tensor`` (``alibi_bias_max``) gives the same
  slopes in the same order: of the ``2 c`` slopes ``2**(-m i / (2 c))`` of
  the next power of two, ``slopes[1::2]`` (even ``i = 2 k``) are the ``c``
  slopes above and ``slopes[::2]`` (odd ``i``) the extra ones, so MPT is
  ``alibi_slopes(N, max_bias=alibi_bias_max)`` (HF's ``MptModel`` passes
  no ``alibi_bias_max``: it always uses 8).

  Args:
    num_heads: ``N``, the number of query heads, a positive int.
    max_bias: ``m``, the bias the steepest geometric sequence reaches
      (the last power-of-two slope is ``2**-m``): 8 in the paper, BLOOM and
      Falcon; MPT's ``alibi_bias_max``. A positive, finite Python number.

  Raises:
    TypeError: ``num_heads`` not an int, ``max_bias`` not a real Python
      number (a traced value included).
    ValueError: ``num_heads <= 0``, ``max_bias`` not positive and finite.

  Example:
    >>> alibi_slopes(4)
    Array([0.25      , 0.0625    , 0.015625  , 0.00390625], dtype=float32)
    >>> alibi_slopes(4, max_bias=16.0).tolist()  # MPT's alibi_bias_max=16
    [0.0625, 0.00390625, 0.000244140625, 1.52587890625e-05]
  """
  checks.check_positive_int("num_heads", num_heads)
  max_bias = _checked_max_bias(max_bias)

  def powers(n):
    start = 2.0 ** (-max_bias / n)
    return [start ** (i + 1) for i in range(n)]

  closest = 2 ** math.floor(math.log2(num_heads))
  slopes = powers(closest)
  if closest < num_heads:
    slopes += powers(2 * closest)[0::2][:num_heads - closest]
  return jnp.asarray(slopes, jnp.float32)


def _checked_max_bias(max_bias) -> float:
  """ALiBi's ``max_bias``: a static, positive, finite real number."""
  if isinstance(max_bias, (bool, np.bool_)) or not isinstance(
      max_bias, (int, float, np.integer, np.floating)):
    raise TypeError(
        f"alibi_slopes' max_bias must be a positive Python number (8.0 in the "
        f"paper; MPT's alibi_bias_max), got {max_bias!r} "
        f"({type(max_bias).__name__}): slopes are static, pass a number.")
  if not (max_bias > 0 and math.isfinite(max_bias)):
    raise ValueError(
        f"alibi_slopes' max_bias must be positive and finite (the last "
        f"power-of-two slope is 2**-max_bias), got {max_bias}: e.g. 8.0.")
  return float(max_bias)


def _alibi(score, b, h, q_idx, kv_idx, slopes):
  del b
  distance = (q_idx - kv_idx).astype(score.dtype)
  return score - slopes[h].astype(score.dtype) * distance


def alibi(slopes: jax.Array) -> ScoreMod:
  """ALiBi (Press et al. 2022): ``score - slopes[h] * (q_idx - kv_idx)``.

  Args:
    slopes: float ``[N]``, one per query head, e.g. ``alibi_slopes(N)``
      (or learned: they are differentiated). ``h`` indexes the heads of 4-D
      ``[B, N, T, H]`` operands; with ``[N, T, H]`` the one leading axis is
      read as the batch (``h`` = 0): add a batch axis.

  The penalty grows with distance into the past; a constant shift per row
  (e.g. the ``S - T`` of bottom-right alignment) does not change the
  softmax.

  Example:
    >>> import attention_jax as aj
    >>> q = k = v = jnp.ones((1, 2, 4, 8))  # [B, N, T, H]
    >>> out = aj.scaled_dot_product_attention(
    ...     q, k, v, is_causal=True, score_mod=alibi(alibi_slopes(2)))
    >>> out.shape
    (1, 2, 4, 8)
  """
  slopes = jnp.asarray(slopes)
  if slopes.ndim != 1 or not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise ValueError(f"alibi takes float slopes [N], one per query head, got "
                     f"shape {slopes.shape} {slopes.dtype}: e.g. "
                     "aj.alibi(aj.alibi_slopes(num_heads)).")
  return ScoreMod(_alibi, slopes, blocks=False)


def t5_buckets(relative_position: jax.Array, *, num_buckets: int,
               max_distance: int, bidirectional: bool) -> jax.Array:
  """T5's bucket of each relative position ``kv_idx - q_idx`` (int32).

  Raffel et al. 2020 (mesh-tensorflow's ``_relative_position_bucket``):
  half the buckets per direction when ``bidirectional`` (keys after the
  query in the upper half), otherwise only the past counts (a key after the
  query shares bucket 0). Distances below half the buckets each get their
  own; beyond, buckets grow logarithmically up to ``max_distance``, and
  everything farther shares the last. Computed in float32, as T5 does.

  Example:
    >>> t5_buckets(jnp.arange(-5, 6), num_buckets=8, max_distance=16,
    ...            bidirectional=True).tolist()  # relative positions -5..5
    [2, 2, 2, 2, 1, 0, 5, 6, 6, 6, 6]
  """
  rel = jnp.asarray(relative_position, jnp.int32)
  buckets = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    buckets = jnp.where(rel > 0, num_buckets, 0)
    rel = jnp.abs(rel)
  else:
    rel = -jnp.minimum(rel, 0)
  max_exact = num_buckets // 2
  small = rel < max_exact
  scaled = (jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / max_exact)
            / math.log(max_distance / max_exact) * (num_buckets - max_exact))
  large = jnp.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
  return buckets + jnp.where(small, rel, large)


@dataclasses.dataclass(frozen=True)
class T5Bias:
  """The static settings of a T5 relative position bias.

  Attributes:
    num_buckets: rows of the learned ``[num_buckets, N]`` table (T5: 32);
      at least 4 (2 per direction when bidirectional).
    max_distance: distances from here on share the last bucket (T5: 128).
    bidirectional: True for encoders (keys on both sides), False for
      causal decoders.
  """
  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True

  def __post_init__(self):
    checks.check_positive_int("num_buckets", self.num_buckets)
    checks.check_positive_int("max_distance", self.max_distance)
    per_side = self.num_buckets // (2 if self.bidirectional else 1)
    if per_side < 2 or self.max_distance <= per_side // 2:
      raise ValueError(
          f"T5Bias needs at least 2 buckets per direction and max_distance "
          f"above the exact range (num_buckets // {2 if self.bidirectional else 1} "
          f"// 2 = {per_side // 2}), got num_buckets={self.num_buckets}, "
          f"max_distance={self.max_distance}.")
    if not isinstance(self.bidirectional, bool):
      raise TypeError(f"bidirectional must be a bool, got "
                      f"{self.bidirectional!r}.")

  def score_mod(self, table: jax.Array) -> ScoreMod:
    """``t5_relative_bias(table, ...)`` with these settings."""
    return t5_relative_bias(table, max_distance=self.max_distance,
                            bidirectional=self.bidirectional)

  def __call__(self, score, b, h, q_idx, kv_idx, table):
    """The ``ScoreMod.fn``: hashable by value, so one per setting."""
    del b
    bucket = t5_buckets(kv_idx - q_idx, num_buckets=self.num_buckets,
                        max_distance=self.max_distance,
                        bidirectional=self.bidirectional)
    return score + table[bucket, h].astype(score.dtype)


def t5_relative_bias(table: jax.Array, *, max_distance: int = 128,
                     bidirectional: bool = True) -> ScoreMod:
  """T5's relative position bias: ``score + table[bucket(kv_idx - q_idx), h]``.

  Args:
    table: float ``[num_buckets, N]``, learned (differentiated in every
      implementation). ``MultiHeadAttention(t5_bias=T5Bias(...))`` owns one.
      Per-head columns need 4-D ``[B, N, T, H]`` operands (as for
      ``alibi``).
    max_distance: see ``t5_buckets``.
    bidirectional: see ``t5_buckets``.

  ``q_idx`` and ``kv_idx`` are positions in one sequence: self-attention
  (``T == S``), or cached decoding, where ``MultiHeadAttention`` passes each
  example's absolute positions.

  Example:
    >>> import attention_jax as aj
    >>> table = jnp.zeros((32, 2))  # [num_buckets, N]
    >>> q = k = v = jnp.ones((1, 2, 5, 8))  # [B, N, T, H]
    >>> aj.scaled_dot_product_attention(
    ...     q, k, v, score_mod=t5_relative_bias(table)).shape
    (1, 2, 5, 8)
  """
  table = jnp.asarray(table)
  if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
    raise ValueError(f"t5_relative_bias takes a float table [num_buckets, N], "
                     f"got shape {table.shape} {table.dtype}.")
  return ScoreMod(T5Bias(table.shape[0], max_distance, bidirectional), table,
                  blocks=False)


@dataclasses.dataclass(frozen=True)
class _SoftCap:
  cap: float

  def __call__(self, score, b, h, q_idx, kv_idx, params):
    del b, h, q_idx, kv_idx, params
    # -inf in gives -cap out; the kernels never pass -inf in (blocked
    # entries reach a modifier as 0), and chain re-blocks what an earlier
    # modifier blocked.
    return self.cap * jnp.tanh(score / self.cap)


def soft_cap(cap: float) -> ScoreMod:
  """Logit soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``.

  Args:
    cap: a positive Python number (static), e.g. 50.0.

  Entries blocked by a mask, a bias or an earlier modifier of a ``chain``
  stay blocked. After other modifiers it goes last: ``chain(alibi(slopes),
  soft_cap(30.0))``.

  Example:
    >>> mod = soft_cap(2.0)
    >>> mod(jnp.array([0.0, 100.0]), 0, 0, 0, 0).tolist()
    [0.0, 2.0]
    >>> block = ScoreMod(lambda s, b, h, q, k, p: jnp.where(q == k, -jnp.inf, s))
    >>> chain(block, mod)(jnp.array([1.0, 100.0]), 0, 0, jnp.arange(2),
    ...                   1).round(4).tolist()  # key 1 blocked for query 1
    [0.9242, -inf]
  """
  checks.check_soft_cap(cap, "soft_cap's cap", optional=False)
  # Finite scores stay finite: the kernels need not check for -inf.
  return ScoreMod(_SoftCap(float(cap)), blocks=False)


@dataclasses.dataclass(frozen=True)
class _QueryTemperature:
  floor_scale: float
  attn_scale: float
  offset: float = 1.0

  def __call__(self, score, b, h, q_idx, kv_idx, params):
    del b, h, kv_idx, params
    position = q_idx.astype(jnp.float32)
    temperature = (jnp.log1p(jnp.floor((position + self.offset)
                                       / self.floor_scale))
                   * self.attn_scale + 1.0)
    return score * temperature.astype(score.dtype)


def query_temperature(*, floor_scale: float, attn_scale: float,
                      offset: int = 1) -> ScoreMod:
  """Llama 4's attention temperature tuning on its NoPE layers.

  The query at position ``i`` is multiplied by ``1 + attn_scale *
  log1p(floor((i + offset) / floor_scale))`` (Llama 4's modeling code, from
  "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399), so its
  scores are: flatter attention grows sharper with the context length. It
  is 1 for ``i + offset < floor_scale``. Positions are the query indices
  (absolute positions while decoding, as for every modifier).

  Args:
    floor_scale: a positive Python number (Llama 4: 8192; Ministral 3: the
      rope's original_max_position_embeddings).
    attn_scale: a Python number (Llama 4: 0.1; Ministral 3: its
      llama_4_scaling_beta).
    offset: 1 (Llama 4 counts positions from 1) or 0 (Ministral 3 from 0).

  Example:
    >>> mod = query_temperature(floor_scale=2.0, attn_scale=1.0)
    >>> mod(jnp.ones((4, 1)), 0, 0, jnp.arange(4)[:, None],
    ...     0).ravel().round(4).tolist()
    [1.0, 1.6931, 1.6931, 2.0986]
  """
  for name, value in (("floor_scale", floor_scale),
                      ("attn_scale", attn_scale)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        not math.isfinite(value)):
      raise TypeError(f"query_temperature's {name} must be a finite Python "
                      f"number, got {value!r}.")
  if floor_scale <= 0:
    raise ValueError(f"query_temperature's floor_scale must be positive, "
                     f"got {floor_scale}.")
  if isinstance(offset, bool) or offset not in (0, 1):
    raise ValueError(f"query_temperature's offset must be 1 (Llama 4's "
                     f"positions from 1) or 0 (Ministral 3's), got "
                     f"{offset!r}.")
  return ScoreMod(_QueryTemperature(float(floor_scale), float(attn_scale),
                                    float(offset)), blocks=False)
