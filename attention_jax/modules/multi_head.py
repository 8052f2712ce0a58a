"""``MultiHeadAttention``: the lesson's module in Flax NNX, with a KV cache.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim (``D // N`` unless chosen), D model dim, Dkv
key/value features, Dout output features, L cache capacity, R T5
relative-position buckets.

The module owns its parameters as plain ``nnx.Param``s (``W_q``, ``W_k``,
``W_v``, ``W_o``, each a ``kernel`` and optional ``bias``, with qk-norm
``q_norm``/``k_norm``, each a ``scale``, with an output gate ``W_g``,
learned ``sinks [N]`` and a T5 ``t5_table [R, N]``), laid out per head as
``aj.multi_head_attention``'s params dict (``W_q`` kernel ``[D, N, H]``,
``W_o`` kernel ``[N, H, Dout]``, ``sinks`` logits, ``t5_bias`` table, ...),
and, after ``init_cache``, the cache
variables (a KV cache for causal decoding, or a cross-attention memory
projected once). The maths is ``layers.multi_head.multi_head_attention``
(projection per head, attention of N query heads over K shared KV heads,
``W_o``), the same path for the full call and for cached decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.decoding import cache_step
from attention_jax.decoding import kv_cache
from attention_jax.decoding import paged_cache
from attention_jax.decoding import quantize
from attention_jax.layers import multi_head
from attention_jax.layers import multi_head_params
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.layers import sharding
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask
from attention_jax.modules import _rngs
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import score_mods

_LECUN_NORMAL = nnx.initializers.lecun_normal()  # nnx.Linear's default
_ZEROS = nnx.initializers.zeros_init()


def _reshaped(value, shape: tuple[int, ...]):
  """An initialiser's result reshaped, keeping sharding metadata if any."""
  if isinstance(value, nnx.VariableMetadata):  # from nnx.with_partitioning
    value.raw_value = jnp.reshape(value.raw_value, shape)
    return value
  return jnp.reshape(value, shape)


class Projection(nnx.Module):
  """One projection's parameters: ``kernel [*in, *out]``, ``bias [*out]``.

  Only parameters: ``aj.multi_head_attention`` does the maths. Created as
  flax's ``nnx.LinearGeneral`` creates them: the initialisers see the flat
  2-D shape ``[prod(in), prod(out)]`` (so fan-in is ``prod(in)``) and the
  result is reshaped, kernel first, then bias, each from ``rngs.params()``;
  the same seed gives the same numbers as a Linear layer of the flat shape.
  ``kernel_init``/``bias_init`` may carry sharding (``nnx.with_partitioning``)
  for the final shape.
  """

  def __init__(self, in_features: tuple[int, ...],
               out_features: tuple[int, ...], *, use_bias: bool,
               param_dtype, kernel_init, bias_init, rngs: nnx.Rngs):
    flat = (math.prod(in_features), math.prod(out_features))
    self.kernel = nnx.Param(_reshaped(
        kernel_init(rngs.params(), flat, param_dtype),
        (*in_features, *out_features)))
    self.bias = nnx.data(None)
    if use_bias:
      self.bias = nnx.Param(_reshaped(
          bias_init(rngs.params(), flat[1:], param_dtype), out_features))

  def as_dict(self, dtype=None) -> dict[str, jax.Array]:
    """``{"kernel", "bias"}`` arrays, cast to ``dtype`` if given."""
    out = {"kernel": self.kernel[...]}
    if self.bias is not None:
      out["bias"] = self.bias[...]
    if dtype is not None:
      out = {k: v.astype(dtype) for k, v in out.items()}
    return out


class _Lone:
  """A lone ``nnx.Param`` of the module (``sinks``, ``t5_table``) seen as a
  holder of one entry, as ``assign_params`` and ``params_dict`` see layers."""

  def __init__(self, entry: str, variable: nnx.Param):
    self.entry = entry
    setattr(self, entry, variable)

  def as_dict(self, dtype=None) -> dict[str, jax.Array]:
    """``{entry: value}`` in the parameter's own dtype: sinks and the T5
    table join the float32 logits, never the projections' ``dtype``."""
    del dtype
    return {self.entry: getattr(self, self.entry)[...]}


class NormScale(nnx.Module):
  """The learned ``scale`` of a norm (qk-norm ``[H]`` or ``[N, H]``), the
  identity to start (ones; zeros for a ``1 + w`` norm).

  Only the parameter: ``aj.multi_head_attention`` normalises.
  """

  def __init__(self, head_dim: int, *, param_dtype, heads: int | None = None,
               zeros: bool = False):
    shape = (head_dim,) if heads is None else (heads, head_dim)
    fill = jnp.zeros if zeros else jnp.ones
    self.scale = nnx.Param(fill(shape, param_dtype))  # [H] or [N, H]

  def as_dict(self, dtype=None) -> dict[str, jax.Array]:
    """``{"scale"}``, cast to ``dtype`` if given."""
    scale = self.scale[...]
    return {"scale": scale if dtype is None else scale.astype(dtype)}


def assign_params(layers: Mapping[str, Projection | NormScale],
                  params: Mapping[str, Mapping[str, Any]],
                  layout: Mapping[str, str], *, entries: str,
                  sizes: str) -> None:
  """Assigns ``params`` to a module's parameter holders, after every check.

  The same entries (``layers``' names, each's kernel/bias/scale/logits/
  table) and shapes as the module's, or a ValueError naming the entry, both
  shapes, its ``layout`` and the module's options (``entries``, ``sizes``);
  values are cast to each variable's dtype. Shared by the modules'
  ``load_params``.
  """
  if set(params) != set(layers):
    raise ValueError(f"params has entries {sorted(params)}, but this module "
                     f"has {sorted(layers)} ({entries}).")
  for name, layer in layers.items():
    have = {entry: getattr(layer, entry)
            for entry in ("kernel", "bias", "scale", "logits", "table")
            if getattr(layer, entry, None) is not None}
    if set(params[name]) != set(have):
      raise ValueError(
          f"params['{name}'] has {sorted(params[name])}, but this module's "
          f"{name} has {sorted(have)} (use_bias must match).")
    for entry, variable in have.items():
      got, want = checks.shape_of(params[name][entry]), variable.shape
      if got != tuple(want):
        raise ValueError(
            f"params['{name}']['{entry}'] has shape {got}, but this "
            f"module's is {tuple(want)} ({layout[name]}; {sizes}).")
  for name, layer in layers.items():
    for entry, value in params[name].items():
      variable = getattr(layer, entry)
      variable[...] = jnp.asarray(value, variable.dtype)


class MultiHeadAttention(nnx.Module):
  """Multi-head attention for self-, cross- and causal (cached) attention.

  Args:
    d_model: ``D``, query features (and output features by default).
    num_heads: ``N``; divides ``d_model`` unless ``head_dim`` is given.
    rngs: ``nnx.Rngs`` for parameter init (``params`` stream) and dropout
      (``dropout`` stream, falling back to the default one).
    num_kv_heads: ``K`` key/value heads (grouped-query attention); divides
      ``num_heads``. ``None`` means ``N``; 1 is multi-query attention.
    head_dim: ``H``; ``None`` means ``d_model // num_heads``.
    kv_features: ``Dkv``, the width of keys and values (cross-attention to
      another model's states); ``None`` means ``d_model``.
    out_features: ``Dout``, the output width; ``None`` means ``d_model``.
    normalize_qk: qk-norm of the projected queries and keys: True is
      ``aj.QKNorm()``, an RMSNorm of each head (epsilon ``1e-6``) before
      ``rope`` (Gemma's order) with learned scales ``q_norm`` / ``k_norm``
      ``[H]``; an ``aj.QKNorm`` chooses RMS or layer norm, per head or over
      the whole width, weights shared ``[H]``, per head (``[N, H]``,
      ``[K, H]``) or none, epsilon, ``1 + w``, and before or after
      ``rope`` (OLMo 2, Cohere, Llama 4, Qwen3-Next). Stored as
      ``qk_norm`` (the ``QKNorm`` or None). (flax's
      ``nnx.MultiHeadAttention`` normalises with a bias-free LayerNorm per
      head: ``aj.QKNorm(kind="layer")``.)
    precision: ``jax.lax.Precision`` of the projection einsums (``None``:
      the default).
    dropout_rate: dropout on the attention weights, in ``[0, 1)``.
    deterministic: default for calls; ``True`` disables dropout. ``model.eval()``
      and ``nnx.view(model, deterministic=...)`` set it, as for flax's modules.
    use_bias: biases in the four projections.
    dtype: computation dtype of the projections (``None``: inferred from
      inputs and params). Attention itself runs in float32 for <=32-bit
      inputs.
    param_dtype: parameter dtype.
    kernel_init: initialiser for the four kernels (LeCun normal), called on
      the flat 2-D shapes ``[D, N*H]``, ``[N*H, Dout]`` as flax's
      ``LinearGeneral`` calls it, then reshaped per head.
    bias_init: initialiser for the biases (zeros).
    attention_fn: replacement for ``aj.scaled_dot_product_attention`` with the
      same contract (see ``aj.attend_heads``), or its ``implementation``:
      ``None`` (automatic: dense when weights are returned or the problem is
      small, else cuDNN on GPU or flash), ``"dense"``, ``"flash"``,
      ``"cudnn"``, an ``aj.kernels`` kernel or a list of them.
    head_axis: mesh axis for head (tensor) parallelism, e.g. ``"model"``:
      ``W_q/W_k/W_v`` kernels ``[D, N, H]`` are annotated
      ``(None, head_axis, None)`` (whole heads per device), ``W_o``
      ``[N, H, Dout]`` ``(head_axis, None, None)``, so attention needs no
      communication and ``W_o`` ends in one all-reduce. Build the module under
      ``jax.set_mesh(mesh)`` (flax then shards the parameters as it creates
      them); ``N`` and ``K`` must divide the axis size. The attention
      function gets ``partition=aj.kernels.Partition(batch=batch_axis,
      heads=head_axis)`` when it takes one (an implementation, or a
      function naming ``partition``), so a kernel XLA cannot partition
      (``pallas_gpu``, ``splash``) runs per shard in ``jax.shard_map``
      instead of on all-gathered operands.
    batch_axis: the mesh axes the batch is split over, for that partition
      (a name, a tuple of names, ``()`` for none). None: with
      ``head_axis``, the mesh's other non-manual axes when the product of
      their sizes divides ``B`` (``data`` on a ``data x model`` mesh),
      else none.
    mask: an ``aj.Mask`` every call is intersected with, e.g.
      ``aj.Mask(causal=True, window=(W - 1, 0))`` for a sliding-window
      layer (decoding honours it, and ``init_cache`` can then keep a ring
      buffer of ``W`` slots).
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)``, after
      the other score modifiers (``aj.soft_cap``).
    scale: multiplier of ``q . k``, a positive number; None means
      ``1 / sqrt(head_dim)`` (or ``attention_fn``'s default). Gemma 2 uses
      ``query_pre_attn_scalar ** -0.5``. Decoding honours it.
    attention_sinks: learn one sink logit per head (``sinks``, an
      ``nnx.Param [N]`` initialised to 0) joining every row's softmax
      denominator; ``params_dict()["sinks"]["logits"]``.
    score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` applied in every
      call, e.g. ``aj.alibi(aj.alibi_slopes(num_heads))``; an
      ``aj.ScoreMod``'s arrays are constants of the layer (a learned table is
      an option of its own, e.g. ``t5_bias``).
    t5_bias: an ``aj.T5Bias(num_buckets, max_distance, bidirectional)``:
      learn T5's relative position bias, a ``t5_table`` ``nnx.Param
      [num_buckets, N]`` (initialised normal, std ``d_model ** -0.5``),
      applied before ``score_mod``; decoding uses absolute positions;
      ``params_dict()["t5_bias"]["table"]`` (the function then takes
      ``t5_bias=`` these settings).
    rope: rotary position embeddings on the projected queries and keys:
      an ``aj.Rope`` (base, scaling such as Llama 3's or YaRN, partial
      rotary, interleaved layout) or a base such as ``10000.0`` (the plain
      formula); None for none. Positions are the call's ``positions`` if
      given, else the cache's while decoding, else they restart per
      document with segment ids.
    output_gate: ``"elementwise"`` or ``"headwise"``: a learned sigmoid
      gate computed from the query input, ``sigmoid(query @ W_g + b)``,
      multiplied into each head's attention output before ``W_o`` (Qiu et
      al. 2025, "Gated Attention for Large Language Models"; Qwen3-Next
      uses the elementwise one). ``W_g`` is ``[D, N, H]`` (elementwise) or
      ``[D, N, 1]`` (headwise), drawn with ``kernel_init`` like ``W_q``,
      with a zero bias (if ``use_bias``): a new layer's gate starts around
      0.5, as the paper trains it, not as a pass-through of the ungated
      layer.

  Example:
    >>> mha = MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 5, 16))
    >>> mha(x).shape                                   # self-attention
    (2, 5, 16)
    >>> out, w = mha(x, jnp.ones((2, 7, 16)), return_weights=True)  # cross
    >>> w.shape
    (2, 4, 5, 7)
    >>> mha.init_cache(batch_size=2, max_length=8)     # causal decoding
    >>> prompt = mha(x, decode=True)                   # prefill 5 tokens
    >>> step = mha(jnp.ones((2, 1, 16)), decode=True)  # then one at a time
    >>> mha.cache_index[...]                           # per example
    Array([6, 6], dtype=int32)
    >>> mha.W_q.kernel.shape, mha.W_o.kernel.shape     # [D, N, H], [N, H, D]
    ((16, 4, 4), (4, 4, 16))
  """

  def __init__(
      self,
      d_model: int,
      num_heads: int,
      *,
      rngs: nnx.Rngs,
      num_kv_heads: int | None = None,
      head_dim: int | None = None,
      kv_features: int | None = None,
      out_features: int | None = None,
      normalize_qk: bool | qk_norm_lib.QKNorm = False,
      precision: multi_head.Precision = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      use_bias: bool = True,
      dtype: jnp.dtype | None = None,
      param_dtype: jnp.dtype = jnp.float32,
      kernel_init: nnx.Initializer = _LECUN_NORMAL,
      bias_init: nnx.Initializer = _ZEROS,
      attention_fn: multi_head.AttentionFn | Any = None,
      head_axis: str | None = None,
      batch_axis: str | tuple[str, ...] | None = None,
      mask: Mask | None = None,
      logits_soft_cap: float | None = None,
      scale: float | None = None,
      attention_sinks: bool = False,
      score_mod: Any = None,
      t5_bias: score_mods.T5Bias | None = None,
      rope: rope_lib.Rope | float | None = None,
      output_gate: str | None = None,
  ):
    dims = multi_head_params.check_dims(
        d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        kv_features=kv_features, out_features=out_features)
    num_kv_heads = dims.num_kv_heads
    if (head_axis and nnx.using_eager_sharding()
        and sharding.mesh_axis_size(head_axis) is None):
      raise ValueError(
          f"head_axis={head_axis!r} shards the parameters as they are "
          "created, which needs a mesh with that axis: build the module "
          "under `with jax.set_mesh(mesh):` (mesh axes: "
          f"{jax.sharding.get_abstract_mesh().axis_names or 'none'}).")
    sharding.check_heads_divide(num_heads, num_kv_heads, head_axis)
    checks.check_dropout_rate(dropout_rate)
    self.d_model = d_model
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim = dims.head_dim
    self.kv_features = dims.kv_features
    self.out_features = dims.out_features
    self.qk_norm = qk_norm_lib.as_qk_norm(normalize_qk)
    self.normalize_qk = self.qk_norm is not None
    self.precision = precision
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.attention_fn = attention_fn
    # Resolved and checked once, here; __call__ re-reads it only if the
    # attribute was reassigned.
    self._attention = multi_head.resolve_attention_fn(attention_fn)
    self.head_axis = head_axis
    self.batch_axis = batch_axis
    if mask is not None and not isinstance(mask, Mask):
      raise TypeError(f"mask must be an aj.Mask (the layer's pattern, e.g. "
                      f"aj.Mask(causal=True, window=(W - 1, 0))), got "
                      f"{type(mask).__name__}; per-call masks go to the "
                      "call.")
    self.mask = nnx.data(mask)
    checks.check_soft_cap(logits_soft_cap)
    self.logits_soft_cap = logits_soft_cap
    checks.check_scale(scale)
    self.scale = scale
    checks.check_score_mod(score_mod)
    # An aj.ScoreMod may hold arrays (pytree data); a function is static.
    self.score_mod = (nnx.data(score_mod) if isinstance(
        score_mod, score_mods.ScoreMod) else score_mod)
    if t5_bias is not None and not isinstance(t5_bias, score_mods.T5Bias):
      raise TypeError(f"t5_bias must be an aj.T5Bias(num_buckets, "
                      f"max_distance, bidirectional), got {t5_bias!r}.")
    self.t5_bias = t5_bias
    self.t5_table = nnx.data(None)
    if t5_bias is not None:
      self.t5_table = nnx.Param(jax.random.normal(
          rngs.params(), (t5_bias.num_buckets, num_heads), param_dtype)
                                * d_model ** -0.5)  # [buckets, N]
    self.rope = rope_lib.as_rope(rope)
    if self.rope is not None:  # refused now, not at the first call
      self.rope.inverse_frequencies(
          self.rope.rotary_dim(head_dim),
          seq_len=1 if self.rope.scaling == "dynamic" else None)
    multi_head_params.check_output_gate(output_gate)
    self.output_gate = output_gate
    self.sinks = nnx.data(None)
    if attention_sinks:
      self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype))  # [N]
    specs = sharding.projection_specs(head_axis) if head_axis else {}

    def linear(name, in_features, out_features):
      k_init, b_init = kernel_init, bias_init
      if name in specs:  # flax shards these as it creates them
        k_init = nnx.with_partitioning(k_init, specs[name]["kernel"])
        b_init = nnx.with_partitioning(b_init, specs[name]["bias"])
      return Projection(in_features, out_features, use_bias=use_bias,
                        param_dtype=param_dtype, kernel_init=k_init,
                        bias_init=b_init, rngs=rngs)

    n, k, dkv = num_heads, num_kv_heads, dims.kv_features
    self.W_q = linear("W_q", (d_model,), (n, head_dim))  # [D, N, H]
    self.W_k = linear("W_k", (dkv,), (k, head_dim))  # [Dkv, K, H]
    self.W_v = linear("W_v", (dkv,), (k, head_dim))  # [Dkv, K, H]
    self.W_o = linear("W_o", (n, head_dim), (dims.out_features,))
    self.W_g = nnx.data(None)
    if output_gate is not None:  # [D, N, H] or [D, N, 1]
      self.W_g = linear("W_g", (d_model,), (
          n, multi_head_params.gate_width(output_gate, head_dim)))
    self.q_norm = nnx.data(None)
    self.k_norm = nnx.data(None)
    norm = self.qk_norm
    if norm is not None and norm.weight is not None:
      per_head = norm.weight == "per_head"
      self.q_norm = NormScale(head_dim, param_dtype=param_dtype,
                              heads=n if per_head else None,
                              zeros=bool(norm.weight_offset))
      self.k_norm = NormScale(head_dim, param_dtype=param_dtype,
                              heads=k if per_head else None,
                              zeros=bool(norm.weight_offset))
    self.rngs = _rngs.dropout_stream(rngs, dropout_rate)
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)
    self.cache_overflow: nnx.Cache | None = nnx.data(None)
    self.cache_pad_written: nnx.Cache | None = nnx.data(None)
    self.cache_left_padding: nnx.Cache | None = nnx.data(None)
    # A paged cache (init_paged_cache): cached_key/cached_value hold the
    # pools, cache_index the lengths.
    self.cache_page_table: nnx.Cache | None = nnx.data(None)
    self.cache_refcount: nnx.Cache | None = nnx.data(None)
    self.cache_key_scales: nnx.Cache | None = nnx.data(None)  # quantised
    self.cache_value_scales: nnx.Cache | None = nnx.data(None)
    self.cache_nonfinite: nnx.Cache | None = nnx.data(None)
    self.cache_window: int | None = None
    self.memory_key: nnx.Cache | None = nnx.data(None)
    self.memory_value: nnx.Cache | None = nnx.data(None)

  def _score_mod(self):
    """The layer's ``score_mod``, then soft cap (``multi_head_attention``
    puts the T5 bias of ``params_dict()`` before them)."""
    mods = [self.score_mod] if self.score_mod is not None else []
    if self.logits_soft_cap is not None:
      mods.append(score_mods.soft_cap(self.logits_soft_cap))
    if len(mods) <= 1:
      return mods[0] if mods else None
    return score_mods.chain(*mods)

  def _layers(self) -> dict[str, Projection | NormScale | _Lone]:
    names = ("W_q", "W_k", "W_v", "W_o") + (
        ("q_norm", "k_norm") if self.q_norm is not None else ()) + (
            ("W_g",) if self.output_gate is not None else ())
    layers = {name: getattr(self, name) for name in names}
    if self.sinks is not None:
      layers["sinks"] = _Lone("logits", self.sinks)
    if self.t5_table is not None:
      layers["t5_bias"] = _Lone("table", self.t5_table)
    return layers

  def params_dict(self) -> multi_head.Params:
    """Every parameter, in ``aj.multi_head_attention``'s layout.

    Projections and qk-norm scales are cast to ``dtype`` (if set); the
    ``sinks`` logits ``[N]`` and the ``t5_bias`` table ``[R, N]`` keep
    ``param_dtype`` (they join the float32 logits). So
    ``aj.multi_head_attention(mha.params_dict(), x, x, x, mha.mask,
    scale=mha.scale, t5_bias=mha.t5_bias, rope=mha.rope,
    qk_norm=mha.qk_norm, ...)`` is ``mha(x)``.
    """
    return {name: layer.as_dict(self.dtype)
            for name, layer in self._layers().items()}

  def load_params(self, params: Mapping[str, Mapping[str, Any]]) -> None:
    """Assigns a params dict (e.g. converted weights) to this module.

    Args:
      params: ``aj.multi_head_attention``'s layout, e.g. from
        ``aj.from_torch_multihead_attention`` or another module's
        ``params_dict()``; the same entries (biases, qk-norm, gate, sinks,
        T5 table) and shapes as this module's. Values are cast to
        ``param_dtype``.

    Raises:
      ValueError: naming the entry and both shapes when they differ.

    Example:
      >>> a = MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
      >>> b = MultiHeadAttention(8, 2, rngs=nnx.Rngs(1))
      >>> b.load_params(a.params_dict())
      >>> x = jnp.ones((1, 3, 8))
      >>> bool(jnp.array_equal(a(x), b(x)))
      True
    """
    multi_head_params.param_dims(params)  # a valid layout, with its own messages
    assign_params(
        self._layers(), params, multi_head_params.LAYOUT,
        entries=(f"normalize_qk={self.qk_norm}, "
                 f"output_gate={self.output_gate!r}, attention_sinks="
                 f"{self.sinks is not None}, t5_bias={self.t5_bias!r}"),
        sizes=(f"d_model={self.d_model}, num_heads={self.num_heads}, "
               f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
               f"kv_features={self.kv_features}, "
               f"out_features={self.out_features}"))

  def init_cache(self, batch_size: int, max_length: int | None = None, *,
                 window: int | None = None,
                 dtype: jnp.dtype | None = None,
                 left_padding: ArrayLike | None = None) -> None:
    """Creates an empty KV cache: linear, or a ring buffer for a window.

    Every example of the batch has its own position (``cache_index [B]``):
    a ragged prefill (``mask=aj.Mask(q_lengths=`` the prompt lengths``)``,
    prompts right-padded) leaves each example where its prompt ended, and each
    then decodes from there. Left-padded prompts give ``left_padding``
    instead.

    Args:
      batch_size: ``B``.
      max_length: ``L``, the most tokens (prompt + generated) a linear
        cache holds. Leave it out for a layer whose mask has a causal window
        to get a ring buffer instead.
      window: ``W`` slots of a ring buffer (sliding-window cache): memory
        independent of the generated length, equal to full attention with
        the module's window. Needs a layer mask with ``window=(w, 0)`` (or
        ``w`` with causal decoding) with ``w < W``; defaults to ``w + 1``
        when neither ``max_length`` nor ``window`` is given.
      dtype: cache dtype; defaults to the module's ``dtype`` or
        ``param_dtype``. ``"int8"`` or ``"float8_e4m3fn"``: a quantised
        linear cache, kept in pages (``init_paged_cache`` with ``B *
        ceil(L / Z)`` pages of ``Z = min(L, 128)`` tokens: the bytes of a
        linear cache, every row room for ``L`` tokens), quantised on
        write with a scale per token and key/value head and dequantised
        page by page as attention reads it; not with a ring buffer or
        ``left_padding``.
      left_padding: optional integer ``[B]``: each example's leading pad
        tokens, for prompts left-padded to one length ``T`` and prefilled
        with ``decode=True`` (pads included: every example advances by
        ``T``). The cache never shows those positions to any query, rotary
        positions (unless ``positions=`` is given), masks and score
        modifiers count from each example's first real token, so a
        left-padded example decodes as its tokens alone; in a linear cache
        or a ring buffer (which refuses a dense padding mask). Stored as
        ``cache_left_padding``.
    """
    checks.check_positive_int("batch_size", batch_size)
    length, window = cache_step.cache_slots(self.mask, max_length, window)
    if isinstance(dtype, str) and dtype in quantize.FORMATS:
      self.init_paged_cache(batch_size, dtype=dtype, **paged_cache.linear_pages(
          dtype, batch_size, length, window=window, left_padding=left_padding))
      return
    if left_padding is not None:
      left_padding = kv_cache.check_left_padding(left_padding, batch_size)
    dtype = dtype or self.dtype or self.param_dtype
    shape = (batch_size, self.num_kv_heads, length, self.head_dim)
    meta = {}
    if sharding.mesh_axis_size(self.head_axis) is not None:  # K heads split
      meta["out_sharding"] = (None, self.head_axis, None, None)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype), **meta)  # [B, K, L, H]
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype), **meta)
    self.cache_index = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))  # [B]
    self.cache_overflow = nnx.Cache(jnp.zeros((batch_size,), bool))  # [B]
    self.cache_pad_written = nnx.Cache(jnp.zeros((batch_size,), bool))  # [B]
    self.cache_left_padding = (None if left_padding is None
                               else nnx.Cache(left_padding))  # [B]
    self.cache_window = window
    self.cache_page_table = self.cache_refcount = None
    self.cache_key_scales = self.cache_value_scales = None
    self.cache_nonfinite = None
    self.memory_key = self.memory_value = None  # one cache at a time

  def init_paged_cache(self, batch_size: int, *, num_pages: int,
                       page_size: int, max_pages: int,
                       dtype: jnp.dtype | None = None) -> None:
    """Creates an empty paged KV cache (``aj.init_paged_cache``).

    One pool of ``num_pages`` pages of ``page_size`` tokens serves the
    ``batch_size`` sequences (rows), each holding at most ``max_pages``
    pages: memory follows the tokens held, not ``B`` times the longest.
    ``decode=True`` then appends each call's tokens to each sequence's
    pages and attends causally through its page table (ragged new tokens
    with the mask's ``q_lengths``). ``dtype="int8"`` or
    ``"float8_e4m3fn"`` stores quantised pages with a scale per token and
    key/value head (dequantised page by page as attention reads them). A
    finished sequence's pages return to
    the pool with ``update_paged_cache(aj.paged_cache.release, done)``;
    ``update_paged_cache(aj.paged_cache.share_prefix, src, dst, n)``
    gives a new sequence another's prompt without copying it.

    Example:
      >>> mha = aj.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
      >>> mha.init_paged_cache(2, num_pages=6, page_size=4, max_pages=3)
      >>> out = mha(jnp.ones((2, 5, 8)), decode=True,
      ...           mask=aj.Mask(q_lengths=jnp.array([5, 2])))
      >>> mha.cache_index[...].tolist()
      [5, 2]
      >>> mha.update_paged_cache(aj.paged_cache.release,
      ...                        jnp.array([True, False]))
      >>> mha.cache_index[...].tolist()
      [0, 2]
    """
    checks.check_positive_int("batch_size", batch_size)
    dtype = dtype or self.dtype or self.param_dtype
    cache = paged_cache.init_paged_cache(
        num_pages, page_size, self.num_kv_heads, self.head_dim, batch_size,
        max_pages, dtype=dtype)
    self.cached_key = nnx.Cache(cache.key_pages)  # [P, K, Z, H]
    self.cached_value = nnx.Cache(cache.value_pages)
    self.cache_index = nnx.Cache(cache.lengths)  # [B]
    self.cache_overflow = nnx.Cache(cache.overflow)  # [B]
    self.cache_page_table = nnx.Cache(cache.page_table)  # [B, M]
    self.cache_refcount = nnx.Cache(cache.refcount)  # [P]
    scales = cache.key_scales is not None
    self.cache_key_scales = nnx.Cache(cache.key_scales) if scales else None
    self.cache_value_scales = (nnx.Cache(cache.value_scales) if scales
                               else None)  # [P, K, Z]
    self.cache_nonfinite = nnx.Cache(cache.nonfinite)  # [P]
    self.cache_pad_written = self.cache_left_padding = None
    self.cache_window = None
    self.memory_key = self.memory_value = None  # one cache at a time

  def _paged(self) -> paged_cache.PagedKVCache:
    scales = (None, None) if self.cache_key_scales is None else (
        self.cache_key_scales[...], self.cache_value_scales[...])
    return paged_cache.PagedKVCache(
        self.cached_key[...], self.cached_value[...],
        self.cache_page_table[...], self.cache_index[...],
        self.cache_refcount[...], self.cache_overflow[...], *scales,
        self.cache_nonfinite[...])

  def _store_paged(self, cache: paged_cache.PagedKVCache) -> None:
    self.cached_key[...] = cache.key_pages
    self.cached_value[...] = cache.value_pages
    self.cache_page_table[...] = cache.page_table
    self.cache_index[...] = cache.lengths
    self.cache_refcount[...] = cache.refcount
    self.cache_overflow[...] = cache.overflow
    self.cache_nonfinite[...] = cache.nonfinite
    if self.cache_key_scales is not None:
      self.cache_key_scales[...] = cache.key_scales
      self.cache_value_scales[...] = cache.value_scales

  def update_paged_cache(self, fn, *args, **kwargs) -> None:
    """Replaces the paged cache by ``fn(cache, *args, **kwargs)``: one of
    ``aj.paged_cache``'s pure updates (``release``, ``share_prefix``,
    ``append``)."""
    if self.cache_page_table is None:
      raise ValueError("update_paged_cache needs a paged cache: call "
                       "init_paged_cache(...) first.")
    cache = fn(self._paged(), *args, **kwargs)
    if not isinstance(cache, paged_cache.PagedKVCache):
      raise TypeError(f"{getattr(fn, '__name__', fn)} returned "
                      f"{type(cache).__name__}, not a PagedKVCache.")
    self._store_paged(cache)

  def init_cross_cache(self, memory: ArrayLike, *,
                       dtype: jnp.dtype | None = None) -> None:
    """Projects a memory (an encoder's output) once, for cross-attention.

    After this, ``layer(query, decode=True)`` attends to the stored keys and
    values without projecting the memory again: the same numbers as
    ``layer(query, memory)`` (a decoder's cross-attention then costs one
    query projection per step instead of two ``[S, Dkv]`` projections).
    Masks and biases are per call, over ``[B, N, T, S]`` as without the
    cache (e.g. ``aj.Mask(kv_lengths=source_lengths)``). Replaces any KV
    cache of this layer (one layer is either causal self-attention or
    cross-attention).

    Args:
      memory: float ``[B, S, Dkv]``.
      dtype: dtype of the stored keys and values; defaults to the module's
        ``dtype`` or ``param_dtype`` (another dtype rounds them: the numbers
        then differ from projecting the memory per call by that rounding).

    Example:
      >>> cross = MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
      >>> memory, x = jnp.ones((1, 6, 8)), jnp.ones((1, 1, 8))
      >>> cross.init_cross_cache(memory)
      >>> bool(jnp.allclose(cross(x, decode=True), cross(x, memory)))
      True
    """
    if self.rope is not None:
      raise ValueError(
          "init_cross_cache projects the memory once, without positions; "
          "this layer has rope, which would rotate the keys at each call's "
          "positions. Build the cross-attention layer with rope=None.")
    checks.check_float_array("memory", memory)
    checks.check_module_input("memory", memory, self.kv_features,
                              "kv_features", "[B, S, Dkv]")
    if self.dtype is not None:
      memory = jnp.asarray(memory, self.dtype)
    projected = multi_head.project_memory(self.params_dict(), memory,
                                          precision=self.precision,
                                          qk_norm=self.qk_norm)
    dtype = dtype or self.dtype or self.param_dtype
    self.memory_key = nnx.Cache(projected.key.astype(dtype))  # [B, K, S, H]
    self.memory_value = nnx.Cache(projected.value.astype(dtype))
    self.cached_key = self.cached_value = None
    self.cache_index = self.cache_overflow = None
    self.cache_pad_written = self.cache_left_padding = None
    self.cache_page_table = self.cache_refcount = None
    self.cache_key_scales = self.cache_value_scales = None
    self.cache_nonfinite = None
    self.cache_window = None

  def check_cache(self) -> None:
    """Raises ``ValueError`` if a decoding call overflowed the cache, or
    cached right padding.

    The step itself records overflow as a value (``cache_overflow [B]``,
    sticky) instead of a host callback; call this where a host sync is
    cheap (after generating, or every n steps). An example that overflowed
    did not write the tokens that did not fit, and its outputs since then
    are not meaningful. ``cache_pad_written [B]`` (sticky) marks examples
    whose prefill (``T > 1``) had no ``q_lengths`` but a mask hiding its
    last token from its own query (``kv_lengths`` or a key-padding mask
    shorter than ``T``): right-padded prompts whose pads were cached as
    tokens. That raises at trace time when the values are concrete; under
    ``jit`` this reports it.
    """
    if self.cache_overflow is None:
      cache_step.raise_if_overflowed(None, None, 0, "KV cache")
    if self.cache_page_table is not None:
      paged_cache.check_overflow(self._paged())
      return
    cache_step.raise_if_overflowed(
        self.cache_overflow[...], self.cache_index[...],
        self.cached_key.shape[2], "KV cache",
        " (or use a ring buffer: a layer mask with a causal window)")
    if self.cache_pad_written is not None:
      cache_step.raise_if_pads_written(self.cache_pad_written[...])

  def _resolved_attention(self) -> multi_head.ResolvedAttentionFn:
    """The layer's ``attention_fn``, resolved when built (again only if
    the attribute was reassigned since)."""
    if self._attention.given is self.attention_fn:
      return self._attention
    return multi_head.resolve_attention_fn(self.attention_fn)

  def __call__(
      self,
      query: ArrayLike,
      key: ArrayLike | None = None,
      value: ArrayLike | None = None,
      mask: Mask | ArrayLike | None = None,
      *,
      bias: ArrayLike | None = None,
      is_causal: bool = False,
      deterministic: bool | None = None,
      rngs: nnx.Rngs | jax.Array | None = None,
      return_weights: bool = False,
      return_lse: bool = False,
      return_max_logits: bool = False,
      positions: ArrayLike | None = None,
      kv_positions: ArrayLike | None = None,
      decode: bool = False,
      cache_rows: ArrayLike | None = None,
  ) -> jax.Array | tuple[jax.Array, ...]:
    """Attends ``query`` to ``key``/``value``.

    Args:
      query: ``[B, T, D]``.
      key: ``[B, S, Dkv]``; defaults to ``query`` (self-attention).
      value: ``[B, S, Dkv]``; defaults to ``key`` (cross-attention passes
        the encoder output once).
      mask: an ``aj.Mask`` (e.g. ``aj.Mask(kv_lengths=[B])`` for padded
        keys, ``aj.Mask(q_segment_ids=[B, T])`` for packed documents, not
        while decoding), or a dense bool/integer array of rank 4,
        broadcastable to ``[B, N, T, S]`` (True = may attend; a ``[B, S]``
        key-padding mask is ``mask[:, None, None, :]``); with
        ``decode=True``, dense masks are over cache slots ``[B, N, T, L]``
        and the mask's ``q_lengths [B]`` is each example's number of real
        new tokens (a ragged prefill of right-padded prompts: only those
        are cached, and each example's position advances by its own
        length). A right-padded prefill needs that ``q_lengths``: a mask
        that only hides the pads (``kv_lengths``, a key-padding mask) would
        cache them as tokens, which raises (concrete values) or is reported
        by ``check_cache()`` (under ``jit``). Intersected with the layer's
        ``mask``.
      bias: float of rank 4, broadcastable like a dense mask, added to the
        logits.
      is_causal: shorthand for ``mask & aj.Mask(causal=True)`` (implied by
        ``decode``).
      deterministic: overrides the constructor's; True disables dropout.
      rngs: overrides the module's dropout stream for this call.
      return_weights: also return the attention weights.
      return_lse: also return each row's log-sum-exp ``[B, N, T]``
        (float32; ``-inf`` where a row sees nothing), e.g. for
        ``aj.merge_attentions``.
      return_max_logits: also return each row's largest raw logit
        ``scale * q . k`` over the keys it may attend to, ``[B, N, T]``,
        before bias, score modifiers and soft cap; no gradient (QK-clip,
        logit-growth monitoring: ``.max(axis=(0, 2))`` per head).
      positions: integer ``[B, T]`` (or ``[T]``) rotary positions of this
        call's queries (needs ``rope``): left-padded batches, custom
        position ids; while decoding, the positions of the new tokens
        (their keys are cached rotated there). Masks and score modifiers
        keep seeing token (cache slot) indices.
      kv_positions: integer ``[B, S]`` rotary positions of the keys;
        default ``positions`` in self-attention (no ``key`` given),
        required with other keys; not while decoding.
      decode: with a KV cache (``init_cache``): append this call's
        keys/values to the cache and attend causally to everything cached.
        Any number of tokens per call; the result equals full causal
        attention over the sequence. Each example writes at its own
        position (``cache_index [B]``). Overflow of a linear cache is
        recorded, not raised, inside the step: ``check_cache()`` raises it.
        Left-padded prompts: ``init_cache(..., left_padding=)``.
        With a cross-attention cache (``init_cross_cache``): attend to the
        stored memory (``key``/``value`` not given).
      cache_rows: with ``decode`` and a paged cache (``init_paged_cache``),
        int ``[B']``: the cache's sequences this call's ``B'`` examples are
        (distinct; ``aj.paged_cache.take_rows``); the others neither write
        nor are computed (a call that prefills the new requests' prompts
        while the rest wait). Masks and lengths are over the ``B'``.

    Returns:
      ``output [B, T, Dout]``, or a tuple of it followed by what was asked
      for, in this order: ``weights [B, N, T, S]`` (``S = L`` when
      decoding), ``lse [B, N, T]``, ``max_logits [B, N, T]``.
    """
    memory = None
    if decode and self.memory_key is not None:
      if key is not None or value is not None:
        raise ValueError(
            "this layer holds a cross-attention memory (init_cross_cache): "
            "decode=True attends to it, so pass no key/value (or call "
            "without decode=True to attend to other keys).")
      memory = multi_head.Memory(self.memory_key[...], self.memory_value[...],
                                 self.qk_norm)
      decode = False
    if memory is None:
      if key is None and value is None and not decode:
        kv_positions = positions if kv_positions is None else kv_positions
      key = query if key is None else key
      value = key if value is None else value
    for name, x, width, arg in (
        ("query", query, self.d_model, "d_model"),
        ("key", key, self.kv_features, "kv_features"),
        ("value", value, self.kv_features, "kv_features")):
      if x is not None:  # None: attending to the stored memory
        checks.check_module_input(name, x, width, arg,
                                  "[B, T or S, features]")
    if self.dtype is not None:  # as nnx.Linear: compute in `dtype`
      query, key, value = (None if x is None else jnp.asarray(x, self.dtype)
                           for x in (query, key, value))
    if deterministic is None:
      deterministic = self.deterministic
    rate = 0.0 if deterministic else self.dropout_rate
    dropout_rng = _rngs.dropout_key(rngs, self.rngs) if rate > 0 else None
    cache = None
    if cache_rows is not None and not (decode and
                                       self.cache_page_table is not None):
      raise ValueError(
          "cache_rows picks sequences of a paged cache while decoding: "
          "pass decode=True after init_paged_cache(...) (a linear cache's "
          "rows are its batch: slice the cache instead).")
    if decode:
      if self.cache_index is None:
        raise ValueError("decode=True needs a cache: call "
                         "init_cache(batch_size, max_length) first (causal "
                         "self-attention), or init_cross_cache(memory) "
                         "(cross-attention).")
      pads = (None if self.cache_left_padding is None
              else self.cache_left_padding[...])
      if self.cache_page_table is not None:
        cache = full = self._paged()
        if cache_rows is not None:
          cache = paged_cache.take_rows(full, cache_rows)
      else:
        cache = cache_step.KVCache(
            self.cached_key[...], self.cached_value[...],
            self.cache_index[...], self.cache_overflow[...],
            self.cache_window, pads, self.cache_pad_written[...])
    checks.check_static_bool("is_causal", is_causal)
    call_mask = mask_lib.as_mask(mask, is_causal=is_causal and not decode)
    if self.mask is not None:
      call_mask = self.mask if call_mask is None else self.mask & call_mask
    params = self.params_dict()
    # The function reads the head counts off the params; these are the
    # layer's (a state swapped in with other shapes is refused here).
    multi_head_params.param_dims(params, num_heads=self.num_heads,
                                 num_kv_heads=self.num_kv_heads)
    result = multi_head.multi_head_attention(
        params, query, key, value, call_mask, bias=bias,
        scale=self.scale, score_mod=self._score_mod(), t5_bias=self.t5_bias,
        dropout_rate=rate, dropout_rng=dropout_rng,
        attention_fn=self._resolved_attention(),
        return_weights=return_weights,
        return_lse=return_lse, return_max_logits=return_max_logits,
        rope=self.rope, positions=positions, kv_positions=kv_positions,
        precision=self.precision, head_axis=self.head_axis, cache=cache,
        memory=memory, qk_norm=self.qk_norm, batch_axis=self.batch_axis)
    if decode and self.cache_page_table is not None:
      result, cache = result
      if cache_rows is not None:
        cache = paged_cache.put_rows(full, cache, cache_rows)
      self._store_paged(cache)
    elif decode:
      result, cache = result
      self.cached_key[...] = cache.key
      self.cached_value[...] = cache.value
      self.cache_index[...] = cache.index
      self.cache_overflow[...] = cache.overflow
      self.cache_pad_written[...] = cache.pad_written
    return result
