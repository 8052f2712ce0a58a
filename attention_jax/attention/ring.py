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
  the ``layout``'s order: query, key and value are this device's ``[...,
  T, H]``, ``[..., S, H]`` and ``[..., S, Hv]``. The result is this
  device's rows of attention over the global sequence, the numbers of
  ``blockwise_attention`` on the gathered arrays; the backward pass goes
  round the ring blockwise.

  Layouts (``attention_jax.kernels.ring_layout``): ``"contiguous"``
  shards the sequence as it is (device ``i`` holds rows ``[i*T, (i+1)*T)``;
  under a causal mask device ``P - 1`` does ``P`` times device 0's work);
  ``"zigzag"`` balances causal work: the global sequence is cut into
  ``2P`` chunks and device ``i`` holds chunks ``i`` and ``2P - 1 - i``.
  Under ``"zigzag"`` the inputs must already be in that order: this
  function runs inside your ``shard_map`` on one device's shard, so it
  cannot permute them, and natural-order shards give wrong numbers with no
  error. Permute tokens, positions, segment ids and labels once, before
  the model (``aj.zigzag(x, P)``, ``axis=-1`` for ``[B, T]``; a dense
  mask or bias on axis -2, then -1), and read outputs back with
  ``aj.unzigzag``; ``aj.SequenceParallel(layout="zigzag")``, which holds
  the whole arrays, permutes natural-order ones itself. The mask still
  speaks of global positions (causality, windows, lengths, rules and
  ``score_mod`` see where a token stands in the whole sequence), while
  dense mask and bias rows and columns are in the layout's order, like
  the tokens. Local ``T`` and ``S`` must then be even.

  Args:
    mask: None or an ``aj.Mask`` on the *global* sequence (``P*T``
      queries, ``P*S`` keys): ``causal`` and ``window`` are bottom-right
      aligned on the global lengths, and ring steps whose key block they
      rule out are not made at all (neither compute nor ``ppermute``);
      ``kv_lengths``/``q_lengths`` are global (replicated), within
      ``[0, P*S]`` / ``[0, P*T]`` (refused when concrete, e.g. closed over;
      traced ones, such as arrays passed into ``shard_map``, under
      ``aj.checked``); positions
      (``q_offset``/``kv_offset``) are those of the whole sequence's row 0
      and column 0 (traced ones make every ring step); a rule (or a
      ``BlockMask`` built for ``[P*T, P*S]``) sees global indices. Segment
      ids are this device's ``[T]``/``[B, T]`` and ``[S]``/``[B, S]`` (key
      ids travel round the ring with their keys). A dense mask holds this
      device's query rows and every key column, ``[..., T|1, P*S|1]``, in
      the layout's order (a key-padding mask ``[..., 1, P*S]`` replicated
      whole); each step slices the held block's columns.
    axis_name: the mesh axis the sequence is split over (``P`` devices).
    bias: float ``[..., T|1, P*S|1]``, laid out as the dense mask;
      differentiable (its gradient summed over the ring steps, and over the
      devices where its rows are shared).
    score_mod: called with *global* query and key indices; an
      ``aj.ScoreMod``'s arrays are replicated (their gradients summed over
      the devices). A plain function closing over traced values is
      refused: pass them as ``aj.ScoreMod(fn, params)``.
    sinks: per-head sink logits, replicated.
    block_q, block_k: the per-device flash blocks (as in
      ``blockwise_attention``).
    layout: ``"contiguous"`` or ``"zigzag"`` (above).

  Other arguments (scale, is_causal, return_lse, return_max_logits: lse
  and max_logits over the whole sequence), the return values and the
  errors: as ``aj.scaled_dot_product_attention`` (docs/options.md). No
  dropout, weights, ``implementation`` or ``partition``.

  Raises:
    ValueError: besides sdpa's: float64 operands, ``axis_name`` not bound
      (outside ``shard_map``), concrete lengths beyond the global ``P*S`` /
      ``P*T``, a dense mask or bias not ``[..., T|1,
      P*S|1]``, an unknown ``layout`` or odd local lengths under
      ``"zigzag"``, a ``BlockMask`` built for other than the global
      lengths, a ``score_mod`` closing over traced values.

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
