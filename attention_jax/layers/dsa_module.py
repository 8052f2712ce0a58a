"""``LightningIndexer``: DeepSeek Sparse Attention's token selector in NNX.

Shape glossary: B batch, N query heads, K key/value heads, T queries, S
keys (``S = T``), H the main attention's head dim, D model width, J
indexer heads, E the indexer head dim, k the tokens a query keeps.

The module owns the indexer's parameters as ``nnx.Param``s in the holders
the attention modules use, named as ``init_indexer_params``' dict
(``W_q.kernel [D, J, E]``, ``W_k.kernel [D, E]``, ``W_w.kernel [D, J]``,
``k_norm.scale``/``k_norm.bias [E]``) and calls ``layers/dsa.py``: a
call returns each query's top-``k`` tokens and their selection (an
``aj.BlockMask`` for the main attention's mask), ``loss`` the KL loss that
trains it (gradients reach only these parameters).
"""

from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.layers import dsa
from attention_jax.layers.multi_head_holders import NormScale
from attention_jax.layers.multi_head_holders import Projection
from attention_jax.layers.multi_head_holders import assign_params
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask
from attention_jax.scores import rope as rope_lib

_LECUN_NORMAL = nnx.initializers.lecun_normal()  # nnx.Linear's default


class LightningIndexer(nnx.Module):
  """DSA's lightning indexer: which ``top_k`` tokens each query reads.

  ``I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])`` from ``x`` (detached),
  causal top-``k`` per query, shared by every head of the main attention
  (``layers/dsa.py`` has the formulas, the constants and what is refused).

  Args:
    d_model: ``D``.
    num_heads: ``J`` indexer heads.
    head_dim: ``E`` (the paper's ``Hi``).
    top_k: ``k`` tokens per query.
    chunk: queries scored at a time (memory ``O(J * chunk * S)``); None:
      all at once.
    rngs: ``nnx.Rngs`` (``params`` stream).
    k_norm: a LayerNorm of the indexer keys (DeepSeek's).
    rope: an ``aj.Rope`` rotating the indexer's queries and keys (DeepSeek:
      a partial one, e.g. ``aj.Rope(fraction=0.5)``), or None.
    block_q, block_k: the selection's blocks (``dsa_selection``): give the
      flash kernel the same ones.
    param_dtype: parameter dtype.
    kernel_init: the kernels' initialiser (LeCun normal), called on the flat
      ``[D, J * E]``, ``[D, E]``, ``[D, J]`` as ``init_indexer_params``.

  Example:
    >>> indexer = LightningIndexer(16, 4, 8, top_k=2, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    >>> indices, selection = indexer(x)
    >>> indices.shape, selection.batch_shape
    ((2, 5, 2), (2, 1))
    >>> mha = aj.MultiHeadAttention(16, 2, rngs=nnx.Rngs(2))
    >>> y = mha(x, mask=aj.Mask(causal=True, rule=selection))
    >>> q = k = jax.random.normal(jax.random.key(3), (2, 2, 5, 8))
    >>> float(indexer.loss(x, q, k, scale=8 ** -0.5, indices=indices)) >= 0
    True
  """

  def __init__(self, d_model: int, num_heads: int, head_dim: int, *,
               top_k: int, chunk: int | None = None, rngs: nnx.Rngs,
               k_norm: bool = True, rope: rope_lib.Rope | None = None,
               block_q: int = 64, block_k: int = 64,
               param_dtype: jnp.dtype = jnp.float32,
               kernel_init: nnx.Initializer = _LECUN_NORMAL):
    checks.check_positive_int("top_k", top_k)
    if chunk is not None:
      checks.check_positive_int("chunk", chunk)
    checks.check_positive_int("block_q", block_q)
    checks.check_positive_int("block_k", block_k)
    self.top_k, self.chunk = top_k, chunk
    self.rope = rope_lib.as_rope(rope)
    self.block_q, self.block_k = block_q, block_k
    for name, value in (("d_model", d_model), ("num_heads", num_heads),
                        ("head_dim", head_dim)):
      checks.check_positive_int(name, value)
    checks.check_static_bool("k_norm", k_norm)
    self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
    shapes = {"W_q": ((d_model,), (num_heads, head_dim)),
              "W_k": ((d_model,), (head_dim,)),
              "W_w": ((d_model,), (num_heads,))}
    for name, (fan_in, out) in shapes.items():
      setattr(self, name, Projection(
          fan_in, out, use_bias=False, param_dtype=param_dtype,
          kernel_init=kernel_init, bias_init=None, rngs=rngs))
    self.k_norm = (NormScale(head_dim, param_dtype=param_dtype, bias=True)
                   if k_norm else nnx.data(None))

  def _layers(self) -> dict[str, Projection | NormScale]:
    return {name: getattr(self, name) for name in dsa.LAYOUT
            if getattr(self, name) is not None}

  def params_dict(self) -> dsa.Params:
    """The parameters in ``init_indexer_params``' layout."""
    return {name: layer.as_dict() for name, layer in self._layers().items()}

  def load_params(self, params) -> None:
    """Assigns a params dict (``init_indexer_params``' layout, this
    module's entries and shapes; cast to ``param_dtype``).

    Raises:
      ValueError: naming the first entry that differs from the module's.
    """
    assign_params(self._layers(), params, dsa.LAYOUT,
                  entries=f"k_norm={self.k_norm is not None}",
                  sizes=f"d_model={self.d_model}, num_heads="
                        f"{self.num_heads}, head_dim={self.head_dim}")

  def __call__(self, x: ArrayLike, *, mask: Mask | None = None,
               positions: ArrayLike | None = None
               ) -> tuple[jax.Array, BlockMask]:
    """Each query's tokens: ``(indices [B, T, k], selection)``.

    ``indices`` is ``aj.indexer_top_k``'s (``-1`` where fewer are visible),
    ``selection`` its ``aj.dsa_selection`` over ``S = T`` keys: pass
    ``aj.Mask(causal=True, rule=selection)`` (with the main attention's
    other fields, the same ones given here as ``mask``) to the main layer.
    """
    indices = dsa.indexer_top_k(self.params_dict(), x, self.top_k,
                                chunk=self.chunk, mask=mask, rope=self.rope,
                                positions=positions)
    selection = dsa.dsa_selection(indices, indices.shape[1],
                                  block_q=self.block_q, block_k=self.block_k)
    return indices, selection

  def scores(self, x: ArrayLike, *, mask: Mask | None = None,
             positions: ArrayLike | None = None) -> jax.Array:
    """``aj.indexer_scores`` ``[B, T, S]`` (to inspect; ``O(T * S)``)."""
    return dsa.indexer_scores(self.params_dict(), x, chunk=self.chunk,
                              mask=mask, rope=self.rope, positions=positions)

  def loss(self, x: ArrayLike, q: ArrayLike, k: ArrayLike, *,
           scale: Any, indices: ArrayLike | None = None,
           mask: Mask | None = None,
           positions: ArrayLike | None = None) -> jax.Array:
    """``aj.indexer_loss``: the dense warm-up (``indices=None``) or the
    sparse stage over ``indices``; ``q``/``k``/``scale`` the main
    attention's. Gradients reach only this module's parameters."""
    return dsa.indexer_loss(self.params_dict(), x, q, k, scale=scale,
                            indices=indices, chunk=self.chunk, mask=mask,
                            rope=self.rope, positions=positions)
