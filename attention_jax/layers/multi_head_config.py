"""A multi-head layer's configuration: its static options, validated once.

Shape glossary: N query heads, K key/value heads, H head dim, D model
(query) dim, Dkv key/value features, Dout output features, R T5 buckets.

``Config`` holds what a layer is, besides its parameters and the arrays of
a call: the sizes, the attention function, the scale, the positions and
norms of the heads (queries and keys, values, the output), the clipping of
the projections, where the heads live on a mesh. It is the one place
these options are described. ``configure`` validates them once:
``aj.MultiHeadAttention`` when it is built, ``aj.multi_head_attention`` at
each call (a pure function keeps nothing), with ``configure_params`` also
checking them against the params. The steps of ``layers.multi_head`` then
read them without checking again.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.layers import attention_fn as attention_fn_lib
from attention_jax.layers import multi_head_params
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.layers import sharding
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import score_mods


@dataclasses.dataclass(frozen=True, eq=False)
class Config:
  """A multi-head layer's static options (build it with ``configure``).

  Attributes:
    dims: ``HeadDims``: N, K, H, D, Dkv, Dout, qk-norm weights, output gate
      (``param_dims`` reads them off a params dict).
    attention_fn: what attends the heads, a function of the protocol of
      ``layers/attention_fn.py`` (``attention_fn(q, k, v, mask,
      **options)``), e.g. ``aj.blockwise_attention`` or
      ``aj.SequenceParallel("seq")``; given as a kernel choice (None:
      automatic, ``"dense"``, ``"flash"``, ``"cudnn"``, an ``aj.kernels``
      kernel, a list), an ``attention_fn.Implementation``.
    scale: the multiplier of ``q . k``, a positive number; None: the
      attention function's default (``1 / sqrt(H)``). Gemma 2 uses
      ``query_pre_attn_scalar ** -0.5``. Decoding honours it.
    t5_bias: an ``aj.T5Bias``: how distances fall into the ``R`` buckets of
      the learned T5 table (``params["t5_bias"]["table"] [R, N]``), added
      before the layer's score modifier (decoding uses absolute positions).
    rope: an ``aj.Rope`` (base, scaling, partial rotary, layout, multimodal
      sections) rotating the projected queries and keys, or None; where the
      tokens stand is ``layers.positions``' (the call's ``positions``, the
      cache's, per document with segment ids). Not with a projected memory.
    qk_norm: an ``aj.QKNorm`` normalising the projected queries and keys
      (RMS or layer norm, per head or over all heads, weights ``[H]`` /
      per head / none, epsilon, ``1 + w``, before or after ``rope``), with
      the params' ``q_norm``/``k_norm`` as weights (and biases, with
      ``bias=True``: Phi-2's LayerNorm); or None.
    clip_qkv: ``c``: the projected queries, keys and values (biases
      included) clipped to ``[-c, c]`` before any norm or rotary (OLMo,
      OLMoE, DBRX); a memory's keys and values are clipped in
      ``project_memory``, which records it. A positive finite number, or
      None.
    value_norm: an ``aj.QKNorm`` normalising the values of each key/value
      head before attention (and before a cache stores them), weights
      ``v_norm`` (``[H]`` or ``[K, H]``; Gemma 3n's is weightless, RMS over
      ``H``); not ``after_rope``. A memory's values are normalised in
      ``project_memory``. Or None.
    output_norm: an ``aj.QKNorm`` normalising the attention output ``[B,
      N, T, H]`` before the output gate and ``W_o``, weights ``o_norm``
      (BitNet's ``attn_sub_norm``: ``QKNorm(over="all",
      weight="per_head")``, ``[N, H]``); not ``after_rope``. Or None.
    precision: ``jax.lax.Precision`` (or None) of the projection einsums
      (``W_q``, ``W_k``, ``W_v``, ``W_g``, ``W_o``); attention runs at its
      function's precision.
    head_axis: a mesh axis the heads are split over (tensor parallelism):
      the projected heads are constrained to it, attention runs on each
      device's heads, and only ``W_o``'s partial products are summed (one
      all-reduce). ``N`` and ``K`` must divide its size.
    batch_axis: the mesh axes the batch is split over (a name, a tuple,
      ``()`` for none), for a kernel choice's ``partition``. None: with
      ``head_axis``, the mesh's other non-manual axes when the product of
      their sizes divides ``B`` (``data`` of a ``data x model`` mesh).
    widths: where ``D`` and ``Dkv`` were read from, ending the messages that
      refuse an input of another width.
    source: the module attributes this was built from (a module rebuilds
      its ``Config`` when one of them is reassigned).
  """
  dims: multi_head_params.HeadDims
  attention_fn: attention_fn_lib.AttentionFn
  scale: float | None = None
  t5_bias: score_mods.T5Bias | None = None
  rope: rope_lib.Rope | None = None
  qk_norm: qk_norm_lib.QKNorm | None = None
  clip_qkv: float | None = None
  value_norm: qk_norm_lib.QKNorm | None = None
  output_norm: qk_norm_lib.QKNorm | None = None
  precision: Any = None
  head_axis: str | None = None
  batch_axis: str | tuple[str, ...] | None = None
  widths: tuple[str, str] = ("", "")
  source: tuple[Any, ...] = ()


def static_scale(scale: Any) -> float | None:
  """A module's ``scale`` as a Python float (None stays None), checked.

  A concrete float scalar array (``jnp.float32(0.5)``, a 0-d NumPy array,
  a NumPy float) becomes its Python float, as
  ``aj.scaled_dot_product_attention`` accepts it; a traced one is refused:
  a module's scale is static configuration, fixed when it is built, and a
  learned scale belongs in its params (or in the queries). The function
  ``aj.multi_head_attention`` passes its ``scale`` to the attention call
  instead, which takes a traced one too.

  Raises:
    TypeError: a traced value, an array that is not a float scalar, or not
      a number.
    ValueError: not positive and finite (``checks.check_scale``).

  Example:
    >>> static_scale(jnp.float32(0.5)), static_scale(None)
    (0.5, None)
  """
  if isinstance(scale, (jax.Array, np.ndarray, np.generic)) and not isinstance(
      scale, (np.bool_, np.integer)):
    dtype, shape = jnp.result_type(scale), checks.shape_of(scale)
    if not jnp.issubdtype(dtype, jnp.floating) or shape:
      raise TypeError(
          f"scale must be a positive number or a float scalar array (shape "
          f"()), got an array of dtype {dtype} with shape {shape}: a "
          "module's scale is one multiplier of q . k for every head.")
    try:
      scale = float(np.asarray(scale))
    except jax.errors.TracerArrayConversionError:
      raise TypeError(
          "scale is a traced value: a module's scale is static "
          "configuration, fixed when it is built. Build the module outside "
          "jax.jit with a concrete scale (a Python float or a concrete "
          "scalar array), or keep a learned scale in the params and fold "
          "it into the queries (aj.multi_head_attention and "
          "aj.scaled_dot_product_attention take a traced scale per "
          "call).") from None
  checks.check_scale(scale)
  return scale


def check_clip_qkv(clip_qkv: Any) -> float | None:
  """``clip_qkv`` as a Python float (None stays None), checked.

  Example:
    >>> check_clip_qkv(8), check_clip_qkv(None)
    (8.0, None)
  """
  if clip_qkv is None:
    return None
  if isinstance(clip_qkv, (bool, np.bool_)) or not isinstance(
      clip_qkv, numbers.Real):
    raise TypeError(
        f"clip_qkv must be None or a positive finite Python number (q, k "
        f"and v are clipped to [-clip_qkv, clip_qkv], e.g. OLMo's 8.0), got "
        f"{clip_qkv!r} ({type(clip_qkv).__name__}).")
  value = float(clip_qkv)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(
        f"clip_qkv must be a positive finite number (q, k and v are clipped "
        f"to [-clip_qkv, clip_qkv]), got {clip_qkv!r}: pass the model's "
        "clip_qkv, or None for no clipping.")
  return value


def configure(dims: multi_head_params.HeadDims, *, attention_fn: Any = None,
              scale: float | None = None,
              t5_bias: score_mods.T5Bias | None = None,
              rope: rope_lib.Rope | None = None,
              qk_norm: qk_norm_lib.QKNorm | bool | None = None,
              clip_qkv: float | None = None,
              value_norm: qk_norm_lib.QKNorm | None = None,
              output_norm: qk_norm_lib.QKNorm | None = None,
              precision: Any = None, head_axis: str | None = None,
              batch_axis: Any = None,
              widths: tuple[str, str] | None = None,
              source: tuple[Any, ...] = ()) -> Config:
  """A ``Config`` of layer sizes ``dims``, every option validated.

  ``scale`` is checked where it is given to a module (``static_scale``: a
  Python float then) or by the attention function, which may take an
  array (``aj.multi_head_attention``'s, traced ones included).

  Example:
    >>> dims = multi_head_params.check_dims(16, 4)
    >>> configure(dims, rope=aj.Rope()).rope.base
    10000.0
  """
  multi_head_params.check_t5_bias(t5_bias)
  rope = rope_lib.as_rope(rope)
  if rope is not None:  # a rope that does not fit H is refused now
    try:
      rope.inverse_frequencies(
          rope.rotary_dim(dims.head_dim),
          seq_len=1 if rope.scaling == "dynamic" else None)
    except ValueError as e:
      raise ValueError(f"rope does not fit this layer's heads (head dim "
                       f"H={dims.head_dim}): {e}") from None
  if head_axis is not None:
    sharding.check_heads_divide(dims.num_heads, dims.num_kv_heads, head_axis)
  fn = attention_fn_lib.as_attention_fn(attention_fn, scale=scale,
                                        head_axis=head_axis,
                                        batch_axis=batch_axis)
  if widths is None:
    widths = (f"the layer's D is {dims.d_model}",
              f"the layer's Dkv is {dims.kv_features}")
  return Config(
      dims, fn, scale, t5_bias, rope, qk_norm=qk_norm_lib.as_qk_norm(qk_norm),
      clip_qkv=check_clip_qkv(clip_qkv),
      value_norm=qk_norm_lib.as_norm("value_norm", value_norm),
      output_norm=qk_norm_lib.as_norm("output_norm", output_norm),
      precision=precision, head_axis=head_axis, batch_axis=batch_axis,
      widths=widths, source=source)


def check_norms(config: Config, params: multi_head_params.Params) -> None:
  """``config``'s norms find their weights in ``params``
  (``qk_norm.resolve``; a module whose norm option was reassigned)."""
  for option in ("qk_norm", "value_norm", "output_norm"):
    norm = getattr(config, option)
    if qk_norm_lib.resolve(params, norm, option) != norm:  # None: ignored
      raise ValueError(
          f"{option} is None, but the layer's params hold "
          f"{'/'.join(qk_norm_lib.OPTIONS[option][1])}, which it would "
          "ignore: give the norm they were built for.")


def configure_params(params: multi_head_params.Params, *,
                     qk_norm: Any = None, value_norm: Any = None,
                     output_norm: Any = None,
                     t5_bias: score_mods.T5Bias | None = None,
                     score_mod: Any = None, **options) -> Config:
  """``configure`` with the sizes read off ``params`` (``param_dims``) and
  the options checked against them: ``qk_norm``, ``value_norm`` and
  ``output_norm`` against the weights ``q_norm``/``k_norm``, ``v_norm``,
  ``o_norm`` (``qk_norm.resolve``), ``t5_bias`` and ``score_mod`` against a
  T5 table (``check_t5``)."""
  dims = multi_head_params.param_dims(params)
  norm = qk_norm_lib.resolve(params, qk_norm)
  value_norm = qk_norm_lib.resolve(params, value_norm, "value_norm")
  output_norm = qk_norm_lib.resolve(params, output_norm, "output_norm")
  table = params.get("t5_bias", {}).get("table")
  multi_head_params.check_t5(
      None if table is None else multi_head_params.param_shape(
          params, "t5_bias", "table"), t5_bias, score_mod)
  w_q = multi_head_params.param_shape(params, "W_q", "kernel")
  w_k = multi_head_params.param_shape(params, "W_k", "kernel")
  widths = (f"params['W_q']['kernel'] has shape {w_q}: [D, N, H] with "
            f"D={dims.d_model}",
            f"params['W_k']['kernel'] has shape {w_k}: [Dkv, K, H] with "
            f"Dkv={dims.kv_features}. Keys of another width need params "
            "built with that kv_features")
  return configure(dims, qk_norm=norm, value_norm=value_norm,
                   output_norm=output_norm, t5_bias=t5_bias, widths=widths,
                   **options)
