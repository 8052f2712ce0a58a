"""qk-norm: normalising the projected queries and keys, in all its published forms.

Shape glossary: B batch, T length, N heads of the tensor normalised (query
heads for ``q``, key/value heads ``K`` for ``k``), H head dim.

A model normalises its projected queries and keys so the logits cannot grow
without bound. The variants in use differ in six ways, each a field of one
``QKNorm`` value:

================  ===========  ====  ==============  ======  ====  ===========
model             kind         over  weight          offset  bias  order
================  ===========  ====  ==============  ======  ====  ===========
Qwen3, Gemma 3    ``"rms"``    head  ``[H]`` shared  0 / 1   no    before rope
Qwen3-Next        ``"rms"``    head  ``[H]`` shared  1       no    before rope
OLMo 2            ``"rms"``    all   ``[N, H]``      0       no    before rope
Cohere            ``"layer"``  head  ``[N, H]``      0       no    before rope
Phi-2, Persimmon  ``"layer"``  head  ``[H]`` shared  0       yes   before rope
StableLM          ``"layer"``  head  ``[N, H]``      0       no    before rope
Llama 4           ``"rms"``    head  none            -       no    after rope
================  ===========  ====  ==============  ======  ====  ===========

``over="head"`` normalises each head's ``H`` features; ``over="all"`` one
token's ``N * H`` features together (OLMo 2's RMSNorm over the whole
projection). A weight is one ``[H]`` scale shared by the heads
(``weight="shared"``), one per head (``"per_head"``, ``[N, H]``: a
whole-width ``[N * H]`` weight reshaped per head, as projection biases are),
or none. ``weight_offset=1`` multiplies by ``1 + w`` (Gemma's and
Qwen3-Next's norms store ``w`` around 0); ``bias=True`` adds a learned
``b`` of the weight's shape after it (a LayerNorm with an affine bias):
``norm(x) * (offset + w) + b``. The norm and its weight are
computed in float32 (float64 for float64 inputs) and cast back once; in
bfloat16 this differs by one rounding from models that cast to the input
dtype before the weight (Qwen3, OLMo 2), and equals those that cast last
(Gemma 3, Qwen3-Next, Cohere).

The same description normalises other tensors of the layer, each with its
own params entry (``resolve``'s ``option``): the values per key/value head
(``value_norm``, ``v_norm``: Gemma 3n's weightless RMSNorm over ``H``) and
the attention output before ``W_o`` (``output_norm``, ``o_norm``: BitNet's
RMSNorm over the ``N * H`` width, ``QKNorm(over="all",
weight="per_head")``). Neither is rotated, so neither takes
``after_rope=True``. ``rms_norm`` is the plain RMSNorm of the latent
layer's compressed vectors.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

RMS_NORM_EPSILON = 1e-6  # flax nnx.RMSNorm's default
#: ``QKNorm.kind``: root-mean-square (no centring) or layer norm (centred).
KINDS = ("rms", "layer")
#: ``QKNorm.over``: each head alone, or all of a token's heads together.
OVER = ("head", "all")
#: ``QKNorm.weight``: one ``[H]`` scale for every head, one per head
#: ``[N, H]``, or None (weightless).
WEIGHTS = ("shared", "per_head", None)


@dataclasses.dataclass(frozen=True)
class QKNorm:
  """How a layer normalises its projected queries and keys.

  A frozen, hashable value (static under ``jax.jit``). With learned weights
  they live in the params (``q_norm``/``k_norm``: ``{"scale": [H]}`` or
  ``[N, H]`` / ``[K, H]``, and ``"bias"`` of the same shape with
  ``bias=True``); ``weight=None`` has none.

  Attributes:
    kind: ``"rms"``: ``x / sqrt(mean(x**2) + epsilon)``; ``"layer"``:
      ``(x - mean(x)) / sqrt(var(x) + epsilon)`` (a bias-free LayerNorm).
    over: ``"head"`` (the statistics of each head's ``H`` features) or
      ``"all"`` (of a token's ``N * H`` features, every head together).
    weight: ``"shared"`` (``[H]``), ``"per_head"`` (``[N, H]`` for queries,
      ``[K, H]`` for keys) or None (no weight).
    epsilon: added to the mean square (or variance), a positive number.
    weight_offset: the weight multiplies as ``weight_offset + w``: 0 (the
      weight itself) or 1 (Gemma's and Qwen3-Next's ``1 + w``).
    after_rope: normalise after the rotary embedding (Llama 4) instead of
      before it (every other model here).
    bias: a learned bias of the weight's shape, added after the weight
      (Phi-2's and Persimmon's ``nn.LayerNorm(H)``); needs a weight.

  Example:
    >>> QKNorm().kind, QKNorm().epsilon  # Qwen3's: RMSNorm per head, [H]
    ('rms', 1e-06)
    >>> x = jnp.array([[[[3.0, 4.0]]]])  # [B, N, T, H]
    >>> y = apply_qk_norm(x, None, QKNorm(weight=None))
    >>> bool(jnp.allclose(jnp.mean(y ** 2), 1.0, atol=1e-5))
    True
  """

  kind: str = "rms"
  over: str = "head"
  weight: str | None = "shared"
  epsilon: float = 1e-6
  weight_offset: float = 0.0
  after_rope: bool = False
  bias: bool = False

  def __post_init__(self):
    for name, value, allowed in (("kind", self.kind, KINDS),
                                 ("over", self.over, OVER),
                                 ("weight", self.weight, WEIGHTS)):
      if value not in allowed or isinstance(value, bool):
        raise ValueError(f"QKNorm {name} must be one of {list(allowed)}, got "
                         f"{value!r}.")
    for name in ("epsilon", "weight_offset"):
      value = getattr(self, name)
      if (isinstance(value, bool)
          or not isinstance(value, (int, float))
          or not math.isfinite(value)):
        raise TypeError(f"QKNorm {name} must be a finite Python number, got "
                        f"{value!r}.")
      object.__setattr__(self, name, float(value))
    if self.epsilon <= 0:
      raise ValueError(f"QKNorm epsilon must be positive (it keeps a zero "
                       f"vector finite), got {self.epsilon}.")
    if self.weight_offset not in (0.0, 1.0):
      raise ValueError(
          f"QKNorm weight_offset must be 0 (the weight multiplies) or 1 "
          f"(Gemma's 1 + weight), got {self.weight_offset}.")
    if self.weight is None and self.weight_offset:
      raise ValueError("QKNorm weight_offset=1 has no weight to offset with "
                       "weight=None: leave it 0.")
    for name in ("after_rope", "bias"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"QKNorm {name} must be a bool, got "
                        f"{getattr(self, name)!r}.")
    if self.bias and self.weight is None:
      raise ValueError("QKNorm bias=True adds a bias of the weight's shape, "
                       "and weight=None has none: pass weight='shared' ([H]) "
                       "or 'per_head' ([N, H]) with it, or bias=False.")

  def weight_shape(self, heads: int, head_dim: int) -> tuple[int, ...] | None:
    """The ``scale`` shape for a tensor of ``heads`` heads, or None."""
    if self.weight is None:
      return None
    return (head_dim,) if self.weight == "shared" else (heads, head_dim)

  def init_scale(self, heads: int, head_dim: int, dtype) -> jax.Array | None:
    """A new layer's weight: the identity (ones, or zeros under ``1 + w``)."""
    shape = self.weight_shape(heads, head_dim)
    if shape is None:
      return None
    fill = jnp.zeros if self.weight_offset else jnp.ones
    return fill(shape, dtype)

  def init_bias(self, heads: int, head_dim: int, dtype) -> jax.Array | None:
    """A new layer's bias (zeros), or None without ``bias=True``."""
    if not self.bias:
      return None
    return jnp.zeros(self.weight_shape(heads, head_dim), dtype)


def as_qk_norm(value) -> QKNorm | None:
  """``normalize_qk=`` as a ``QKNorm``: True is ``QKNorm()``, False None."""
  if value is None or value is False:
    return None
  if value is True:
    return QKNorm()
  if isinstance(value, QKNorm):
    return value
  raise TypeError(f"normalize_qk must be a bool or an aj.QKNorm(kind=, over=, "
                  f"weight=, epsilon=, weight_offset=, after_rope=, bias=), "
                  f"got {value!r} ({type(value).__name__}).")


# Each norm option: what it normalises, its params entries, the layout of
# their per-head weights, and init_multi_head_params' argument adding them.
OPTIONS = {
    "qk_norm": ("queries and keys", ("q_norm", "k_norm"),
                "[N, H] and k_norm [K, H]", "normalize_qk"),
    "value_norm": ("values", ("v_norm",), "[K, H]", "value_norm"),
    "output_norm": ("attention outputs", ("o_norm",), "[N, H]",
                    "output_norm"),
}


def as_norm(option: str, value) -> QKNorm | None:
  """``value_norm=`` or ``output_norm=``: None or a ``QKNorm`` that is not
  ``after_rope`` (values and outputs are never rotated)."""
  if option == "qk_norm":
    return as_qk_norm(value)
  if value is None:
    return None
  if not isinstance(value, QKNorm):
    raise TypeError(f"{option} must be None or an aj.QKNorm(kind=, over=, "
                    f"weight=, epsilon=, weight_offset=, bias=), got "
                    f"{value!r} ({type(value).__name__}).")
  if value.after_rope:
    raise ValueError(
        f"{option}={value} has after_rope=True, but the "
        f"{OPTIONS[option][0]} are never rotated (rope turns queries and "
        "keys): leave after_rope=False.")
  return value


def apply_qk_norm(x: jax.Array, scale: jax.Array | None, norm: QKNorm,
                  bias: jax.Array | None = None) -> jax.Array:
  """Normalises ``x [B, N, T, H]`` as ``norm`` says.

  Args:
    x: projected queries or keys (or values, attention outputs), ``[B, N,
      T, H]``.
    scale: the learned weight, ``[H]`` or ``[N, H]`` (as ``norm.weight``
      says), or None for ``weight=None``.
    norm: the ``QKNorm``.
    bias: the learned bias, the weight's shape (``norm.bias``), or None.

  Returns:
    ``norm(x) * (offset + scale) + bias``, ``[B, N, T, H]`` in ``x``'s
    dtype.
  """
  if norm.bias and bias is None:
    raise ValueError(f"{norm} has bias=True: pass its bias (the weight's "
                     "shape).")
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  y = x.astype(dtype)
  axes = (-1,) if norm.over == "head" else (1, 3)  # H, or N and H
  if norm.kind == "layer":
    y = y - jnp.mean(y, axis=axes, keepdims=True)
  y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=axes, keepdims=True)
                        + norm.epsilon)

  def per_head(w):  # [H] shared, or [N, H] one per head: vs [B, N, T, H]
    w = jnp.asarray(w, dtype)
    return w.reshape(1, 1, 1, -1) if w.ndim == 1 else w[None, :, None, :]

  if scale is not None:
    y = y * (per_head(scale) + norm.weight_offset)
  if norm.bias:
    y = y + per_head(bias)
  return y.astype(x.dtype)


def _refuse_unread(params, norm, option: str) -> None:
  """A weightless norm beside params weights, or a bias that the norm and
  the params disagree on."""
  _, names, per_head, _ = OPTIONS[option]
  name, entry = names[0], params.get(names[0], {})
  if norm.weight is None and "scale" in entry:
    raise ValueError(
        f"{option}={norm} has no weight, but params has {'/'.join(names)} "
        f"(scale {jnp.shape(entry['scale'])}), which it would ignore: drop "
        "them from params, or pass the QKNorm with weight='shared' ([H]) or "
        f"'per_head' ({per_head}).")
  if norm.bias != ("bias" in entry):
    has = "has a" if "bias" in entry else "has no"
    raise ValueError(
        f"{option}={norm} has bias={norm.bias}, but params['{name}'] {has} "
        f"'bias' entry: pass the QKNorm with bias={not norm.bias}, or "
        f"params {'with' if norm.bias else 'without'} "
        f"{'/'.join(names)} biases.")


def resolve(params, norm, option: str = "qk_norm") -> QKNorm | None:
  """The call's norm ``option`` checked against the weights it reads.

  Args:
    params: multi-head params, validated (``param_dims``).
    norm: the call's ``qk_norm=`` (an ``aj.QKNorm``, True, or None/False;
      the weights ``q_norm``/``k_norm``), ``value_norm=`` (``v_norm``) or
      ``output_norm=`` (``o_norm``): a ``QKNorm`` or None.
    option: ``"qk_norm"``, ``"value_norm"`` or ``"output_norm"``.

  Returns:
    ``norm``; with None, for ``qk_norm``, ``QKNorm()`` where the params
    hold shared ``[H]`` weights without biases (the default qk-norm), else
    None.

  Raises:
    ValueError: weights (or biases) the ``QKNorm`` would not read, or ones
      it needs that the params lack; weights with no norm saying how to use
      them (every ``v_norm``/``o_norm``; per-head or biased ``q_norm``).
  """
  norm = as_norm(option, norm)
  _, names, per_head, init_arg = OPTIONS[option]
  entry = params.get(names[0], {})
  scales = entry.get("scale")
  ndim = None if scales is None else len(jnp.shape(scales))
  if norm is None:
    if ndim is None:
      return None
    if option != "qk_norm":
      raise ValueError(
          f"params has {names[0]} (scale {jnp.shape(scales)}), which "
          f"{option}=None would ignore: pass {option}=aj.QKNorm(...) saying "
          "how the weight normalises (RMS or layer norm, per head or whole "
          f"width, epsilon), or drop params['{names[0]}'].")
    if ndim == 2 or "bias" in entry:
      weight = "per_head" if ndim == 2 else "shared"
      what = ("one weight per head" if ndim == 2
              else "with a bias (params['q_norm']['bias'])")
      raise ValueError(
          f"params['q_norm']['scale'] has shape {jnp.shape(scales)}, {what}"
          f": pass qk_norm=aj.QKNorm(weight={weight!r}, bias="
          f"{'bias' in entry}, ...) saying how it normalises (RMS or layer "
          "norm, per head or whole width, epsilon).")
    return QKNorm()
  _refuse_unread(params, norm, option)
  if norm.weight is not None:
    want = 1 if norm.weight == "shared" else 2
    if ndim != want:
      got = (f"no {'/'.join(names)}" if ndim is None
             else f"{names[0]} scale {jnp.shape(scales)}")
      layout = "[H]" if want == 1 else per_head
      raise ValueError(
          f"{option}={norm} reads weights {names[0]} {layout}, but params "
          f"has {got}: pass params with those weights (init_multi_head_"
          f"params(..., {init_arg}=the same QKNorm)), or a QKNorm whose "
          "weight matches them.")
  return norm


def rms_norm(x: jax.Array, scale: jax.Array, *,
             epsilon: float = RMS_NORM_EPSILON) -> jax.Array:
  """RMSNorm over the last (head) axis, computed in float32 (or float64).

  ``x / sqrt(mean(x**2) + epsilon) * scale``, as flax's ``nnx.RMSNorm``
  (the latent layer's norms, as ``multi_head.rms_norm``; the multi-head
  layer's are ``apply_qk_norm``).

  Args:
    x: ``[..., H]``.
    scale: ``[H]``, learned.
    epsilon: added to the mean square.

  Returns:
    ``[..., H]`` in ``x``'s dtype.

  Example:
    >>> y = rms_norm(jnp.array([[3.0, 4.0]]), jnp.ones(2))
    >>> bool(jnp.allclose(jnp.mean(y ** 2), 1.0, atol=1e-5))
    True
  """
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  x32 = x.astype(dtype)
  mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  scale = jnp.asarray(scale, dtype).reshape((1,) * (x.ndim - 1) + (-1,))
  return (x32 * jax.lax.rsqrt(mean_square + epsilon) * scale).astype(x.dtype)


def normalize(x: jax.Array, params, name: str, norm: QKNorm) -> jax.Array:
  """``apply_qk_norm`` with ``params[name]``'s weight and bias (``name``:
  ``q_norm``, ``k_norm``, ``v_norm`` or ``o_norm``)."""
  if norm.weight is None:
    return apply_qk_norm(x, None, norm)
  entry = params[name]
  return apply_qk_norm(x, entry["scale"], norm, entry.get("bias"))
