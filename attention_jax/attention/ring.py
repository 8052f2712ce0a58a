"""``ring_attention``: the sequence split across the devices of a mesh axis.

Shape glossary: T this device's query length, S this device's key/value
length, H head dim, Hv value head dim, P devices on the ring axis; ``...``
leading dims that broadcast.

``scaled_dot_product_attention`` with ``implementation=kernels.Ring(axis_name,
block_q, block_k, layout=layout)``, called inside ``jax.shard_map``, after
the mask of the whole sequence is put in this device's terms
(``Ring.localize``: positions, its lengths, the dense mask's and the bias's
columns); the algorithm is ``kernels/ring.py``, the layouts
``kernels/ring_layout.py``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.typing import ArrayLike

from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.kernels import ring
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import BlockMask
from attention_jax.masking.mask import Mask


def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    mask: Mask | BlockMask | None = None,
    *,
    axis_name: str,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: ArrayLike | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    return_max_logits: bool = False,
    layout: str = "contiguous",
) -> jax.Array | tuple[jax.Array, ...]:
  """Attention over a sequence split across the devices of ``axis_name``.

  Call inside ``jax.shard_map`` (or anything that binds ``axis_name``), with
  the query and key/value sequence dimension sharded over that axis in
  the ``layout``'s order; the result is this device's rows of full
  attention over the global sequence. Numbers match
  ``blockwise_attention`` on the gathered arrays.

  Layouts (``attention_jax.kernels.ring_layout``): ``"contiguous"``
  shards the sequence as it is (device ``i`` holds rows ``[i*T, (i+1)*T)``;
  under a causal mask device ``P - 1`` does ``P`` times device 0's work);
  ``"zigzag"`` balances causal work: the global sequence is cut into
  ``2P`` chunks and device ``i`` holds chunks ``i`` and ``2P - 1 - i``.
  The caller permutes tokens, positions, segment ids and labels once,
  before the model (``ring_layout.zigzag(x, P)``, ``axis=-1`` for
  ``[B, T]``; ``unzigzag`` after); the mask still speaks of global
  positions (causality, windows, lengths, rules and ``score_mod`` see
  where a token stands in the whole sequence), while dense mask and bias
  rows and columns are in the layout's order, like the tokens. Local
  ``T`` and ``S`` must then be even.

  Args:
    query: float ``[..., T, H]``, this device's queries.
    key: float ``[..., S, H]``, this device's keys (4-D ``[B, K, S, H]``
      with ``K`` dividing the query heads ``N``: grouped-query attention).
    value: float ``[..., S, Hv]``.
    mask: None or an ``aj.Mask`` on the *global* sequence (``P*T``
      queries, ``P*S`` keys): ``causal`` and ``window`` are bottom-right
      aligned on the global lengths, and ring steps whose key block they
      rule out are not made at all (neither their compute nor their
      ``ppermute``: a causal window within one neighbour's block costs one
      shift instead of ``P - 1``); ``kv_lengths``/``q_lengths`` are global
      lengths (replicated); segment ids are this device's ``[T]``/``[B,
      T]`` and ``[S]``/``[B, S]`` (sharded like the queries and keys; key
      ids travel round the ring with their keys); a rule (or a
      ``BlockMask`` built for ``[P*T, P*S]``) is evaluated on global
      indices in every block a device visits. Positions
      (``q_offset``/``kv_offset``) are those of the whole sequence's row 0
      and column 0, as in any mask (causality, windows, rules and
      ``score_mod`` then compare and see positions); traced ones make
      every ring step. A dense mask (``dense``) holds this device's query
      rows and every key column, ``[..., T|1, P*S|1]`` (rows sharded like
      the queries, or size 1; columns all the keys in the layout's order,
      replicated: a key-padding mask ``[..., 1, P*S]`` is replicated
      whole); each step slices the held block's columns, nothing travels.
      This device's part of the mask is made once
      (``aj.kernels.Ring.localize``): its positions travel round the ring
      with its keys.
    axis_name: the mesh axis the sequence is split over (``P`` devices).
    bias: float ``[..., T|1, P*S|1]``, laid out as the dense mask (this
      device's query rows, every key column); differentiable: its
      gradient is the sum of the ring steps' column windows (summed over
      the devices too where its rows are shared, replicated).
    scale: defaults to ``1/sqrt(H)``.
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``.
    score_mod: as in ``blockwise_attention``, called with *global* query
      and key indices; a ``ScoreMod``'s arrays are replicated (their
      gradients are summed over the devices). A plain function closing over
      traced values is refused: pass them as ``aj.ScoreMod(fn, params)``.
    sinks: per-head sink logits (replicated), as in ``blockwise_attention``.
    block_q, block_k: block sizes of the per-device blockwise computation.
    return_lse: also return the global log-sum-exp of each query row.
    return_max_logits: also return each query row's largest raw logit
      ``scale * q . k`` over every key of the global sequence it attends to
      (before ``score_mod`` and sinks; see
      ``scaled_dot_product_attention``), the max over the ring steps.
    layout: ``"contiguous"`` or ``"zigzag"`` (above).

  Returns:
    ``output [..., T, Hv]`` in the inputs' dtype, then ``lse [..., T]``
    with ``return_lse`` and ``max_logits [..., T]`` with
    ``return_max_logits``, in that order (float32). Differentiable in
    query, key, value, bias, sinks and ``score_mod``'s arrays (through
    ``lse`` too; ``max_logits`` has no gradient); the backward pass goes
    round the ring blockwise.

  Raises:
    ValueError: float64 operands, ``axis_name`` is not bound (not inside
      ``shard_map``), a dense mask or bias not ``[..., T|1, P*S|1]``, an
      unknown ``layout`` or odd local lengths under ``"zigzag"``, a
      ``BlockMask`` built for other than the global lengths, a
      ``score_mod`` closing over traced values, or operand shapes do not
      fit (as for ``blockwise_attention``).
    TypeError: non-float operands, non-integer lengths.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("seq",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> x = jnp.ones((2, 64, 16))  # [B, T, H], T split over "seq"
    >>> ring = jax.shard_map(
    ...     lambda q, k, v: ring_attention(q, k, v, axis_name="seq"),
    ...     mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    >>> ring(x, x, x).shape
    (2, 64, 16)
  """
  kernel = ring.Ring(axis_name, block_q, block_k, layout=layout)
  checks.check_static_bool("is_causal", is_causal)
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  q_shape, k_shape = checks.shape_of(query), checks.shape_of(key)
  if len(q_shape) >= 2 and len(k_shape) >= 2:  # (else the checks say so)
    mask, score_mod, kernel = kernel.localize(
        mask, score_mod, q_shape[-2], k_shape[-2], q_shape[:-2], bias=bias)
    bias = None  # (in the kernel now: it covers every key column)
  out, _, lse, max_logits = dot_product.run(
      query, key, value, mask, bias=bias, scale=scale, score_mod=score_mod,
      sinks=sinks, return_lse=return_lse,
      return_max_logits=return_max_logits, implementation=kernel)
  extra = (lse,) * bool(return_lse) + (max_logits,) * bool(return_max_logits)
  return (out, *extra) if extra else out
