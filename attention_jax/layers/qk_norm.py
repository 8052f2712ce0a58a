"""qk-norm: normalising the projected queries and keys, in all its published forms.

Shape glossary: B batch, T length, N heads of the tensor normalised (query
heads for ``q``, key/value heads ``K`` for ``k``), H head dim.

A model normalises its projected queries and keys so the logits cannot grow
without bound. The variants in use differ in five ways, each a field of one
``QKNorm`` value:

===============  ==========  ======  ==============  =========  ===========
model            kind        over    weight          offset     order
===============  ==========  ======  ==============  =========  ===========
Qwen3, Gemma 3   ``"rms"``   head    ``[H]`` shared  0 / 1      before rope
Qwen3-Next       ``"rms"``   head    ``[H]`` shared  1          before rope
OLMo 2           ``"rms"``   all     ``[N, H]``      0          before rope
Cohere           ``"layer"`` head    ``[N, H]``      0          before rope
Llama 4          ``"rms"``   head    none            -          after rope
===============  ==========  ======  ==============  =========  ===========

``over="head"`` normalises each head's ``H`` features; ``over="all"`` one
token's ``N * H`` features together (OLMo 2's RMSNorm over the whole
projection). A weight is one ``[H]`` scale shared by the heads
(``weight="shared"``), one per head (``"per_head"``, ``[N, H]``: a
whole-width ``[N * H]`` weight reshaped per head, as projection biases are),
or none. ``weight_offset=1`` multiplies by ``1 + w`` (Gemma's and
Qwen3-Next's norms store ``w`` around 0). The norm and its weight are
computed in float32 (float64 for float64 inputs) and cast back once; in
bfloat16 this differs by one rounding from models that cast to the input
dtype before the weight (Qwen3, OLMo 2), and equals those that cast last
(Gemma 3, Qwen3-Next, Cohere).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

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
  ``[N, H]`` / ``[K, H]``); ``weight=None`` has none.

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
    if not isinstance(self.after_rope, bool):
      raise TypeError(f"QKNorm after_rope must be a bool, got "
                      f"{self.after_rope!r}.")

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


def as_qk_norm(value) -> QKNorm | None:
  """``normalize_qk=`` as a ``QKNorm``: True is ``QKNorm()``, False None."""
  if value is None or value is False:
    return None
  if value is True:
    return QKNorm()
  if isinstance(value, QKNorm):
    return value
  raise TypeError(f"normalize_qk must be a bool or an aj.QKNorm(kind=, over=, "
                  f"weight=, epsilon=, weight_offset=, after_rope=), got "
                  f"{value!r} ({type(value).__name__}).")


def apply_qk_norm(x: jax.Array, scale: jax.Array | None,
                  norm: QKNorm) -> jax.Array:
  """Normalises ``x [B, N, T, H]`` as ``norm`` says.

  Args:
    x: projected queries or keys, ``[B, N, T, H]``.
    scale: the learned weight, ``[H]`` or ``[N, H]`` (as ``norm.weight``
      says), or None for ``weight=None``.
    norm: the ``QKNorm``.

  Returns:
    ``[B, N, T, H]`` in ``x``'s dtype.
  """
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  y = x.astype(dtype)
  axes = (-1,) if norm.over == "head" else (1, 3)  # H, or N and H
  if norm.kind == "layer":
    y = y - jnp.mean(y, axis=axes, keepdims=True)
  y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=axes, keepdims=True)
                        + norm.epsilon)
  if scale is not None:
    w = jnp.asarray(scale, dtype) + norm.weight_offset
    # [H] shared, or [N, H] one per head: either way against [B, N, T, H].
    w = w.reshape(1, 1, 1, -1) if w.ndim == 1 else w[None, :, None, :]
    y = y * w
  return y.astype(x.dtype)


def resolve(params, norm) -> QKNorm | None:
  """The call's ``QKNorm``, checked against the params' ``q_norm``/``k_norm``.

  Args:
    params: multi-head params, validated (``param_dims``).
    norm: the call's ``qk_norm=``: an ``aj.QKNorm``, True, or None/False.

  Returns:
    ``norm``; with None, ``QKNorm()`` where the params hold shared ``[H]``
    weights (the default qk-norm), else None.

  Raises:
    ValueError: weights the ``QKNorm`` would not read, or a weight it needs
      that the params lack, or per-head weights with no ``QKNorm`` saying
      how to use them.
  """
  norm = as_qk_norm(norm)
  scales = params.get("q_norm", {}).get("scale")
  ndim = None if scales is None else len(jnp.shape(scales))
  if norm is None:
    if ndim == 2:
      raise ValueError(
          f"params['q_norm']['scale'] has shape {jnp.shape(scales)}, one "
          "weight per head: pass qk_norm=aj.QKNorm(weight='per_head', ...) "
          "saying how it normalises (RMS or layer norm, per head or whole "
          "width, epsilon).")
    return None if ndim is None else QKNorm()
  if norm.weight is None and ndim is not None:
    raise ValueError(
        f"qk_norm={norm} has no weight, but params has q_norm/k_norm (scale "
        f"{jnp.shape(scales)}), which it would ignore: drop them from params, "
        "or pass the QKNorm with weight='shared' ([H]) or 'per_head' "
        "([N, H]).")
  if norm.weight is not None:
    want = 1 if norm.weight == "shared" else 2
    if ndim != want:
      got = ("no q_norm/k_norm" if ndim is None
             else f"q_norm scale {jnp.shape(scales)}")
      layout = "[H]" if want == 1 else "[N, H] and k_norm [K, H]"
      raise ValueError(
          f"qk_norm={norm} reads weights q_norm {layout}, but params has "
          f"{got}: pass params with those weights (init_multi_head_params("
          "..., normalize_qk=the same QKNorm)), or a QKNorm whose weight "
          "matches them.")
  return norm


def normalize(x: jax.Array, params, name: str, norm: QKNorm) -> jax.Array:
  """``apply_qk_norm`` with ``params[name]``'s weight (``name``: ``q_norm``
  or ``k_norm``)."""
  scale = None if norm.weight is None else params[name]["scale"]
  return apply_qk_norm(x, scale, norm)
