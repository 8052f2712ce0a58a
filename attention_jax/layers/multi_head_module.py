"""``MultiHeadAttention``: the lesson's module in Flax NNX, with a KV cache.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim (``D // N`` unless chosen), D model dim, Dkv
key/value features, Dout output features, L cache capacity, R T5
relative-position buckets.

The module owns its parameters and its configuration. Parameters are plain
``nnx.Param``s (``W_q``, ``W_k``, ``W_v``, ``W_o``, each a ``kernel`` and
optional ``bias``, with qk-norm ``q_norm``/``k_norm``, a value norm
``v_norm`` and an output norm ``o_norm``, each a ``scale`` (and a ``bias``
for a biased norm), with an output gate ``W_g``, learned ``sinks [N]`` and
a T5 ``t5_table [R, N]``), laid out per head as
``aj.multi_head_attention``'s params dict (``W_q`` kernel ``[D, N, H]``,
``W_o`` kernel ``[N, H, Dout]``, ``sinks`` logits, ``t5_bias`` table, ...).
The configuration is one
``multi_head_config.Config``, validated when the module is built; a call
checks only its own inputs and runs ``layers.multi_head.forward``, the same
steps for the full call and for cached decoding (the caches:
``layers/multi_head_module_cache.py``; the parameter holders and fitting a
params dict to them: ``layers/multi_head_holders.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
import operator
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.layers import _rngs
from attention_jax.layers import caches
from attention_jax.layers import multi_head
from attention_jax.layers import multi_head_config
from attention_jax.layers import multi_head_params
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.layers import sharding
from attention_jax.layers.attention_fn import NO_MASK
from attention_jax.layers.multi_head_holders import Lone
from attention_jax.layers.multi_head_holders import NormScale
from attention_jax.layers.multi_head_holders import Projection
from attention_jax.layers.multi_head_holders import assign_params
from attention_jax.layers.multi_head_holders import check_fit
from attention_jax.layers.multi_head_module_cache import CACHE_ROWS
from attention_jax.layers.multi_head_module_cache import DecodingCaches
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib
from attention_jax.scores import score_mods

_LECUN_NORMAL = nnx.initializers.lecun_normal()  # nnx.Linear's default
_ZEROS = nnx.initializers.zeros_init()


class MultiHeadAttention(DecodingCaches):
  """Multi-head attention for self-, cross- and causal (cached) attention.

  Options shared with ``aj.multi_head_attention`` (``attention_fn``,
  ``scale``, ``t5_bias``, ``rope``, ``normalize_qk``, ``clip_qkv``,
  ``value_norm``, ``output_norm``, ``precision``, ``head_axis``,
  ``batch_axis``) are described once, in
  ``layers.multi_head_config.Config``; the module validates them when built.

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
    normalize_qk: True (``aj.QKNorm()``: an RMSNorm of each head before
      ``rope``, learned scales ``q_norm``/``k_norm [H]``) or an
      ``aj.QKNorm`` (flax's ``nnx.MultiHeadAttention``'s is
      ``aj.QKNorm(kind="layer")``; Phi-2's ``aj.QKNorm(kind="layer",
      epsilon=..., bias=True)``, biases zeros to start); stored as
      ``qk_norm``.
    precision: the projection einsums' ``jax.lax.Precision``.
    dropout_rate: dropout on the attention weights, in ``[0, 1)``.
    deterministic: default for calls; ``True`` disables dropout.
      ``model.eval()`` and ``nnx.view(model, deterministic=...)`` set it.
    use_bias: biases in the four projections.
    dtype: computation dtype of the projections (``None``: inferred from
      inputs and params). Attention itself runs in float32 for <=32-bit
      inputs.
    param_dtype: parameter dtype.
    kernel_init: initialiser for the kernels (LeCun normal), called on the
      flat 2-D shapes ``[D, N*H]``, ``[N*H, Dout]`` as flax's
      ``LinearGeneral`` calls it, then reshaped per head.
    bias_init: initialiser for the biases (zeros).
    attention_fn: a function of the ``attention_fn`` protocol
      (``layers/attention_fn.py``), or a kernel choice: None (automatic:
      dense when weights are returned or the problem is small, else cuDNN
      on GPU or flash), ``"dense"``, ``"flash"``, an ``aj.kernels`` kernel
      or a list of them.
    head_axis: a mesh axis for head (tensor) parallelism, e.g. ``"model"``:
      the kernels' heads axes are split over it as flax creates them
      (``sharding.projection_specs``): build under ``jax.set_mesh(mesh)``.
    batch_axis: the mesh axes the batch is split over.
    mask: an ``aj.Mask`` every call is intersected with, e.g.
      ``aj.Mask(causal=True, window=(W - 1, 0))`` for a sliding-window
      layer (decoding honours it, and ``init_cache`` can then keep a ring
      buffer of ``W`` slots).
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)``, after
      the other score modifiers (``aj.soft_cap``).
    scale: multiplier of ``q . k``, a positive Python number or a concrete
      float scalar array (kept as its Python float; a traced one is
      refused: a learned scale belongs in params); None means ``1 /
      sqrt(head_dim)``.
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
      applied before ``score_mod``; ``params_dict()["t5_bias"]["table"]``.
    rope: an ``aj.Rope`` rotating the projected queries and keys, or None.
    output_gate: ``"elementwise"`` or ``"headwise"``: a learned sigmoid
      gate computed from the query input, ``sigmoid(query @ W_g + b)``,
      multiplied into each head's attention output before ``W_o`` (Qiu et
      al. 2025, "Gated Attention for Large Language Models"; Qwen3-Next
      uses the elementwise one). ``W_g`` is ``[D, N, H]`` (elementwise) or
      ``[D, N, 1]`` (headwise), drawn with ``kernel_init`` like ``W_q``,
      with a zero bias (if ``use_bias``): a new layer's gate starts around
      0.5, as the paper trains it, not as a pass-through of the ungated
      layer.
    clip_qkv: ``c``: clip the projected queries, keys and values to
      ``[-c, c]`` before their norms and rotary (OLMo, DBRX), a positive
      number; None: no clipping.
    value_norm: an ``aj.QKNorm`` normalising the values of each key/value
      head before attention and the cache (Gemma 3n's
      ``aj.QKNorm(weight=None, epsilon=rms_norm_eps)``); with a weight,
      ``v_norm`` (``[H]`` or ``[K, H]``, the identity to start).
    output_norm: an ``aj.QKNorm`` normalising the attention output before
      the output gate and ``W_o`` (BitNet's
      ``aj.QKNorm(over="all", weight="per_head", epsilon=...)``, weights
      ``o_norm [N, H]``, ones to start).

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
      attention_fn: Any = None,
      head_axis: str | None = None,
      batch_axis: str | tuple[str, ...] | None = None,
      mask: Mask | None = None,
      logits_soft_cap: float | None = None,
      scale: float | None = None,
      attention_sinks: bool = False,
      score_mod: Any = None,
      t5_bias: score_mods.T5Bias | None = None,
      rope: rope_lib.Rope | None = None,
      output_gate: str | None = None,
      clip_qkv: float | None = None,
      value_norm: qk_norm_lib.QKNorm | None = None,
      output_norm: qk_norm_lib.QKNorm | None = None,
      kv_shared: bool = False,
  ):
    dims = multi_head_params.check_dims(
        d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        kv_features=kv_features, out_features=out_features)
    if (head_axis and nnx.using_eager_sharding()
        and sharding.mesh_axis_size(head_axis) is None):
      raise ValueError(
          f"head_axis={head_axis!r} shards the parameters as they are "
          "created, which needs a mesh with that axis: build the module "
          "under `with jax.set_mesh(mesh):` (mesh axes: "
          f"{jax.sharding.get_abstract_mesh().axis_names or 'none'}).")
    checks.check_dropout_rate(dropout_rate)
    if mask is not None and not isinstance(mask, Mask):
      raise TypeError(f"mask must be an aj.Mask (the layer's pattern, e.g. "
                      f"aj.Mask(causal=True, window=(W - 1, 0))), got "
                      f"{type(mask).__name__}; per-call masks go to the "
                      "call.")
    checks.check_soft_cap(logits_soft_cap)
    scale = multi_head_config.static_scale(scale)  # a concrete array: float
    checks.check_score_mod(score_mod)
    multi_head_params.check_output_gate(output_gate)
    multi_head_params.check_t5_bias(t5_bias)
    multi_head_params.check_t5(None if t5_bias is None else (
        t5_bias.num_buckets, num_heads), t5_bias, score_mod)
    self.d_model, self.num_heads = d_model, num_heads
    self.num_kv_heads, self.head_dim = dims.num_kv_heads, dims.head_dim
    self.kv_features, self.out_features = dims.kv_features, dims.out_features
    self.qk_norm = qk_norm_lib.as_qk_norm(normalize_qk)
    self.normalize_qk = self.qk_norm is not None
    self.precision, self.dtype, self.param_dtype = precision, dtype, param_dtype
    self.dropout_rate, self.deterministic = dropout_rate, deterministic
    self.attention_fn = attention_fn
    self.head_axis, self.batch_axis = head_axis, batch_axis
    self.mask = nnx.data(mask)
    self.logits_soft_cap, self.scale = logits_soft_cap, scale
    # An aj.ScoreMod may hold arrays (pytree data); a function is static.
    self.score_mod = (nnx.data(score_mod) if isinstance(
        score_mod, score_mods.ScoreMod) else score_mod)
    self.t5_bias, self.output_gate = t5_bias, output_gate
    self.clip_qkv = clip_qkv
    self.value_norm, self.output_norm = value_norm, output_norm
    self.rope = rope_lib.as_rope(rope)
    checks.check_static_bool("kv_shared", kv_shared)
    self.kv_shared = kv_shared
    self._config = self._configure()  # before the parameters it sizes
    self._create_params(rngs, use_bias, kernel_init, bias_init,
                        attention_sinks)
    self.rngs = _rngs.dropout_stream(rngs, dropout_rate)
    self._no_cache()

  def _create_params(self, rngs, use_bias, kernel_init, bias_init,
                     attention_sinks) -> None:
    """The parameters, in the per-head layout (sharded over ``head_axis``
    as flax creates them)."""
    n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
    specs = (sharding.projection_specs(self.head_axis) if self.head_axis
             else {})

    def linear(name, in_features, out_features):
      k_init, b_init = kernel_init, bias_init
      if name in specs:  # flax shards these as it creates them
        k_init = nnx.with_partitioning(k_init, specs[name]["kernel"])
        b_init = nnx.with_partitioning(b_init, specs[name]["bias"])
      return Projection(in_features, out_features, use_bias=use_bias,
                        param_dtype=self.param_dtype, kernel_init=k_init,
                        bias_init=b_init, rngs=rngs)

    self.t5_table = nnx.data(None)
    if self.t5_bias is not None:
      self.t5_table = nnx.Param(jax.random.normal(
          rngs.params(), (self.t5_bias.num_buckets, n), self.param_dtype)
                                * self.d_model ** -0.5)  # [buckets, N]
    self.sinks = nnx.data(None)
    if attention_sinks:
      self.sinks = nnx.Param(jnp.zeros((n,), self.param_dtype))  # [N]
    self.W_q = linear("W_q", (self.d_model,), (n, h))  # [D, N, H]
    self.W_k = self.W_v = nnx.data(None)  # kv_shared: another layer's
    if not self.kv_shared:
      self.W_k = linear("W_k", (self.kv_features,), (k, h))  # [Dkv, K, H]
      self.W_v = linear("W_v", (self.kv_features,), (k, h))  # [Dkv, K, H]
    self.W_o = linear("W_o", (n, h), (self.out_features,))  # [N, H, Dout]
    self.W_g = nnx.data(None)
    if self.output_gate is not None:  # [D, N, H] or [D, N, 1]
      self.W_g = linear("W_g", (self.d_model,), (
          n, multi_head_params.gate_width(self.output_gate, h)))
    config = self._config
    for name, norm, heads in (("q_norm", config.qk_norm, n),
                              ("k_norm", config.qk_norm, k),
                              ("v_norm", config.value_norm, k),
                              ("o_norm", config.output_norm, n)):
      if self.kv_shared and name in ("k_norm", "v_norm"):
        norm = None  # the keys' and values' norms are the other layer's
      setattr(self, name, nnx.data(None) if norm is None or norm.weight is None
              else NormScale(h, param_dtype=self.param_dtype,
                             heads=heads if norm.weight == "per_head"
                             else None,
                             zeros=bool(norm.weight_offset), bias=norm.bias))
    self._names = tuple(name for name in self._layers()
                        if name not in ("sinks", "t5_bias"))
    # What a call compares its state with (nnx.update may swap in another).
    self._shapes = self._kernel_shapes(self._layers())

  @staticmethod
  def _kernel_shapes(layers) -> tuple[Any, ...]:
    return tuple(layers[n].kernel.shape if hasattr(layers[n], "kernel")
                 else layers[n]["kernel"].shape
                 for n in ("W_q", "W_k", "W_o") if n in layers)

  def _source(self) -> tuple[Any, ...]:
    """The attributes the layer's ``Config`` is built from."""
    return (self.attention_fn, self.scale, self.t5_bias, self.rope,
            self.qk_norm, self.precision, self.head_axis, self.batch_axis,
            self.clip_qkv, self.value_norm, self.output_norm)

  def _configure(self) -> multi_head_config.Config:
    """The layer's ``Config``, every option validated."""
    dims = multi_head_params.HeadDims(
        self.num_heads, self.num_kv_heads, self.head_dim, self.d_model,
        self.kv_features, self.out_features,
        self.qk_norm is not None and self.qk_norm.weight is not None,
        self.output_gate)
    return multi_head_config.configure(
        dims, attention_fn=self.attention_fn, scale=self.scale,
        t5_bias=self.t5_bias, rope=self.rope, qk_norm=self.qk_norm,
        clip_qkv=self.clip_qkv, value_norm=self.value_norm,
        output_norm=self.output_norm,
        precision=self.precision, head_axis=self.head_axis,
        batch_axis=self.batch_axis,
        widths=(f"the module was built with d_model={self.d_model}",
                f"the module was built with kv_features={self.kv_features}"),
        source=self._source())

  def _score_mod(self):
    """The layer's ``score_mod``, then soft cap (the T5 table's goes before
    them: ``multi_head.layer_score_mod``)."""
    if self.logits_soft_cap is None:
      return self.score_mod
    cap = score_mods.soft_cap(self.logits_soft_cap)
    return cap if self.score_mod is None else score_mods.chain(
        self.score_mod, cap)

  def _layers(self) -> dict[str, Projection | NormScale | Lone]:
    names = ("W_q", "W_k", "W_v", "W_o", "q_norm", "k_norm", "v_norm",
             "o_norm", "W_g")
    layers = {name: getattr(self, name) for name in names
              if getattr(self, name) is not None}
    if self.sinks is not None:
      layers["sinks"] = Lone("logits", self.sinks)
    if self.t5_table is not None:
      layers["t5_bias"] = Lone("table", self.t5_table)
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
    params = {}
    for name in self._names:
      params[name] = getattr(self, name).as_dict(self.dtype)
    if self.sinks is not None:
      params["sinks"] = {"logits": self.sinks[...]}
    if self.t5_table is not None:
      params["t5_bias"] = {"table": self.t5_table[...]}
    return params

  def load_params(self, params: Mapping[str, Mapping[str, Any]]) -> None:
    """Assigns a params dict (e.g. converted weights) to this module.

    Args:
      params: ``aj.multi_head_attention``'s layout, e.g. from
        ``aj.from_torch_multihead_attention`` or another module's
        ``params_dict()``; the same entries (biases, qk-norm, gate, sinks,
        T5 table) and shapes as this module's. Values are cast to
        ``param_dtype``.

    Raises:
      ValueError: naming the first entry that differs from the module's,
        its shape and the module's (with the sizes it was built with); a
        bias missing where the module has one says to add a zero one.

    Example:
      >>> a = MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
      >>> b = MultiHeadAttention(8, 2, rngs=nnx.Rngs(1))
      >>> b.load_params(a.params_dict())
      >>> x = jnp.ones((1, 3, 8))
      >>> bool(jnp.array_equal(a(x), b(x)))
      True
    """
    described = dict(
        entries=(f"normalize_qk={self.qk_norm}, value_norm="
                 f"{self.value_norm}, output_norm={self.output_norm}, "
                 f"output_gate={self.output_gate!r}, attention_sinks="
                 f"{self.sinks is not None}, t5_bias={self.t5_bias!r}"),
        sizes=(f"d_model={self.d_model}, num_heads={self.num_heads}, "
               f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
               f"kv_features={self.kv_features}, "
               f"out_features={self.out_features}"))
    # The module's own shapes first: they say which entry is wrong, where
    # the params alone (param_dims) can only say which ones disagree.
    check_fit(self._layers(), params, multi_head_params.LAYOUT, **described)
    if not self.kv_shared:  # (a shared layer has no W_k to read sizes from)
      multi_head_params.param_dims(params)  # dtypes, with its own messages
    assign_params(self._layers(), params, multi_head_params.LAYOUT,
                  **described)

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
      shared_kv: Any = None,
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
      bias, return_weights, return_lse, return_max_logits: as
        ``aj.multi_head_attention``'s (a bias over cache slots while
        decoding).
      is_causal: shorthand for ``mask & aj.Mask(causal=True)`` (implied by
        ``decode``).
      deterministic: overrides the constructor's; True disables dropout.
      rngs: overrides the module's dropout stream for this call.
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
      shared_kv: a layer built with ``kv_shared=True`` attends over another
        layer's keys and values with its own queries, qk-norm and rotary:
        ``other.shared_kv(x)`` (what that layer attends over for the same
        tokens ``x``), or, with ``decode``, the other layer itself, whose
        cache this step already wrote (a linear or paged cache; it is read,
        never written).

    Returns:
      ``output [B, T, Dout]``, or a tuple of it followed by what was asked
      for, in this order: ``weights [B, N, T, S]`` (``S = L`` when
      decoding), ``lse [B, N, T]``, ``max_logits [B, N, T]``.
    """
    config = self._config
    if any(map(operator.is_not, self._source(), config.source)):
      config = self._configure()  # an option was reassigned: checked again
      # (a reassigned norm must find its weights)
      multi_head_config.check_norms(config, self.params_dict())
    memory = cache = full = None
    if self.kv_shared or shared_kv is not None:
      memory, cache = self._shared(shared_kv, key, value, decode, cache_rows)
    elif decode:
      memory, cache, full = self.decoding_cache(key, value, cache_rows)
    elif cache_rows is not None:
      raise ValueError(CACHE_ROWS)
    if self.dtype is not None:  # as nnx.Linear: compute in `dtype`
      query = jnp.asarray(query, self.dtype)
      key, value = (None if x is None else jnp.asarray(x, self.dtype)
                    for x in (key, value))
    if memory is None:
      if key is None and value is None and not decode:
        kv_positions = positions if kv_positions is None else kv_positions
      key = query if key is None else key
      value = key if value is None else value
    if deterministic is None:
      deterministic = self.deterministic
    rate = 0.0 if deterministic else self.dropout_rate
    dropout_rng = _rngs.dropout_key(rngs, self.rngs) if rate > 0 else None
    if is_causal is not True and is_causal is not False:
      checks.check_static_bool("is_causal", is_causal)
    # While decoding the cache places the causal band (at the positions).
    causal = is_causal and not decode
    call_mask = mask if isinstance(mask, Mask) and not causal else (
        mask_lib.as_mask(mask, is_causal=causal))  # (a Mask is converted)
    if self.mask is not None:
      call_mask = self.mask if call_mask is None else self.mask & call_mask
    params = self.params_dict()
    if self._kernel_shapes(params) != self._shapes:
      self._refuse_state(params)
    score_mod = self._score_mod() if self.logits_soft_cap else self.score_mod
    result = multi_head.forward(config, params, multi_head.Call(
        query, key, value, NO_MASK if call_mask is None else call_mask, bias,
        score_mod, positions, kv_positions, memory, cache, rate, dropout_rng,
        (return_weights, return_lse, return_max_logits)))
    if cache is None:
      return result
    result, cache = result
    if not isinstance(cache, caches.Shared):  # (another layer's: unwritten)
      self.store_cache(cache, full, cache_rows)
    return result

  def shared_kv(self, query: ArrayLike, mask: Mask | ArrayLike | None = None,
                *, is_causal: bool = False,
                positions: ArrayLike | None = None) -> multi_head.Memory:
    """This layer's keys and values for the tokens ``query [B, T, D]``
    (clipped, normalised, rotated at ``positions``), for a
    ``kv_shared=True`` layer to attend over: ``shared(x,
    shared_kv=this.shared_kv(x))``. ``mask`` (a dense one zeroes keys no
    query sees) as this layer's call would take it."""
    if self.kv_shared:
      raise ValueError("this layer shares another's keys and values; ask "
                       "that layer for them.")
    if self.dtype is not None:
      query = jnp.asarray(query, self.dtype)
    call_mask = mask_lib.as_mask(mask, is_causal=is_causal)
    if self.mask is not None:
      call_mask = self.mask if call_mask is None else self.mask & call_mask
    return multi_head.shared_kv(self._config, self.params_dict(),
                                multi_head.Call(
                                    query, query, query,
                                    NO_MASK if call_mask is None
                                    else call_mask, positions=positions))

  def _refuse_state(self, params) -> None:
    """Refuses a state of other shapes than the module's (``nnx.update``
    with another module's): never run as another layer."""
    multi_head_params.param_dims(params, num_heads=self.num_heads,
                                 num_kv_heads=self.num_kv_heads)
    raise ValueError(
        f"this module's parameters have kernel shapes W_q, W_k, W_o = "
        f"{tuple(params[n]['kernel'].shape for n in ('W_q', 'W_k', 'W_o'))}"
        f", but it was built with {self._shapes}: load params of its own "
        "sizes (load_params checks them), or build a module of theirs.")
