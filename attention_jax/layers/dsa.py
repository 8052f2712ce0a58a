"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2-Exp): the lightning indexer.

Shape glossary: B batch, N query heads, K key/value heads (G = N / K), T
queries, S keys (``S = T``: the indexer scores a sequence against itself),
H the main attention's head dim, D model width, J indexer heads, E the
indexer head dim (the paper's ``Hi``; one letter for the einsums), C the
queries of one chunk, k the tokens a query keeps.

DSA (DeepSeek-V3.2-Exp, 2025) keeps the main attention and lets each query
read only ``k`` tokens, chosen by a small scorer, the lightning indexer::

  I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])

with ``q_I[t] = x_t @ W_q`` ``[J, E]`` (J heads), ONE key per token
``k_I[s] = LayerNorm(x_s @ W_k)`` ``[E]`` shared by the indexer heads, and
per-query head weights ``w[t] = x_t @ W_w / sqrt(J * E)`` ``[J]`` (the
constant is DeepSeek's reference code: ``weights_proj(x) * n_heads ** -0.5``
and the scores' ``head_dim ** -0.5``, folded into ``w``). The LayerNorm
(learned scale and bias, eps 1e-6) is there when the params hold
``k_norm`` (``init_indexer_params(k_norm=True)``, the default, as
DeepSeek); ``rope=`` (an ``aj.Rope``, e.g. ``Rope(fraction=
0.5)``: DeepSeek rotates the first ``rope_head_dim`` features of ``q_I`` and
``k_I``) rotates both at ``positions`` (default ``0..T-1``, restarting per
document with segment ids). DeepSeek reads ``q_I`` from MLA's query latent
``c_q``; here both sides read ``x`` (pass ``c_q``'s features through your
own ``x`` if you want that). The indexer's FP8 arithmetic is not modelled.

Each query then attends to its top-``k`` tokens by ``I`` among the visible
ones (causal: ``s <= t``, never a future token; a query seeing ``<= k``
tokens gets all of them and ``-1`` for the rest). Every head of the main
attention reads the same tokens (DeepSeek attends with MLA in its MQA
mode: one key/value head). ``indexer_top_k`` computes the choice in query
chunks, keeping only the top ``k`` of each chunk (memory ``O(J * C * S)``
besides the ``[B, T, k]`` answer, never ``[T, S]``); ``dsa_selection``
turns it into an ``aj.BlockMask`` for ``aj.Mask(causal=True, rule=...)``.

Training (the paper's section 2.1): the indexer's input is detached
(``stop_gradient`` on ``x``) and it learns from a KL loss towards the main
attention's distribution ``p[t, :] = sum_n softmax(scale * q_n[t] .
k_n)``, L1-normalised (``stop_gradient``: the target never trains the main
model): ``loss = mean_t KL(p[t] || softmax(I[t]))``. Dense warm-up: over
every visible key (the main attention dense); sparse stage: over the
selected set ``S_t`` only, ``p`` (the sparse attention's per-head weights,
summed) and ``softmax(I)`` both renormalised over ``S_t``.

Masks: ``indexer_top_k`` and ``indexer_loss`` are causal and intersect an
optional ``aj.Mask`` of the main attention's other fields: ``window``,
``q_lengths``/``kv_lengths`` (a scalar or ``[B]``), segment ids (``[T]`` or
``[B, T]``). Queries and keys are the same tokens, so a token past
``kv_lengths`` is padding as a query too: it chooses nothing (``-1``), is
left out of the loss, and its ``x`` is zeroed before the projections (a
NaN there reaches no score and no gradient). Refused by name: dense masks
and rules (the indexer has no head to evaluate them for, and DSA's own
rule is the selection), fields per head, positions (``q_offset``/
``kv_offset``): the indexer scores the tokens it is given against each
other and keeps no cache of its keys, so cached decoding is not supported.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.masking import intervals
from attention_jax.masking import selection
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib

Params = dict[str, dict[str, jax.Array]]

# DeepSeek-V3.2-Exp's reference LayerNorm (inference/model.py) uses 1e-6.
K_NORM_EPSILON = 1e-6


class IndexerDims(NamedTuple):
  d_model: int
  num_heads: int
  head_dim: int
  k_norm: bool


LAYOUT = {
    "W_q": "kernel [D, J, E]",
    "W_k": "kernel [D, E]",
    "W_w": "kernel [D, J]",
    "k_norm": "scale [E], bias [E]",
}


def init_indexer_params(key: jax.Array, d_model: int, num_heads: int,
                        head_dim: int, *, k_norm: bool = True,
                        dtype: jnp.dtype = jnp.float32) -> Params:
  """The lightning indexer's parameters, laid out as ``LAYOUT``.

  ``W_q.kernel [D, J, E]``, ``W_k.kernel [D, E]``, ``W_w.kernel [D, J]``
  (LeCun normal on the flat ``[D, J * E]``, ``[D, E]``, ``[D, J]``: fan-in
  ``D``; no biases, as DeepSeek's projections), and with ``k_norm`` the
  keys' LayerNorm ``k_norm.scale`` (ones) and ``k_norm.bias`` (zeros) ``[E]``.

  Args:
    key: a PRNG key.
    d_model: ``D``, the width of ``x``.
    num_heads: ``J``, indexer heads (DeepSeek-V3.2: 64).
    head_dim: ``E`` (the paper's ``Hi``; DeepSeek-V3.2: 128).
    k_norm: a LayerNorm of ``k_I`` (DeepSeek's ``k_norm``).
    dtype: parameter dtype.

  Example:
    >>> p = init_indexer_params(jax.random.key(0), 16, 4, 8)
    >>> [p[n]["kernel"].shape for n in ("W_q", "W_k", "W_w")]
    [(16, 4, 8), (16, 8), (16, 4)]
    >>> sorted(p["k_norm"]), p["k_norm"]["scale"].shape
    (['bias', 'scale'], (8,))
  """
  for name, value in (("d_model", d_model), ("num_heads", num_heads),
                      ("head_dim", head_dim)):
    checks.check_positive_int(name, value)
  checks.check_static_bool("k_norm", k_norm)
  kq, kk, kw = jax.random.split(key, 3)
  init = jax.nn.initializers.lecun_normal()
  params = {
      "W_q": {"kernel": init(kq, (d_model, num_heads * head_dim),
                             dtype).reshape(d_model, num_heads, head_dim)},
      "W_k": {"kernel": init(kk, (d_model, head_dim), dtype)},
      "W_w": {"kernel": init(kw, (d_model, num_heads), dtype)},
  }
  if k_norm:
    params["k_norm"] = {"scale": jnp.ones((head_dim,), dtype),
                        "bias": jnp.zeros((head_dim,), dtype)}
  return params


def _entry(params, name: str, entry: str) -> tuple[int, ...]:
  layer = params[name]
  want = {"scale", "bias"} if name == "k_norm" else {"kernel"}
  if not hasattr(layer, "keys") or set(layer) != want:
    raise ValueError(
        f"params['{name}'] must hold {LAYOUT[name]}; got "
        f"{sorted(layer) if hasattr(layer, 'keys') else layer!r}.")
  return checks.shape_of(layer[entry])


def indexer_dims(params: Params) -> IndexerDims:
  """``(D, J, E, k_norm)`` read from the params' shapes, checked."""
  if not hasattr(params, "keys"):
    raise TypeError(f"params must be a dict from init_indexer_params, got "
                    f"{type(params).__name__}.")
  missing = [n for n in ("W_q", "W_k", "W_w") if n not in params]
  extra = sorted(set(params) - set(LAYOUT))
  if missing or extra:
    raise ValueError(
        f"indexer params need W_q, W_k, W_w and optionally k_norm "
        f"({LAYOUT}; init_indexer_params); got entries {sorted(params)} "
        f"(missing {missing}, unknown {extra}).")
  wq, wk, ww = (_entry(params, n, "kernel") for n in ("W_q", "W_k", "W_w"))
  if (len(wq) != 3 or len(wk) != 2 or len(ww) != 2 or wk[0] != wq[0]
      or ww[0] != wq[0] or wk[1] != wq[2] or ww[1] != wq[1]):
    raise ValueError(
        f"indexer params must be W_q [D, J, E], W_k [D, E], W_w [D, J] with "
        f"one D, J and E; got W_q {wq}, W_k {wk}, W_w {ww}.")
  norm = "k_norm" in params
  if norm:
    shapes = {e: _entry(params, "k_norm", e) for e in ("scale", "bias")}
    if any(v != (wq[2],) for v in shapes.values()):
      raise ValueError(
          f"params['k_norm'] (the keys' LayerNorm) must be scale and bias "
          f"[E] = [{wq[2]}]; got {shapes}.")
  return IndexerDims(wq[0], wq[1], wq[2], norm)


# -- the mask's fields the indexer reads -----------------------------------


class _Visibility(NamedTuple):
  """What a query may see besides causality: arrays with a batch axis of
  ``B`` or 1 (``lengths [B|1]``, ``ids [B|1, T]``)."""
  causal: bool
  window: tuple[int, int] | None
  q_lengths: jax.Array | None
  kv_lengths: jax.Array | None
  q_ids: jax.Array | None
  kv_ids: jax.Array | None


def _per_example(name: str, x, core: int, b: int, t: int | None):
  """A mask field as ``[B|1]`` (lengths) or ``[B|1, T]`` (ids)."""
  x = jnp.asarray(x)
  shape = tuple(x.shape)
  lead = shape[:x.ndim - core]
  if len(lead) == 2 and lead[1] == 1:
    x, lead = x[:, 0], lead[:1]
  if len(lead) > 1 or (lead and lead[0] not in (1, b)) or (
      core and shape[-1] != t):
    what = "a scalar or [B]" if core == 0 else "[T] or [B, T]"
    raise ValueError(
        f"the mask's {name} has shape {list(shape)}: the indexer reads {what} "
        f"(B = {b}, T = {t}), one value for every head, since all heads "
        "share its choice; per-head fields are refused.")
  return x.reshape((1,) * (1 - len(lead)) + x.shape).astype(jnp.int32)


def _visibility(mask, b: int, t: int, *, causal: bool) -> _Visibility:
  """The mask's fields the indexer honours, every other one refused."""
  if mask is None:
    return _Visibility(causal, None, None, None, None, None)
  if not isinstance(mask, Mask):
    raise TypeError(
        f"mask must be an aj.Mask (window, lengths, segment ids), got "
        f"{type(mask).__name__}; a dense bool array is not taken.")
  if mask.positioned:
    raise ValueError(
        "the indexer's mask gives positions (q_offset/kv_offset): cached "
        "decoding is not supported by the lightning indexer (it scores the "
        "tokens it is given against each other and keeps no cache of its "
        "keys); drop the positions and score the whole sequence.")
  for name in ("dense", "rule"):
    if getattr(mask, name) is not None:
      raise ValueError(
          f"the indexer's mask holds a {name}: it takes causal, window, "
          f"q_lengths/kv_lengths and segment ids only (its choice is shared "
          f"by every head, so a {name} has no head to be evaluated for); "
          f"apply the {name} to the main attention's mask instead.")
  lengths = [None if getattr(mask, n) is None else _per_example(
      n, getattr(mask, n), 0, b, None) for n in ("q_lengths", "kv_lengths")]
  ids = [None if getattr(mask, n) is None else _per_example(
      n, getattr(mask, n), 1, b, t)
         for n in ("q_segment_ids", "kv_segment_ids")]
  q_lengths, kv_lengths = lengths
  if kv_lengths is not None:
    # One sequence: a token past kv_lengths is padding as a query too (it
    # chooses nothing and is left out of the loss).
    q_lengths = kv_lengths if q_lengths is None else jnp.minimum(
        q_lengths, kv_lengths)
  return _Visibility(causal or mask.causal, mask.window, q_lengths,
                     kv_lengths, *ids)


def _visible(vis: _Visibility, rows, cols, t: int, b: int):
  """Bool ``[B|1, C, n]``: may query ``rows [C]`` (global indices, those
  ``>= T`` padding) see key ``cols`` (``[1, 1, S]`` every key, or ``[B,
  C, k]`` a selection, out-of-range entries never)?"""
  r = rows[None, :, None]  # [1, C, 1]
  ok = (r < t) & (cols >= 0) & (cols < t)
  band = intervals.visible(r, cols, 0, intervals.bounds(vis.causal,
                                                        vis.window))
  if band is not None:
    ok = ok & band
  if vis.q_lengths is not None:
    ok = ok & (r < vis.q_lengths[:, None, None])
  if vis.kv_lengths is not None:
    ok = ok & (cols < vis.kv_lengths[:, None, None])
  if vis.q_ids is not None:
    q_ids = jnp.take(vis.q_ids, jnp.minimum(rows, t - 1), axis=1)  # [B|1, C]
    full = (b, cols.shape[1], cols.shape[2])
    kv_ids = jax.vmap(lambda ids, c: ids[c])(
        jnp.broadcast_to(vis.kv_ids, (b, t)),
        jnp.broadcast_to(jnp.clip(cols, 0, t - 1), full))  # [B, C, n]
    ok = ok & (q_ids[:, :, None] == kv_ids)
  return ok


# -- projections -----------------------------------------------------------


class _Indexer(NamedTuple):
  q: jax.Array  # [B, J, T, E]
  k: jax.Array  # [B, S, E]
  w: jax.Array  # [B, J, T], DeepSeek's constants folded in


def _check_x(x, dims: IndexerDims) -> jax.Array:
  return checks.layer_input(
      "x", x, dims.d_model,
      f"indexer params have D = {dims.d_model} (W_q [D, J, E])")


def _positions(positions, vis: _Visibility, b: int, t: int) -> jax.Array:
  """Rotary positions ``[B|1, T]``."""
  if positions is None:
    if vis.q_ids is not None:
      return rope_lib.segment_positions(vis.q_ids)
    return jnp.arange(t)[None]
  if isinstance(positions, (list, tuple)):
    positions = np.asarray(positions)
  shape = checks.shape_of(positions)
  if not jnp.issubdtype(jnp.result_type(positions), jnp.integer) or (
      shape not in ((t,), (1, t), (b, t))):
    raise ValueError(
        f"positions must be integer [B, T] = [{b}, {t}] or [T] (the tokens' "
        f"rotary positions), got dtype {jnp.result_type(positions)} with "
        f"shape {list(shape)}.")
  positions = jnp.asarray(positions)
  return positions[None] if positions.ndim == 1 else positions


def _layer_norm(x, scale, bias):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return ((x - mean) * jax.lax.rsqrt(var + K_NORM_EPSILON)
          * scale[None, None, :] + bias[None, None, :])


def _project(params: Params, x, vis: _Visibility, rope, positions
             ) -> _Indexer:
  """The indexer's queries, keys and weights from the detached ``x``."""
  dims = indexer_dims(params)
  x = _check_x(x, dims)
  b, t, _ = x.shape
  rope = rope_lib.as_rope(rope)
  if rope is None and positions is not None:
    raise ValueError("positions are given but rope is None: the indexer "
                     "reads positions only to rotate; pass rope= too.")
  pos = None if rope is None else _positions(positions, vis, b, t)
  dtype = jnp.promote_types(
      jnp.result_type(x, params["W_q"]["kernel"]), jnp.float32)
  p = jax.tree.map(lambda v: jnp.asarray(v, dtype), dict(params))
  x = jax.lax.stop_gradient(x).astype(dtype)  # the indexer never trains x
  # Padding tokens are zeroed: they may hold NaN, and 0 * NaN would reach
  # the params' gradients through the masked scores.
  rows = jnp.arange(t)[None, :]  # [1, T]
  x_q = x_k = x
  if vis.q_lengths is not None:
    x_q = jnp.where((rows < vis.q_lengths[:, None])[..., None], x, 0.0)
  if vis.kv_lengths is not None:
    x_k = jnp.where((rows < vis.kv_lengths[:, None])[..., None], x, 0.0)
  q = jnp.einsum("BTD,DJE->BJTE", x_q, p["W_q"]["kernel"])  # [B, J, T, E]
  k = jnp.einsum("BSD,DE->BSE", x_k, p["W_k"]["kernel"])  # [B, S, E]
  if dims.k_norm:
    k = _layer_norm(k, p["k_norm"]["scale"], p["k_norm"]["bias"])
  if rope is not None:  # pos [B|1, T]
    q = rope_lib.apply_rope(q, pos[:, None, :], rope=rope)
    k = rope_lib.apply_rope(k, pos, rope=rope)
  w = jnp.einsum("BTD,DJ->BJT", x_q, p["W_w"]["kernel"]) * (
      dims.num_heads * dims.head_dim) ** -0.5  # [B, J, T]
  return _Indexer(q, k, w)


def _chunk_scores(q, k, w):
  """``I`` for one chunk: ``q [B, J, C, E]``, keys ``k [B, S, E]`` (or
  ``[B, C, k, E]``, each row its own), ``w [B, J, C]`` -> ``[B, C, S]``."""
  if k.ndim == 3:
    dots = jnp.einsum("BJCE,BSE->BJCS", q, k)  # [B, J, C, S]
  else:
    dots = jnp.einsum("BJCE,BCSE->BJCS", q, k)  # [B, J, C, k]
  return jnp.einsum("BJCS,BJC->BCS", jax.nn.relu(dots), w)


def _check_chunk(chunk, t: int) -> int:
  if chunk is None:
    return t
  checks.check_positive_int("chunk", chunk)
  return min(chunk, t)


def _map_chunks(fn, t: int, c: int):
  """``fn(rows [C])`` over the query chunks (``lax.map``: one chunk's
  arrays live at a time), stacked ``[nc, ...]``."""
  nc = -(-t // c)
  if nc == 1:
    return jax.tree.map(lambda a: a[None], fn(jnp.arange(c)))
  return jax.lax.map(lambda i: fn(i * c + jnp.arange(c)), jnp.arange(nc))


def _rows_of(a, rows, axis: int, t: int):
  """Rows ``rows`` of ``a`` along ``axis`` (those past ``T`` clipped)."""
  return jnp.take(a, jnp.minimum(rows, t - 1), axis=axis)


def _unchunk(a, t: int):
  """``[nc, B, C, ...]`` -> ``[B, T, ...]``."""
  a = jnp.moveaxis(a, 0, 1)
  a = a.reshape(a.shape[:1] + (-1,) + a.shape[3:])
  return a[:, :t]


def indexer_scores(params: Params, x: ArrayLike, *, chunk: int | None = None,
                   mask: Mask | None = None, rope: Any = None,
                   positions: ArrayLike | None = None) -> jax.Array:
  """The lightning indexer's scores ``I [B, T, S]`` (``S = T``).

  Computed in query chunks of ``chunk`` rows (``lax.map``: ``O(J * chunk *
  S)`` memory besides the output); to choose tokens use ``indexer_top_k``,
  which never holds ``[T, S]``.

  Args:
    params: ``init_indexer_params``' dict.
    x: float ``[B, T, D]`` (detached: no gradient reaches it).
    chunk: queries per chunk; None: all at once.
    mask: None: every pair scored (causal or not is the caller's); an
      ``aj.Mask`` (causal, window, lengths, segment ids): pairs it hides are
      ``-inf``.
    rope: an ``aj.Rope`` rotating ``q_I`` and ``k_I``, or None.
    positions: integer ``[B, T]`` or ``[T]`` rotary positions (with
      ``rope``); None: ``0..T-1``, restarting per document with segment ids.

  Returns:
    float32 (float64 for float64 inputs) ``[B, T, S]``.

  Example:
    >>> p = init_indexer_params(jax.random.key(0), 16, 4, 8)
    >>> indexer_scores(p, jnp.ones((2, 5, 16)), chunk=2).shape
    (2, 5, 5)
  """
  x = checks.as_array_operand("x", x, "[B, T, D]")
  checks.check_rank("x", x, (3,), "[B, T, D]")
  b, t, _ = checks.shape_of(x)
  c = _check_chunk(chunk, t)
  vis = _visibility(mask, b, t, causal=False)
  ix = _project(params, x, vis, rope, positions)
  cols = jnp.arange(t)[None, None, :]  # [1, 1, S]

  def one(rows):
    scores = _chunk_scores(_rows_of(ix.q, rows, 2, t), ix.k,
                           _rows_of(ix.w, rows, 2, t))  # [B, C, S]
    if mask is None:
      return scores
    return jnp.where(_visible(vis, rows, cols, t, b), scores, -jnp.inf)

  return _unchunk(_map_chunks(one, t, c), t)  # [B, T, S]


def indexer_top_k(params: Params, x: ArrayLike, k: int, *,
                  chunk: int | None = None, mask: Mask | None = None,
                  rope: Any = None,
                  positions: ArrayLike | None = None) -> jax.Array:
  """Each query's top-``k`` visible tokens by the indexer's score.

  Causal always (a query never chooses a future token), intersected with
  ``mask``'s other fields. Scores are computed a chunk of queries at a
  time and only each chunk's top ``k`` kept: memory ``O(J * chunk * S)``
  besides the ``[B, T, k]`` answer. Not differentiated (a choice).

  Args:
    params, x, rope, positions: as ``indexer_scores``.
    k: tokens per query (DeepSeek-V3.2: 2048), a positive int.
    chunk: queries per chunk; None: all at once.
    mask: an ``aj.Mask`` (window, ``q_lengths``/``kv_lengths`` scalar or
      ``[B]``, segment ids ``[T]``/``[B, T]``) or None.

  Returns:
    int32 ``[B, T, k]``: the chosen key indices, best first (ties to the
    lower index, as ``jax.lax.top_k``), ``-1`` where fewer than ``k`` keys
    are visible (all visible keys are then chosen).

  Example:
    >>> p = init_indexer_params(jax.random.key(0), 16, 4, 8)
    >>> x = jnp.ones((1, 4, 16))  # equal tokens: every score ties
    >>> indexer_top_k(p, x, 2)[0].tolist()  # lower index first; t=0 sees 1
    [[0, -1], [0, 1], [0, 1], [0, 1]]
  """
  checks.check_positive_int("k", k)
  x = checks.as_array_operand("x", x, "[B, T, D]")
  checks.check_rank("x", x, (3,), "[B, T, D]")
  b, t, _ = checks.shape_of(x)
  c = _check_chunk(chunk, t)
  vis = _visibility(mask, b, t, causal=True)
  ix = _project(params, x, vis, rope, positions)
  kk = min(k, t)
  cols = jnp.arange(t)[None, None, :]  # [1, 1, S]

  def one(rows):
    scores = _chunk_scores(_rows_of(ix.q, rows, 2, t), ix.k,
                           _rows_of(ix.w, rows, 2, t))  # [B, C, S]
    scores = jnp.where(_visible(vis, rows, cols, t, b), scores, -jnp.inf)
    values, top = jax.lax.top_k(scores, kk)  # [B, C, k]
    return jnp.where(values > -jnp.inf, top, -1).astype(jnp.int32)

  top = _unchunk(_map_chunks(one, t, c), t)  # [B, T, min(k, S)]
  if kk < k:  # fewer tokens than k: the rest select nothing
    top = jnp.pad(top, ((0, 0), (0, 0), (0, k - kk)), constant_values=-1)
  return jax.lax.stop_gradient(top)


def _check_indices(indices, b: int, t: int) -> jax.Array:
  indices = jnp.asarray(indices) if isinstance(
      indices, (list, tuple, np.ndarray)) else indices
  if not hasattr(indices, "dtype") or not jnp.issubdtype(indices.dtype,
                                                          jnp.integer):
    raise TypeError(
        f"indices must be an integer array [B, T, k] (indexer_top_k's), got "
        f"{getattr(indices, 'dtype', type(indices).__name__)}.")
  shape = checks.shape_of(indices)
  if len(shape) != 3 or (b is not None and shape[:2] != (b, t)):
    want = "[B, T, k]" if b is None else f"[B, T, k] = [{b}, {t}, k]"
    raise ValueError(f"indices must be {want} (indexer_top_k's), got shape "
                     f"{list(shape)}.")
  return jnp.asarray(indices, jnp.int32)


def dsa_selection(indices: ArrayLike, kv_len: int, *, block_q: int = 64,
                  block_k: int = 64) -> BlockMask:
  """The chosen tokens as a selection every head shares, for a mask rule.

  ``aj.select_tokens(indices[:, None], ...)``: leading dims ``[B, 1]``, so
  each query head ``h`` of example ``b`` reads ``indices[b, t]``. Use it as
  ``aj.Mask(causal=True, rule=dsa_selection(...))`` in the main attention
  (an ``aj.MultiHeadAttention`` or ``aj.MultiHeadLatentAttention`` call, or
  ``aj.scaled_dot_product_attention``); the flash kernel then walks only
  the blocks holding chosen tokens (give it these ``block_q``/``block_k``).

  Args:
    indices: integer ``[B, T, k]`` (``indexer_top_k``'s; ``-1`` selects
      nothing).
    kv_len: ``S``, the keys of the attention it serves.
    block_q, block_k: the blockwise kernels' blocks (clipped to T and S).

  Returns:
    An ``aj.BlockMask`` with tables ``[B, 1, nq, nk]`` built on device.

  Example:
    >>> sel = dsa_selection(jnp.array([[[0, -1], [1, 0]]]), 2)
    >>> sel.batch_shape
    (1, 1)
  """
  indices = _check_indices(indices, None, None)
  return selection.select_tokens(indices[:, None], kv_len=kv_len,
                                 block_q=block_q, block_k=block_k)


# -- the KL loss ---------------------------------------------------------


def _check_main(q, k, b: int, t: int):
  for name, a, layout in (("q", q, "[B, N, T, H]"), ("k", k, "[B, K, S, H]")):
    checks.check_float_array(name, a)
    checks.check_rank(name, a, (4,), layout)
  (qb, n, qt, h), (kb, kh, ks, kd) = checks.shape_of(q), checks.shape_of(k)
  if (qb, qt) != (b, t) or (kb, ks) != (b, t) or kd != h or n % kh:
    raise ValueError(
        f"q [B, N, T, H] and k [B, K, S, H] must be the main attention's "
        f"queries and keys over x's B = {b}, T = S = {t}, one H, K dividing "
        f"N; got q {list(checks.shape_of(q))}, k {list(checks.shape_of(k))}.")
  return n, kh


def _masked_log_softmax(logits, ok):
  """``log softmax`` over the entries ``ok`` (others ``-inf``); rows with
  none are ``-inf`` everywhere and read nothing."""
  logits = jnp.where(ok, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  e = jnp.where(ok, jnp.exp(logits - top), 0.0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  return logits - top - jnp.log(jnp.where(total > 0, total, 1.0))


def _kl_rows(main_logits, index_scores, ok):
  """``sum`` over rows of ``KL(p || softmax(I))`` and the rows counted.

  ``main_logits [B, K, G, C, n]`` (scaled), ``index_scores [B, C, n]``, ``ok
  [B, C, n]``: the keys of each row's distribution. ``p`` is the heads'
  softmaxes summed and L1-normalised (``stop_gradient``)."""
  ok5 = ok[:, None, None]
  weights = jnp.exp(_masked_log_softmax(main_logits, ok5))  # [B, K, G, C, n]
  p = jnp.sum(jnp.where(ok5, weights, 0.0), axis=(1, 2))  # [B, C, n]
  total = jnp.sum(p, axis=-1, keepdims=True)
  p = jax.lax.stop_gradient(p / jnp.where(total > 0, total, 1.0))
  log_q = _masked_log_softmax(index_scores, ok)
  seen = ok & (p > 0)
  log_p = jnp.log(jnp.where(seen, p, 1.0))
  kl = jnp.sum(jnp.where(seen, p * (log_p - jnp.where(seen, log_q, 0.0)),
                         0.0), axis=-1)  # [B, C]
  rows = jnp.any(ok, axis=-1)
  return jnp.sum(jnp.where(rows, kl, 0.0)), jnp.sum(rows)


def indexer_loss(params: Params, x: ArrayLike, q: ArrayLike, k: ArrayLike, *,
                 scale: float | ArrayLike, indices: ArrayLike | None = None,
                 chunk: int | None = None, mask: Mask | None = None,
                 rope: Any = None,
                 positions: ArrayLike | None = None) -> jax.Array:
  """The indexer's KL loss towards the main attention's distribution.

  ``mean_t KL(p[t] || softmax(I[t]))`` over the batch and the query rows
  that see at least one key, with ``p[t] = sum_n softmax(scale * q_n[t] .
  k_n)`` L1-normalised (the main attention's weights averaged over its
  heads). Causal, intersected with ``mask`` (as ``indexer_top_k``'s).
  Gradients reach only ``params``: ``x``, ``q`` and ``k`` are
  ``stop_gradient``'ed (the target never trains the main model). Computed
  in query chunks (``lax.map``), memory ``O((N + J) * chunk * S)`` for the
  warm-up, ``O((N + J + K * H) * chunk * k)`` for the sparse stage.

  Args:
    params: the indexer's params.
    x: float ``[B, T, D]``, the indexer's input (detached).
    q: ``[B, N, T, H]``, the main attention's queries as it attends with
      them (after rotary and norms; for MLA the per-head ``[q_nope,
      q_pe]``, or the absorbed MQA queries over ``[c_kv, k_pe]``).
    k: ``[B, K, S, H]`` its keys (K dividing N, GQA; ``S = T``).
    scale: the main attention's multiplier of ``q . k`` (required: MLA's
      is ``1 / sqrt(Hn + Hr)`` whatever the width of the absorbed query).
    indices: None: the dense warm-up (KL over every visible key); int
      ``[B, T, k]`` (``indexer_top_k``'s): the sparse stage, both
      distributions renormalised over the selected visible tokens (repeats
      counted once, ``-1`` and out-of-range entries ignored).
    chunk: queries per chunk; None: all at once.
    mask, rope, positions: as ``indexer_top_k``'s.

  Returns:
    A float32 (float64 for float64 inputs) scalar; 0 when no row sees a
    key.

  Example:
    >>> p = init_indexer_params(jax.random.key(0), 16, 4, 8)
    >>> x = jax.random.normal(jax.random.key(1), (1, 5, 16))
    >>> q = k = jax.random.normal(jax.random.key(2), (1, 2, 5, 8))
    >>> float(indexer_loss(p, x, q, k, scale=8 ** -0.5)) >= 0
    True
  """
  x = checks.as_array_operand("x", x, "[B, T, D]")
  checks.check_rank("x", x, (3,), "[B, T, D]")
  b, t, _ = checks.shape_of(x)
  q = checks.as_array_operand("q", q, "[B, N, T, H]")
  k = checks.as_array_operand("k", k, "[B, K, S, H]")
  n, kh = _check_main(q, k, b, t)
  checks.check_call_scale(scale)
  if indices is not None:
    indices = _check_indices(indices, b, t)
  c = _check_chunk(chunk, t)
  vis = _visibility(mask, b, t, causal=True)
  ix = _project(params, x, vis, rope, positions)
  dtype = ix.q.dtype
  q = jax.lax.stop_gradient(jnp.asarray(q, dtype)).reshape(
      b, kh, n // kh, t, -1)  # [B, K, G, T, H]
  k = jax.lax.stop_gradient(jnp.asarray(k, dtype))  # [B, K, S, H]
  scale = jax.lax.stop_gradient(jnp.asarray(scale, dtype))

  def dense(rows):
    ok = jnp.broadcast_to(_visible(vis, rows, jnp.arange(t)[None, None, :],
                                   t, b), (b, rows.shape[0], t))  # [B, C, S]
    logits = scale * jnp.einsum("BKGCH,BKSH->BKGCS",
                                _rows_of(q, rows, 3, t), k)
    scores = _chunk_scores(_rows_of(ix.q, rows, 2, t), ix.k,
                           _rows_of(ix.w, rows, 2, t))  # [B, C, S]
    return _kl_rows(logits, scores, ok)

  def sparse(rows):
    chosen = _rows_of(indices, rows, 1, t)  # [B, C, k]
    chosen = jnp.where((chosen >= 0) & (chosen < t), chosen, -1)
    chosen = jnp.sort(chosen, axis=-1)  # repeats side by side
    repeat = jnp.concatenate([jnp.zeros_like(chosen[..., :1], bool),
                              chosen[..., 1:] == chosen[..., :-1]], -1)
    ok = _visible(vis, rows, chosen, t, b) & ~repeat  # [B, C, k]
    safe = jnp.maximum(chosen, 0)
    gather = jax.vmap(lambda a, i: a[..., i, :])
    keys = gather(k, safe)  # [B, K, C, k, H]
    logits = scale * jnp.einsum("BKGCH,BKCSH->BKGCS",
                                _rows_of(q, rows, 3, t), keys)
    scores = _chunk_scores(_rows_of(ix.q, rows, 2, t), gather(ix.k, safe),
                           _rows_of(ix.w, rows, 2, t))  # [B, C, k]
    return _kl_rows(logits, scores, ok)

  total, count = _map_chunks(dense if indices is None else sparse, t, c)
  count = jnp.sum(count)
  return jnp.sum(total) / jnp.maximum(count, 1).astype(dtype)
