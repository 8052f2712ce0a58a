"""Native Sparse Attention (NSA), Yuan et al. 2025 (DeepSeek): pure functions.

"Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse
Attention". Causal self-attention in which every query reads three sets of
keys, each through its own attention, mixed by learned gates::

  o_t = g_t^cmp Attn(q_t, K~cmp, V~cmp) + g_t^slc Attn(q_t, K_slc[sel_t],
        V_slc[sel_t]) + g_t^win Attn(q_t, K_win[t-w+1:t], V_win[t-w+1:t])

Shape glossary: B batch, T tokens (queries and keys: self-attention, so S =
T), D model width, N query heads, K key/value heads, G = N / K query heads
per key/value head, H head dim; L = ``block`` (l, the tokens a compressed
block summarises), ``stride`` (d, the step between compressed blocks), C
compressed blocks (``floor((T - l) / d) + 1``, 0 when ``T < l``), J
selection blocks of ``select_block`` (l') tokens (``ceil(T / l')``), M the
compression MLP's hidden width, E a compressed key's features (= H), R the
three branches (cmp, slc, win).

The branches (paper section 3.3):

- compressed (eq. 7): block ``i`` covers tokens ``[i d, i d + l)``; its key
  is ``phi(k[i d : i d + l])``, ``phi`` an MLP of the flattened block
  with an intra-block position encoding: ``phi(z) = gelu(flatten(z +
  position) @ W_1 + b_1) @ W_2 + b_2`` (``position [L, H]``, ``W_1 [L, H,
  M]``, ``W_2 [M, E]``; one MLP for the keys, ``phi_k``, one for the
  values, ``phi_v``, shared by the key/value heads; exact GELU). The hidden
  layer is what makes the position table count: added before a purely
  linear map it would be a constant shift of every compressed key, which
  the softmax cancels. Query ``t`` reads block ``i`` only when the whole
  block is at or before it (``i d + l - 1 <= t``); a query that reads none
  (``t < l - 1``) gets 0 from this branch. This branch is a dense ``[B,
  N, T, C]`` attention computed here (C ~ T / d, never ``[T, T]``): the
  selection needs its probabilities anyway.
- selected (eqs. 8-11): the compressed branch's probabilities ``p_cmp[t,
  i]`` (``[B, N, T, C]``) give selection block ``j`` (tokens ``[j l', (j +
  1) l')``) the importance ``sum_i w[i, j] p_cmp[t, i]``, ``w[i, j]`` the
  number of the ``d``-token strides of compressed block ``i`` that lie in
  selection block ``j`` (eq. 9's double sum: with ``l' = l = d`` it is
  ``p_cmp`` itself), summed over the ``G`` query heads of a group (eq. 10:
  one selection per key/value head). Every query keeps the first block, its
  ``local_blocks`` local ones (the block holding ``t`` and those just
  before) and the best others up to ``top_n`` in all (ties to the lower
  block), never a block after its own; inside its own block it reads
  causally. The choice is an ``aj.select_blocks`` block mask, so the flash
  kernel walks only the chosen blocks.
- sliding window: the last ``window`` tokens, causal.

The gates are ``sigmoid(x @ W_g + b)``, one per (query head, branch). Each
branch has its own keys and values (``W_k_cmp``, ``W_v_cmp``, ``W_k_slc``,
...), as the paper chooses (section 3.3.3: independent keys and values for
the three branches keep one branch's gradients, the sliding window's local
pattern above all, from shaping the keys the others read).

Gradients reach every parameter: the projections, ``phi_k``/``phi_v``
(through the compressed branch), the gates and ``W_o``. The selection is
not differentiated: it is a choice (a boolean table, ``stop_gradient`` on
its importance scores); the compression learns from the compressed
branch's own output, as in the paper.

Rotary positions (``rope=``, optional; the paper is silent): queries and
every branch's keys are rotated at their token positions ``0..T-1``, the
compressed branch's keys before compression (so a compressed key mixes
rotated keys, and its block's position encoding rides on top). Default
none: the compressed branch's position encoding is then the only position
signal besides causality.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.core import softmax
from attention_jax.masking import selection
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib

Params = dict[str, dict[str, jax.Array]]

BRANCHES = ("cmp", "slc", "win")  # the order of the gates' last axis

# The layout of each parameter, for messages.
LAYOUT = {
    "W_q": "kernel [D, N, H], bias [N, H]",
    **{f"W_{kv}_{b}": "kernel [D, K, H], bias [K, H]"
       for b in BRANCHES for kv in "kv"},
    "phi_k": "position [L, H], W_1 [L, H, M], b_1 [M], W_2 [M, H], b_2 [H]",
    "phi_v": "position [L, H], W_1 [L, H, M], b_1 [M], W_2 [M, H], b_2 [H]",
    "W_g": "kernel [D, N, 3], bias [N, 3]",
    "W_o": "kernel [N, H, D], bias [D]",
}
_PHI = ("position", "W_1", "b_1", "W_2", "b_2")
_REQUIRED = {name: _PHI if name.startswith("phi") else ("kernel",)
             for name in LAYOUT}
_ALLOWED = {name: set(_PHI) if name.startswith("phi") else {"kernel", "bias"}
            for name in LAYOUT}


class Dims(NamedTuple):
  """The sizes a parameter dict implies."""
  d_model: int  # D
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  block: int  # L, the compression's block length
  compress_hidden: int  # M, the compression MLP's hidden width


class Config(NamedTuple):
  """The static settings of one NSA layer, checked (``check_config``)."""
  block: int  # l
  stride: int  # d
  select_block: int  # l'
  top_n: int  # n, blocks kept per query (the first and local ones included)
  window: int  # w
  local_blocks: int  # the block holding t and local_blocks - 1 before it


def check_config(block, stride, select_block, top_n, window,
                 local_blocks) -> Config:
  """Validates NSA's block sizes and counts (see ``nsa_attention``).

  Raises:
    TypeError: a size that is not a Python int.
    ValueError: a size below 1; ``stride`` above ``block`` or not dividing
      it; ``select_block`` not a multiple of ``stride``; ``top_n`` below
      ``1 + local_blocks`` (the blocks every query keeps).
  """
  check_blocks(block, stride, select_block)
  for name, value in (("top_n", top_n), ("window", window),
                      ("local_blocks", local_blocks)):
    checks.check_positive_int(name, value)
  if top_n < 1 + local_blocks:
    raise ValueError(
        f"top_n={top_n} must be at least 1 + local_blocks = "
        f"{1 + local_blocks}: every query keeps the first block and its "
        f"local_blocks={local_blocks} local ones, and top_n counts them "
        "(the paper: n = 16 with 1 first and 2 local blocks).")
  return Config(block, stride, select_block, top_n, window, local_blocks)


def check_blocks(block, stride, select_block) -> None:
  """``block``, ``stride``, ``select_block`` positive ints with ``stride``
  dividing the other two (a ValueError naming the one to change)."""
  for name, value in (("block", block), ("stride", stride),
                      ("select_block", select_block)):
    checks.check_positive_int(name, value)
  if stride > block or block % stride:
    raise ValueError(
        f"stride={stride} must divide block={block} (d <= l, d | l: a "
        "compressed block is a whole number of strides, as eq. 9's sum over "
        f"strides assumes); e.g. stride={math.gcd(block, stride)} or "
        f"block={-(-block // stride) * stride}.")
  if select_block % stride:
    raise ValueError(
        f"select_block={select_block} must be a multiple of stride={stride} "
        "(l' = m d: a selection block is a whole number of strides, so the "
        "compressed blocks' importance maps onto it); e.g. select_block="
        f"{-(-select_block // stride) * stride}.")


def init_nsa_params(key: jax.Array, d_model: int, num_heads: int,
                    num_kv_heads: int, head_dim: int, *, block: int,
                    stride: int, select_block: int,
                    compress_hidden: int | None = None,
                    use_bias: bool = False,
                    dtype: jnp.dtype = jnp.float32) -> Params:
  """Initialises an NSA layer's parameters.

  Projection kernels are LeCun-normal, drawn on their flat 2-D shape
  (``[D, N*H]``, ``[N*H, D]``; fan-in ``D`` and ``N*H``) as flax's
  ``LinearGeneral`` draws them. ``phi_k``/``phi_v``: ``W_1`` and ``W_2``
  LeCun-normal (fan-in ``L*H`` and ``M``), ``b_1``, ``b_2`` and the
  ``position`` table zero. The gates' kernel is drawn as ``W_q``'s and
  their bias is zero (every gate starts near 0.5).

  Args:
    key: ``jax.random.key``.
    d_model: ``D``.
    num_heads: ``N``.
    num_kv_heads: ``K``, dividing ``N``.
    head_dim: ``H``.
    block: ``l``: sets ``phi``'s ``[L, H]`` position table and ``W_1``.
    stride, select_block: ``d`` and ``l'``; they shape no parameter and are
      checked here (``d | l``, ``d | l'``) so that a layer the forward would
      refuse is refused when built.
    compress_hidden: ``M``, the compression MLP's hidden width; None means
      ``H``.
    use_bias: biases in ``W_q``, the six key/value projections and ``W_o``.
    dtype: parameter dtype.

  Returns:
    ``{"W_q": {"kernel": [D, N, H]}, "W_k_cmp", "W_v_cmp", "W_k_slc",
    "W_v_slc", "W_k_win", "W_v_win": {"kernel": [D, K, H]}, "phi_k",
    "phi_v": {"position": [L, H], "W_1": [L, H, M], "b_1": [M], "W_2": [M,
    H], "b_2": [H]},
    "W_g": {"kernel": [D, N, 3], "bias": [N, 3]}, "W_o": {"kernel": [N, H,
    D]}}``, with ``"bias"`` (``[N, H]``, ``[K, H]``, ``[D]``) in the
    projections when ``use_bias``.

  Example:
    >>> p = init_nsa_params(jax.random.key(0), 16, 4, 2, 8, block=4,
    ...                     stride=2, select_block=4)
    >>> p["W_k_slc"]["kernel"].shape, p["phi_k"]["W_1"].shape
    ((16, 2, 8), (4, 8, 8))
  """
  for name, value in (("d_model", d_model), ("num_heads", num_heads),
                      ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
    checks.check_positive_int(name, value)
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} must be divisible by "
                     f"num_kv_heads={num_kv_heads} (each key/value head "
                     "serves a group of N / K query heads).")
  checks.check_static_bool("use_bias", use_bias)
  check_blocks(block, stride, select_block)
  m = head_dim if compress_hidden is None else compress_hidden
  checks.check_positive_int("compress_hidden", m)
  d, n, k, h = d_model, num_heads, num_kv_heads, head_dim
  init = jax.nn.initializers.lecun_normal()
  shapes = {"W_q": ((d, n, h), (n, h)),
            **{f"W_{kv}_{b}": ((d, k, h), (k, h))
               for b in BRANCHES for kv in "kv"},
            "W_g": ((d, n, 3), (n, 3)),
            "W_o": ((n, h, d), (d,))}
  keys = jax.random.split(key, len(shapes) + 4)
  params = {}
  for key_i, (name, (shape, bias_shape)) in zip(keys, shapes.items()):
    fan_in = n * h if name == "W_o" else d
    flat = (fan_in, math.prod(shape) // fan_in)  # LinearGeneral's 2-D draw
    params[name] = {"kernel": init(key_i, flat, dtype).reshape(shape)}
    if use_bias or name == "W_g":
      params[name]["bias"] = jnp.zeros(bias_shape, dtype)
  phi_keys = keys[len(shapes):]
  for i, name in enumerate(("phi_k", "phi_v")):
    params[name] = {
        "position": jnp.zeros((block, h), dtype),
        "W_1": init(phi_keys[2 * i], (block * h, m), dtype).reshape(
            block, h, m),
        "b_1": jnp.zeros((m,), dtype),
        "W_2": init(phi_keys[2 * i + 1], (m, h), dtype),
        "b_2": jnp.zeros((h,), dtype)}
  return params


def _wrong(name: str, entry: str, got, want: str) -> ValueError:
  return ValueError(f"params['{name}']['{entry}'] has shape {tuple(got)}; "
                    f"expected {want} ({LAYOUT[name]}).")


def nsa_dims(params: Mapping[str, Any]) -> Dims:
  """Validates an NSA parameter dict and reads its sizes.

  Raises:
    TypeError: ``params`` not a dict, or a non-float entry.
    ValueError: a missing or unknown entry, or a shape that disagrees with
      the layout (``LAYOUT``) or with the others, naming it.
  """
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a dict (init_nsa_params's layout), got "
                    f"{type(params).__name__}.")
  if set(params) != set(LAYOUT):
    raise ValueError(
        f"params has entries {sorted(params)}; an NSA layer's are "
        f"{sorted(LAYOUT)} (missing {sorted(set(LAYOUT) - set(params))}, "
        f"unknown {sorted(set(params) - set(LAYOUT))}).")
  for name in LAYOUT:
    layer = params[name]
    if (not isinstance(layer, Mapping) or not set(_REQUIRED[name]) <= set(
        layer) or not set(layer) <= _ALLOWED[name]):
      got = (sorted(layer) if isinstance(layer, Mapping)
             else type(layer).__name__)
      raise ValueError(f"params['{name}'] must be a dict with "
                       f"{LAYOUT[name]} (bias optional), got {got}.")
    for entry, value in layer.items():
      checks.check_float_array(f"params['{name}']['{entry}']", value)

  def shape(name, entry):
    return checks.shape_of(params[name][entry])

  wq, wk, pos = (shape("W_q", "kernel"), shape("W_k_cmp", "kernel"),
                 shape("phi_k", "position"))
  if len(wq) != 3 or 0 in wq:
    raise _wrong("W_q", "kernel", wq, "[D, N, H], none of them 0")
  d, n, h = wq
  if len(wk) != 3 or wk[1] == 0 or n % wk[1]:
    raise _wrong("W_k_cmp", "kernel", wk,
                 f"[D, K, H] with D={d}, H={h} and K dividing N={n}")
  k = wk[1]
  if len(pos) != 2 or pos[0] == 0:
    raise _wrong("phi_k", "position", pos, f"[L, H] with L >= 1, H={h}")
  block = pos[0]
  w1 = shape("phi_k", "W_1")
  if len(w1) != 3 or w1[:2] != (block, h) or w1[2] == 0:
    raise _wrong("phi_k", "W_1", w1, f"[L, H, M] with L={block}, H={h}, "
                 "M >= 1")
  m = w1[2]
  want = {"W_q": {"kernel": (d, n, h), "bias": (n, h)},
          **{f"W_{kv}_{b}": {"kernel": (d, k, h), "bias": (k, h)}
             for b in BRANCHES for kv in "kv"},
          **{name: {"position": (block, h), "W_1": (block, h, m),
                    "b_1": (m,), "W_2": (m, h), "b_2": (h,)}
             for name in ("phi_k", "phi_v")},
          "W_g": {"kernel": (d, n, 3), "bias": (n, 3)},
          "W_o": {"kernel": (n, h, d), "bias": (d,)}}
  for name, entries in want.items():
    for entry, expected in entries.items():
      if entry in params[name] and shape(name, entry) != expected:
        raise _wrong(name, entry, shape(name, entry),
                     f"{expected} with D={d}, N={n}, K={k}, H={h}, "
                     f"L={block}, M={m}")
  return Dims(d, n, k, h, block, m)


def _project(x, layer, spec: str, dtype):
  """``x @ kernel + bias`` by the einsum ``spec``, in ``dtype``; a per-head
  bias (``[N, H]``) meets a per-head output (``[B, N, T, H]``) at its
  head axis."""
  out = jnp.einsum(spec, x, layer["kernel"].astype(dtype))
  if "bias" in layer:
    bias = layer["bias"].astype(dtype)
    if bias.ndim == 2:  # [N, H] -> [1, N, 1, H]
      bias = bias[:, None, :]
    out = out + _lead(bias, out.ndim)
  return out


def _lead(a, rank: int):
  """``a`` with leading size-1 axes up to ``rank`` (broadcasting spelled
  out: the library runs under ``jax_numpy_rank_promotion="raise"``)."""
  return jnp.reshape(a, (1,) * (rank - jnp.ndim(a)) + jnp.shape(a))


def compress(phi, keys, *, block: int, stride: int):
  """The compressed keys (or values) of every whole block.

  Args:
    phi: ``{"position": [L, H], "W_1": [L, H, M], "b_1": [M], "W_2": [M,
      E], "b_2": [E]}``.
    keys: ``[B, K, T, H]``.
    block, stride: ``l`` and ``d``.

  Returns:
    ``[B, K, C, E]``: block ``i`` is ``phi(keys[..., i d : i d + l, :])``;
    ``C = floor((T - l) / d) + 1`` (0 when ``T < l``: no whole block).
  """
  t = keys.shape[-2]
  c = (t - block) // stride + 1 if t >= block else 0
  dtype = keys.dtype
  if c == 0:
    return jnp.zeros(keys.shape[:2] + (0, phi["W_2"].shape[-1]), dtype)
  w = {name: value.astype(dtype) for name, value in phi.items()}
  index = np.arange(c)[:, None] * stride + np.arange(block)  # [C, L]
  blocks = keys[:, :, index, :] + _lead(w["position"], 5)  # [B, K, C, L, H]
  hidden = jax.nn.gelu(jnp.einsum("BKCLH,LHM->BKCM", blocks, w["W_1"])
                       + _lead(w["b_1"], 4), approximate=False)  # [B, K, C, M]
  return (jnp.einsum("BKCM,ME->BKCE", hidden, w["W_2"])
          + _lead(w["b_2"], 4))


def compressed_attention(q, k_cmp, v_cmp, *, block: int, stride: int,
                         scale: float):
  """The compressed branch: ``(output [B, N, T, H], p_cmp [B, N, T, C])``.

  Query ``t`` reads compressed block ``i`` when ``i d + l - 1 <= t``; a
  query that reads none gets output 0 and probabilities 0
  (``masked_softmax``'s policy for an empty row).
  """
  b, n, t, _ = q.shape
  kk, c = k_cmp.shape[1], k_cmp.shape[2]
  if c == 0:
    return jnp.zeros_like(q), jnp.zeros((b, n, t, 0), q.dtype)
  g = n // kk
  qg = q.reshape(b, kk, g, t, q.shape[-1])  # [B, K, G, T, H]
  logits = jnp.einsum("BKGTH,BKCH->BKGTC", qg, k_cmp) * scale
  # Built from iotas on device: a [T, C] NumPy constant would be baked
  # into the program (T C bytes: 256 MB at T = 64k, d = 16).
  ends = jnp.arange(c) * stride + block - 1  # each block's last token
  visible = ends[None, :] <= jnp.arange(t)[:, None]  # [T, C]
  p = softmax.masked_softmax(logits, _lead(visible, 5))  # [B, K, G, T, C]
  out = jnp.einsum("BKGTC,BKCH->BKGTH", p, v_cmp)
  return out.reshape(q.shape), p.reshape(b, n, t, c)


def block_importance(p_cmp, *, num_kv_heads: int, block: int, stride: int,
                     select_block: int, num_blocks: int):
  """Eqs. 9-10: each selection block's importance ``[B, K, T, J]``.

  ``sum_i w[i, j] p_cmp[t, i]`` summed over the query heads of each
  group, ``w[i, j]`` the strides of compressed block ``i`` (strides ``i``
  to ``i + l/d - 1``) inside selection block ``j`` (strides ``j l'/d`` to
  ``(j + 1) l'/d - 1``): per stride ``s`` the sum of the compressed
  blocks holding it, then per selection block the sum of its strides
  (``O(T C)``, no ``[C, J]`` table).
  """
  b, n, t, c = p_cmp.shape
  per_block = select_block // stride  # strides per selection block
  span = block // stride  # strides per compressed block
  strides = num_blocks * per_block
  p = p_cmp.reshape(b, num_kv_heads, n // num_kv_heads, t, c).sum(2)
  # [B, K, T, C] -> per stride s: sum of p[s - m], m < span (eq. 9's n).
  p = jnp.pad(p, [(0, 0)] * 3 + [(span - 1, strides - c)])
  per_stride = sum(p[..., span - 1 - m: span - 1 - m + strides]
                   for m in range(span))  # [B, K, T, J * l'/d]
  return per_stride.reshape(b, num_kv_heads, t, num_blocks,
                            per_block).sum(-1)  # [B, K, T, J]


def choose_blocks(importance, *, select_block: int, top_n: int,
                  local_blocks: int):
  """Eq. 11: the blocks each query reads, bool ``[B, K, T, J]``.

  The first block and the ``local_blocks`` blocks ending with the one
  holding ``t`` always, then the most important others (ties to the lower
  block), ``top_n`` in all; never a block after ``t``'s. Not
  differentiated.
  """
  t, j = importance.shape[-2:]
  own = jnp.arange(t)[:, None] // select_block  # [T, 1] (iotas: see above)
  blocks = jnp.arange(j)[None, :]  # [1, J]
  forced = (blocks == 0) | ((blocks <= own) & (blocks > own - local_blocks))
  scores = jax.lax.stop_gradient(importance)
  rank = jnp.ndim(importance)
  scores = jnp.where(_lead(forced, rank), jnp.inf, scores)
  scores = jnp.where(_lead(blocks > own, rank), -jnp.inf,
                     scores)  # [B, K, T, J]
  return selection.top_k_mask(scores, top_n)


def nsa_attention(
    params: Params,
    x: ArrayLike,
    *,
    block: int,
    stride: int,
    select_block: int,
    top_n: int,
    window: int,
    local_blocks: int = 2,
    rope: rope_lib.Rope | None = None,
    implementation: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_branches: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
  """Native sparse attention: causal self-attention over ``x``.

  Args:
    params: ``init_nsa_params``'s layout (sizes read from it).
    x: float ``[B, T, D]``.
    block: ``l``, the tokens of a compressed block (``phi``'s ``L``).
    stride: ``d``, the step between compressed blocks; divides ``block``.
    select_block: ``l'``, the tokens of a selection block; a multiple of
      ``stride``.
    top_n: ``n``, the selection blocks each query reads, the first and
      local ones included (fewer where fewer lie at or before it).
    window: ``w``, the sliding window's tokens (``t - w + 1 .. t``).
    local_blocks: the local blocks every query keeps: the one holding
      ``t`` and the ``local_blocks - 1`` before it (the paper's 2).
    rope: an ``aj.Rope`` rotating queries and every branch's keys at
      positions ``0..T-1`` (the compressed branch's before compression),
      or None (the default: no rotary).
    implementation: the kernel of the selected and sliding branches (any
      ``aj.scaled_dot_product_attention`` choice: ``"dense"`` evaluates
      the selection exactly, ``"flash"`` walks only the chosen blocks, at
      the selection's blocks ``block_q``, ``block_k``; a kernel given its
      own blocks, ``aj.kernels.Flash(bq, bk)``, must name the same). The
      compressed branch is always a dense ``[B, N, T, C]`` attention
      computed here.
    block_q, block_k: the selection's blocks for the blockwise kernels
      (``aj.select_blocks``'): query rows walked together (default 64)
      and the key block, a divisor of ``select_block`` (default
      ``select_block``); both clipped to ``T``.
    return_branches: also return a dict of the parts: ``"cmp"``,
      ``"slc"``, ``"win"`` (each branch's output ``[B, N, T, H]``, before
      the gates), ``"gates"`` ``[B, N, T, 3]`` (cmp, slc, win),
      ``"importance"`` ``[B, K, T, J]`` and ``"chosen"`` bool ``[B, K, T,
      J]`` (one selection per key/value head, shared by its ``G`` query
      heads).

  Returns:
    ``[B, T, D]`` in ``x``'s dtype (computed in float32, float64 for
    float64 inputs), and the dict with ``return_branches``.

  Gradients reach every parameter; the selection itself (which blocks)
  is not differentiated (see the module docstring).

  Raises:
    ValueError / TypeError: bad sizes (``check_config``), params
      (``nsa_dims``), ``block`` different from ``phi``'s ``L``, ``x`` not
      float ``[B, T, D]``.

  Example:
    >>> p = init_nsa_params(jax.random.key(0), 16, 4, 2, 8, block=4,
    ...                     stride=2, select_block=4)
    >>> y = nsa_attention(p, jnp.ones((1, 12, 16)), block=4, stride=2,
    ...                   select_block=4, top_n=3, window=4)
    >>> y.shape
    (1, 12, 16)
  """
  config = check_config(block, stride, select_block, top_n, window,
                        local_blocks)
  checks.check_static_bool("return_branches", return_branches)
  rope = rope_lib.as_rope(rope)
  dims = nsa_dims(params)
  if dims.block != block:
    raise ValueError(
        f"block={block} but params['phi_k']['position'] has shape "
        f"{checks.shape_of(params['phi_k']['position'])}: its compression "
        f"was built for block={dims.block}; pass block={dims.block} or "
        "params built for this block.")
  x = checks.as_array_operand("x", x, "[B, T, D]")
  checks.check_float_array("x", x)
  checks.check_rank("x", x, (3,), "[B, T, D]")
  if checks.shape_of(x)[-1] != dims.d_model:
    raise ValueError(f"x has {checks.shape_of(x)[-1]} features (shape "
                     f"{checks.shape_of(x)}), but params['W_q']['kernel'] "
                     f"is [D, N, H] with D={dims.d_model}.")
  dtype = checks.compute_dtype(x, *jax.tree.leaves(params))
  xc = jnp.asarray(x, dtype)
  t = xc.shape[1]
  n, kk, h = dims.num_heads, dims.num_kv_heads, dims.head_dim
  scale = 1.0 / math.sqrt(h)
  q = _project(xc, params["W_q"], "BTD,DNH->BNTH", dtype)  # [B, N, T, H]
  kv = {name: _project(xc, params[name], "BTD,DKH->BKTH", dtype)
        for name in params if name[:3] in ("W_k", "W_v")}  # [B, K, T, H]
  if rope is not None:
    positions = jnp.arange(t)
    q = rope_lib.apply_rope(q, positions, rope=rope)
    for b in BRANCHES:
      kv[f"W_k_{b}"] = rope_lib.apply_rope(kv[f"W_k_{b}"], positions,
                                           rope=rope)

  # Compressed branch: [B, K, C, H] keys and values, a dense attention.
  k_cmp = compress(params["phi_k"], kv["W_k_cmp"], block=block, stride=stride)
  v_cmp = compress(params["phi_v"], kv["W_v_cmp"], block=block, stride=stride)
  o_cmp, p_cmp = compressed_attention(q, k_cmp, v_cmp, block=block,
                                      stride=stride, scale=scale)

  # Selected branch: the blocks each (b, kv head, query) reads.
  num_blocks = -(-t // select_block)  # J
  importance = block_importance(
      jax.lax.stop_gradient(p_cmp), num_kv_heads=kk, block=block,
      stride=stride, select_block=select_block, num_blocks=num_blocks)
  chosen = choose_blocks(importance, select_block=select_block, top_n=top_n,
                         local_blocks=config.local_blocks)  # [B, K, T, J]
  selected = selection.select_blocks(
      chosen, q_len=t, kv_len=t, key_block=select_block, query_block=1,
      group=n // kk, block_q=block_q, block_k=block_k)
  o_slc = dot_product.scaled_dot_product_attention(
      q, kv["W_k_slc"], kv["W_v_slc"], Mask(causal=True, rule=selected),
      scale=scale, implementation=implementation)  # [B, N, T, H]

  # Sliding branch: the last `window` tokens.
  o_win = dot_product.scaled_dot_product_attention(
      q, kv["W_k_win"], kv["W_v_win"],
      Mask(causal=True, window=(window - 1, 0)), scale=scale,
      implementation=implementation)  # [B, N, T, H]

  gates = jax.nn.sigmoid(_project(xc, params["W_g"], "BTD,DNR->BNTR",
                                  dtype))  # [B, N, T, 3]
  branches = jnp.stack([o_cmp, o_slc.astype(dtype), o_win.astype(dtype)],
                       -1)  # [B, N, T, H, 3]
  mixed = jnp.einsum("BNTHR,BNTR->BNTH", branches, gates)
  out = _project(mixed, params["W_o"], "BNTH,NHD->BTD", dtype).astype(
      jnp.result_type(x))  # [B, T, D]
  if not return_branches:
    return out
  return out, {"cmp": o_cmp, "slc": o_slc, "win": o_win, "gates": gates,
               "importance": importance, "chosen": chosen}
