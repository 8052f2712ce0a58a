"""``NativeSparseAttention``: NSA (Yuan et al. 2025) as a Flax NNX module.

Shape glossary: B batch, T tokens, D model width, N query heads, K key/value
heads, H head dim, L the compression block (``block``), M the compression
MLP's hidden width.

The module owns the parameters of ``aj.init_nsa_params`` as ``nnx.Param``s,
one holder per entry of its dict (``W_q.kernel [D, N, H]``, ``W_k_cmp``,
``W_v_cmp``, ``W_k_slc``, ``W_v_slc``, ``W_k_win``, ``W_v_win`` with
``kernel [D, K, H]``, ``phi_k``/``phi_v`` with ``position [L, H]``, ``W_1
[L, H, M]``, ``b_1 [M]``, ``W_2 [M, H]``, ``b_2 [H]``, ``W_g.kernel [D, N,
3]`` and ``.bias [N, 3]``, ``W_o.kernel [N, H, D]``; projection biases with
``use_bias``) and its settings; a call is ``aj.nsa_attention`` with them
(``layers/nsa.py`` has the maths).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.core import checks
from attention_jax.layers import nsa
from attention_jax.scores import rope as rope_lib


class _Entries(nnx.Module):
  """One entry of the params dict (``{"kernel", "bias"}``, or ``phi``'s
  five arrays), each an ``nnx.Param`` under its own name."""

  def __init__(self, arrays: Mapping[str, jax.Array]):
    self.names = nnx.static(tuple(sorted(arrays)))
    for name, value in arrays.items():
      setattr(self, name, nnx.Param(value))

  def as_dict(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in self.names}


class NativeSparseAttention(nnx.Module):
  """Native sparse attention: causal self-attention over compressed blocks,
  selected blocks and a sliding window, mixed by learned gates.

  Args:
    d_model: ``D``.
    num_heads: ``N``.
    num_kv_heads: ``K``, dividing ``N`` (the ``G = N / K`` query heads of a
      group share one selection).
    head_dim: ``H``.
    block: ``l``, the tokens a compressed block summarises (the paper's 32).
    stride: ``d``, the step between compressed blocks, dividing ``block``
      (16).
    select_block: ``l'``, a selection block's tokens, a multiple of
      ``stride`` (64).
    top_n: ``n``, the selection blocks a query reads, its first and local
      ones included (16).
    window: ``w``, the sliding window (512).
    local_blocks: the local selection blocks a query always keeps: its own
      and the ``local_blocks - 1`` before it (2).
    compress_hidden: ``M``, the compression MLP's hidden width (None:
      ``H``).
    rope: an ``aj.Rope`` for queries and keys (see ``aj.nsa_attention``),
      or None.
    implementation: the selected and sliding branches' kernel (any
      ``aj.scaled_dot_product_attention`` choice; ``"flash"`` walks only
      the selected blocks).
    block_q, block_k: the selection's blocks for the blockwise kernels
      (see ``aj.nsa_attention``; None: 64 and ``select_block``).
    use_bias: biases in the query, key/value and output projections.
    param_dtype: parameter dtype.
    rngs: ``nnx.Rngs`` (``params`` stream).

  Example:
    >>> nsa = NativeSparseAttention(16, 4, 2, 8, block=4, stride=2,
    ...                             select_block=4, top_n=3, window=4,
    ...                             rngs=nnx.Rngs(0))
    >>> nsa(jnp.ones((2, 12, 16))).shape
    (2, 12, 16)
    >>> nsa.phi_k.W_1.shape                               # [L, H, M]
    (4, 8, 8)
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int,
               head_dim: int, *, block: int = 32, stride: int = 16,
               select_block: int = 64, top_n: int = 16, window: int = 512,
               local_blocks: int = 2, compress_hidden: int | None = None,
               rope: rope_lib.Rope | None = None, implementation: Any = None,
               block_q: int | None = None, block_k: int | None = None,
               use_bias: bool = False, param_dtype: jnp.dtype = jnp.float32,
               rngs: nnx.Rngs):
    self.config = nsa.check_config(block, stride, select_block, top_n,
                                   window, local_blocks)
    self.rope = rope_lib.as_rope(rope)
    self.implementation = implementation
    for name, value in (("block_q", block_q), ("block_k", block_k)):
      if value is not None:
        checks.check_positive_int(name, value)
    self.block_q, self.block_k = block_q, block_k
    params = nsa.init_nsa_params(
        rngs.params(), d_model, num_heads, num_kv_heads, head_dim,
        block=block, stride=stride, select_block=select_block,
        compress_hidden=compress_hidden, use_bias=use_bias,
        dtype=param_dtype)
    self.dims = nsa.nsa_dims(params)
    for name, arrays in params.items():
      setattr(self, name, _Entries(arrays))

  def params_dict(self) -> nsa.Params:
    """The parameters in ``aj.init_nsa_params``' layout: ``aj.nsa_attention(
    module.params_dict(), x, **settings)`` is ``module(x)``."""
    return {name: getattr(self, name).as_dict() for name in nsa.LAYOUT}

  def load_params(self, params: Mapping[str, Mapping[str, Any]]) -> None:
    """Assigns a params dict of this module's entries and shapes (cast to
    each parameter's dtype).

    Raises:
      ValueError: naming the first entry or shape that differs.
    """
    nsa.nsa_dims(params)
    own = self.params_dict()
    for name, arrays in own.items():
      if set(params[name]) != set(arrays):
        raise ValueError(
            f"params['{name}'] has {sorted(params[name])}, but this "
            f"module's has {sorted(arrays)} (use_bias decides the "
            "projections' biases).")
      for entry, value in arrays.items():
        got = checks.shape_of(params[name][entry])
        if got != value.shape:
          raise ValueError(
              f"params['{name}']['{entry}'] has shape {got}, but this "
              f"module's is {value.shape} (sizes {self.dims}).")
    for name, arrays in params.items():
      holder = getattr(self, name)
      for entry, value in arrays.items():
        variable = getattr(holder, entry)
        variable[...] = jnp.asarray(value, variable.dtype)

  def __call__(self, x: ArrayLike, *, return_branches: bool = False):
    """``aj.nsa_attention`` of ``x [B, T, D]``: ``[B, T, D]`` (and the
    branches' parts with ``return_branches``)."""
    checks.check_module_input("x", x, self.dims.d_model, "d_model",
                              "[B, T, D]")
    return nsa.nsa_attention(
        self.params_dict(), x, **self.config._asdict(), rope=self.rope,
        implementation=self.implementation, block_q=self.block_q,
        block_k=self.block_k, return_branches=return_branches)
