"""``BahdanauAttention`` and ``LuongAttention``: decoder-over-encoder attention.

Shape glossary: B batch, T decoder steps, S encoder length, Dq query
(decoder state) features, Dk key (encoder state) features, Dv value
features, A hidden features.

Each module owns the parameters of one score as ``nnx.Param``s, named as in
the pure functions' params dicts (``W_q``, ``W_k``, ``v``, ``b`` for
Bahdanau; ``W``, ``v``, ``scale`` for Luong), and calls
``aj.additive_attention`` / ``aj.luong_attention``. ``precompute_keys`` gives
the step-independent key projection, which a decoder loop computes once per
sequence and passes back as ``projected_keys``.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.layers import additive
from attention_jax.layers import luong


class _DecoderAttention(nnx.Module):
  """Stores a params dict as ``nnx.Param`` attributes and gives it back."""

  _param_names: tuple[str, ...] = ()

  def _store(self, params: dict[str, jax.Array]) -> None:
    self._param_names = nnx.static(tuple(sorted(params)))
    for name, value in params.items():
      setattr(self, name, nnx.Param(value))

  def params_dict(self) -> dict[str, jax.Array]:
    """The parameters in the pure function's layout."""
    return {name: getattr(self, name)[...] for name in self._param_names}


class BahdanauAttention(_DecoderAttention):
  """Additive attention, ``e_j = v . tanh(q @ W_q + k_j @ W_k + b)``.

  Args:
    query_features: ``Dq``, decoder state size.
    key_features: ``Dk``, encoder state size.
    hidden_features: ``A``, alignment layer size.
    rngs: ``nnx.Rngs`` (``params`` stream).
    use_bias: include ``b``.
    param_dtype: parameter dtype.

  Example:
    >>> attn = BahdanauAttention(6, 4, 8, rngs=nnx.Rngs(0))
    >>> enc = jnp.ones((2, 5, 4))                 # [B, S, Dk]
    >>> keys = attn.precompute_keys(enc)          # once per sequence
    >>> ctx = attn(jnp.ones((2, 6)), enc, projected_keys=keys)  # one step
    >>> ctx, w = attn(jnp.ones((2, 6)), enc, return_weights=True)
    >>> ctx.shape, w.shape
    ((2, 4), (2, 5))
  """

  def __init__(self, query_features: int, key_features: int,
               hidden_features: int, *, rngs: nnx.Rngs, use_bias: bool = True,
               param_dtype: jnp.dtype = jnp.float32):
    self._store(additive.init_additive_params(
        rngs.params(), query_features, key_features, hidden_features,
        use_bias=use_bias, dtype=param_dtype))

  def precompute_keys(self, keys: ArrayLike) -> jax.Array:
    """``keys @ W_k + b``: ``[B, S, Dk] -> [B, S, A]``."""
    return additive.precompute_additive_keys(self.params_dict(), keys)

  def __call__(self, query: ArrayLike, keys: ArrayLike,
               values: ArrayLike | None = None, mask: ArrayLike | None = None,
               *, projected_keys: ArrayLike | None = None,
               return_weights: bool = False
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """See ``aj.additive_attention``: ``context`` (and the weights)."""
    return additive.additive_attention(
        self.params_dict(), query, keys, values, mask,
        projected_keys=projected_keys, return_weights=return_weights)


class LuongAttention(_DecoderAttention):
  """Luong attention with a ``dot``, ``general`` or ``concat`` score.

  Args:
    query_features: ``Dq``.
    key_features: ``Dk`` (equal to ``Dq`` for ``dot``).
    score: ``"dot"`` (``q . k``), ``"general"`` (``q @ W @ k``) or
      ``"concat"`` (``v . tanh([q; k] @ W)``).
    hidden_features: ``A`` for ``concat``.
    use_scale: learn a scalar multiplier of the scores (initialised to 1).
    scale: a fixed multiplier of the scores (e.g. ``1/sqrt(Dk)``).
    rngs: ``nnx.Rngs`` (``params`` stream).
    param_dtype: parameter dtype.

  Example:
    >>> attn = LuongAttention(4, 4, score="general", rngs=nnx.Rngs(0))
    >>> ctx, w = attn(jnp.ones((2, 3, 4)), jnp.ones((2, 5, 4)),
    ...               return_weights=True)
    >>> ctx.shape, w.shape
    ((2, 3, 4), (2, 3, 5))
  """

  def __init__(self, query_features: int, key_features: int, *,
               score: str = "dot", hidden_features: int | None = None,
               use_scale: bool = False, scale: float | None = None,
               rngs: nnx.Rngs, param_dtype: jnp.dtype = jnp.float32):
    self.score = score
    self.fixed_scale = scale  # "scale" is the learned Param's name
    self._store(luong.init_luong_params(
        rngs.params(), query_features, key_features, score=score,
        hidden_features=hidden_features, use_scale=use_scale,
        dtype=param_dtype))

  def precompute_keys(self, keys: ArrayLike) -> jax.Array:
    """The key side of the score, ``[B, S, Dk] -> [B, S, F]``."""
    return luong.precompute_luong_keys(self.params_dict(), keys,
                                       score=self.score)

  def __call__(self, query: ArrayLike, keys: ArrayLike,
               values: ArrayLike | None = None, mask: ArrayLike | None = None,
               *, projected_keys: ArrayLike | None = None,
               return_weights: bool = False
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """See ``aj.luong_attention``: ``context`` (and the weights)."""
    return luong.luong_attention(
        self.params_dict(), query, keys, values, mask, score=self.score,
        scale=self.fixed_scale, projected_keys=projected_keys,
        return_weights=return_weights)
