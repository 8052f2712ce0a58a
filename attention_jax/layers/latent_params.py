"""Multi-head latent attention parameters: their layout, initialisation, checks.

Shape glossary: D model dim, N query heads, Dout output features, Rq
``q_lora_rank``, R ``kv_lora_rank`` (the latent width), Hn
``qk_nope_head_dim``, Hr ``qk_rope_head_dim``, Hv ``v_head_dim``.

Parameters (DeepSeek's names, lightly; ``latent_dims`` reads every size
from their shapes):

- ``W_dq``: ``{"kernel": [D, Rq], "bias": [Rq]}``, ``q_norm``: ``{"scale":
  [Rq]}``, ``W_uq``: ``{"kernel": [Rq, N, Hn + Hr]}`` (with a query
  low-rank), or ``W_q``: ``{"kernel": [D, N, Hn + Hr]}`` (without);
- ``W_dkv``: ``{"kernel": [D, R + Hr], "bias": [R + Hr]}``, ``kv_norm``:
  ``{"scale": [R]}``, ``W_ukv``: ``{"kernel": [R, N, Hn + Hv]}``;
- ``W_o``: ``{"kernel": [N, Hv, Dout], "bias": [Dout]}``.

Biases are optional and only where DeepSeek's ``attention_bias`` puts them
(``W_dq``, ``W_dkv``, ``W_o``); the up-projections have none (a bias on
``W_ukv`` could not be folded into the query). Hugging Face's
``DeepseekV3Attention`` weights map as ``W_dq = q_a_proj.weight.T``,
``q_norm = q_a_layernorm.weight``, ``W_uq = q_b_proj.weight.T.reshape(Rq, N,
Hn + Hr)``, ``W_dkv = kv_a_proj_with_mqa.weight.T``, ``kv_norm =
kv_a_layernorm.weight``, ``W_ukv = kv_b_proj.weight.T.reshape(R, N, Hn +
Hv)``, ``W_o = o_proj.weight.T.reshape(N, Hv, Dout)``, with
``rope=aj.Rope(..., interleaved=config.rope_interleave)``.

``latent`` computes with them (``latent_attention``, ``latent_decode``) and
re-exports these names.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.core import checks

Params = dict[str, dict[str, jax.Array]]

# The layout of each parameter, for messages.
LAYOUT = {
    "W_dq": "kernel [D, Rq], bias [Rq]",
    "q_norm": "scale [Rq]",
    "W_uq": "kernel [Rq, N, Hn + Hr]",
    "W_q": "kernel [D, N, Hn + Hr]",
    "W_dkv": "kernel [D, R + Hr], bias [R + Hr]",
    "kv_norm": "scale [R]",
    "W_ukv": "kernel [R, N, Hn + Hv]",
    "W_o": "kernel [N, Hv, Dout], bias [Dout]",
}
BIASED = ("W_dq", "W_dkv", "W_o")  # DeepSeek's attention_bias


class LatentDims(NamedTuple):
  """The sizes an MLA parameter dict implies."""
  d_model: int  # D
  num_heads: int  # N
  q_lora_rank: int | None  # Rq, None: a full-rank W_q
  kv_lora_rank: int  # R
  qk_nope_head_dim: int  # Hn
  qk_rope_head_dim: int  # Hr
  v_head_dim: int  # Hv
  out_features: int  # Dout


def check_latent_dims(d_model: int, num_heads: int, *,
                      q_lora_rank: int | None, kv_lora_rank: int,
                      qk_nope_head_dim: int, qk_rope_head_dim: int,
                      v_head_dim: int,
                      out_features: int | None = None) -> LatentDims:
  """Validates MLA's sizes (positive ints, an even rope head); returns them.

  Example:
    >>> check_latent_dims(32, 4, q_lora_rank=None, kv_lora_rank=16,
    ...                   qk_nope_head_dim=8, qk_rope_head_dim=4,
    ...                   v_head_dim=8).out_features
    32
  """
  for name, value in (("d_model", d_model), ("num_heads", num_heads),
                      ("kv_lora_rank", kv_lora_rank),
                      ("qk_nope_head_dim", qk_nope_head_dim),
                      ("qk_rope_head_dim", qk_rope_head_dim),
                      ("v_head_dim", v_head_dim)):
    checks.check_positive_int(name, value)
  if q_lora_rank is not None:
    checks.check_positive_int("q_lora_rank (None for a full-rank W_q)",
                              q_lora_rank)
  out_features = d_model if out_features is None else out_features
  checks.check_positive_int("out_features", out_features)
  if qk_rope_head_dim % 2:
    raise ValueError(
        f"qk_rope_head_dim must be even (RoPE rotates feature pairs), got "
        f"{qk_rope_head_dim}; DeepSeek-V2/V3 use 64.")
  return LatentDims(d_model, num_heads, q_lora_rank, kv_lora_rank,
                    qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                    out_features)


def init_latent_params(
    rng: jax.Array,
    d_model: int,
    num_heads: int,
    *,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None = None,
    out_features: int | None = None,
    use_bias: bool = False,
    dtype: jnp.dtype = jnp.float32,
) -> Params:
  """Initialises MLA's parameters for ``latent_attention``/``latent_decode``.

  Kernels are LeCun-normal on their flat 2-D shapes (fan-in ``D``, ``Rq``,
  ``R`` and ``N * Hv``), as flax's ``LinearGeneral`` draws them, then
  reshaped per head; biases zero, RMSNorm scales one.

  Args:
    rng: ``jax.random.key``.
    d_model: ``D``.
    num_heads: ``N``.
    kv_lora_rank: ``R``, the cached latent's width (DeepSeek: 512).
    qk_nope_head_dim: ``Hn``, each head's position-free query/key features.
    qk_rope_head_dim: ``Hr``, the rotary features (even; DeepSeek: 64).
    v_head_dim: ``Hv``.
    q_lora_rank: ``Rq``, the query's low rank (DeepSeek-V2: 1536), or None
      for a full-rank ``W_q`` (DeepSeek-V2-Lite).
    out_features: ``Dout``; None means ``D``.
    use_bias: biases on ``W_dq``, ``W_dkv`` and ``W_o`` (DeepSeek's
      ``attention_bias``).
    dtype: parameter dtype.

  Returns:
    The parameter dict of this module's docstring.

  Example:
    >>> p = init_latent_params(jax.random.key(0), 32, 4, q_lora_rank=16,
    ...                        kv_lora_rank=24, qk_nope_head_dim=8,
    ...                        qk_rope_head_dim=4, v_head_dim=8)
    >>> p["W_uq"]["kernel"].shape, p["W_dkv"]["kernel"].shape
    ((16, 4, 12), (32, 28))
  """
  dims = check_latent_dims(
      d_model, num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
      qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
      v_head_dim=v_head_dim, out_features=out_features)
  init = jax.nn.initializers.lecun_normal()
  params = {}
  for i, (name, shape, fan_in) in enumerate(param_shapes(dims)):
    if name.endswith("_norm"):
      params[name] = {"scale": jnp.ones(shape, dtype)}
      continue
    flat = (fan_in, math.prod(shape) // fan_in)
    params[name] = {"kernel": init(jax.random.fold_in(rng, i), flat,
                                   dtype).reshape(shape)}
    if use_bias and name in BIASED:
      params[name]["bias"] = jnp.zeros(flat[1:], dtype)
  return params


def param_shapes(dims: LatentDims) -> list[tuple[str, tuple[int, ...], int]]:
  """``(name, kernel or scale shape, fan-in)`` of each parameter, in order."""
  n, r, hr = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
  hqk = dims.qk_nope_head_dim + hr
  if dims.q_lora_rank is None:
    query = [("W_q", (dims.d_model, n, hqk), dims.d_model)]
  else:
    rq = dims.q_lora_rank
    query = [("W_dq", (dims.d_model, rq), dims.d_model),
             ("q_norm", (rq,), rq), ("W_uq", (rq, n, hqk), rq)]
  return query + [
      ("W_dkv", (dims.d_model, r + hr), dims.d_model),
      ("kv_norm", (r,), r),
      ("W_ukv", (r, n, dims.qk_nope_head_dim + dims.v_head_dim), r),
      ("W_o", (n, dims.v_head_dim, dims.out_features), n * dims.v_head_dim),
  ]


def _entry_shape(params, name: str, entry: str) -> tuple[int, ...]:
  layer = params.get(name)
  if not hasattr(layer, "get") or layer.get(entry) is None:
    raise ValueError(
        f"params['{name}'] must hold '{entry}' ({LAYOUT[name]}); got "
        f"{sorted(layer) if hasattr(layer, 'keys') else layer!r}.")
  return checks.shape_of(layer[entry])


def latent_dims(params: Any) -> LatentDims:
  """The sizes (D, N, Rq, R, Hn, Hr, Hv, Dout) read from the parameters' shapes.

  Raises:
    ValueError: a missing entry, a wrong rank, or shapes that disagree
      (naming both and the layout).

  Example:
    >>> p = jax.eval_shape(lambda: init_latent_params(  # shapes suffice
    ...     jax.random.key(0), 32, 4, kv_lora_rank=24, qk_nope_head_dim=8,
    ...     qk_rope_head_dim=4, v_head_dim=6))
    >>> latent_dims(p).v_head_dim, latent_dims(p).q_lora_rank is None
    (6, True)
  """
  if not hasattr(params, "keys"):
    raise TypeError(f"params must be a dict of MLA parameters (see "
                    f"init_latent_params), got {type(params).__name__}.")
  lora = "W_uq" in params or "W_dq" in params
  query = ("W_dq", "q_norm", "W_uq") if lora else ("W_q",)
  names = query + ("W_dkv", "kv_norm", "W_ukv", "W_o")
  extra = sorted(set(params) - set(names))
  missing = [n for n in names if n not in params]
  if missing or extra:
    raise ValueError(
        f"MLA params need {list(names)} (a query low-rank W_dq/q_norm/W_uq, "
        f"or a full-rank W_q); missing {missing}, unexpected {extra}.")
  shapes = {n: _entry_shape(params, n, "scale" if n.endswith("_norm")
                            else "kernel") for n in names}
  ranks = {"W_dq": 2, "q_norm": 1, "W_uq": 3, "W_q": 3, "W_dkv": 2,
           "kv_norm": 1, "W_ukv": 3, "W_o": 3}
  for n in names:
    if len(shapes[n]) != ranks[n]:
      raise ValueError(f"params['{n}'] must be {LAYOUT[n]} (rank "
                       f"{ranks[n]}), got shape {shapes[n]}.")

  def disagree(what: str, *entries: str):
    listed = ", ".join(f"{e} {shapes[e]} ({LAYOUT[e]})" for e in entries)
    raise ValueError(f"MLA params disagree on {what}: {listed}.")

  d, rkv_hr = shapes["W_dkv"]
  (r,) = shapes["kv_norm"]
  hr = rkv_hr - r
  if hr <= 0 or hr % 2:
    disagree("Hr = width of W_dkv - R (positive and even)", "W_dkv",
             "kv_norm")
  if lora:
    d_q, rq = shapes["W_dq"]
    if d_q != d:
      disagree("D", "W_dq", "W_dkv")
    if shapes["q_norm"] != (rq,) or shapes["W_uq"][0] != rq:
      disagree("Rq", "W_dq", "q_norm", "W_uq")
    _, n, hqk = shapes["W_uq"]
    qname = "W_uq"
  else:
    rq = None
    d_q, n, hqk = shapes["W_q"]
    if d_q != d:
      disagree("D", "W_q", "W_dkv")
    qname = "W_q"
  hn = hqk - hr
  if hn <= 0:
    disagree("Hn = last axis of the query kernel - Hr (positive)", qname,
             "W_dkv", "kv_norm")
  r_up, n_up, hn_hv = shapes["W_ukv"]
  if r_up != r:
    disagree("R", "kv_norm", "W_ukv")
  if n_up != n:
    disagree("N", qname, "W_ukv")
  hv = hn_hv - hn
  n_o, hv_o, dout = shapes["W_o"]
  if hv <= 0 or (n_o, hv_o) != (n, hv):
    disagree("N and Hv = last axis of W_ukv - Hn", qname, "W_ukv", "W_o")
  for name in names:
    bias = params[name].get("bias")
    if bias is None:
      continue
    if name not in BIASED:
      raise ValueError(
          f"params['{name}'] has a bias, which MLA does not take (only "
          f"{list(BIASED)} may, as DeepSeek's attention_bias; an up-"
          "projection bias could not be folded into the query).")
    want = shapes[name][-1:]
    if checks.shape_of(bias) != want:
      raise ValueError(f"params['{name}']['bias'] must have shape {want} "
                       f"({LAYOUT[name]}), got {checks.shape_of(bias)}.")
  return LatentDims(d, n, rq, r, hn, hr, hv, dout)
