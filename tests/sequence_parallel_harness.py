"""Sequence-parallel attention on global arrays, for the kernel contract.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim (all global: the harness shards them).

Each harness has the contract of ``tests/contract.py``'s ``_ring``:
``harness(query, key, value, mask_parts, **kw)`` takes the whole call's
``[B, N, T, H]`` / ``[B, K, S, H]`` operands, the case's ``aj.Mask`` fields
(``mask_parts``, written for the whole sequence) and
``scaled_dot_product_attention``'s keywords (``bias``, ``sinks``,
``score_mod``, ``return_lse``, ``return_max_logits``), runs the call inside
``jax.shard_map`` with the sequence split over ``contract.RING_DEVICES``
devices, and returns the global outputs. The mask's arrays enter as
operands (segment ids sharded like the sequence, a dense mask and the bias
by rows when they have ``T`` rows, the rest replicated); its structure and
rule stay closed over. With ``layout="zigzag"`` the harness permutes the
tokens (and segment ids, dense rows and columns) into the layout before
``shard_map`` and the outputs back after, inside the differentiated
function, so gradients compare with the reference as they are.

``ulysses`` is the contract's column (all-to-all over 4 devices, the
automatic kernel per device); ``make`` builds others: a kernel per device
(``implementation=``), the hybrid (``rings=2``: 2 groups of 2 devices, a
ring across them) or the zigzag layout.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from attention_jax.attention import ulysses as ulysses_lib
from attention_jax.kernels import ring_layout

_SEQUENCE = ("q_segment_ids", "kv_segment_ids")
_REPLICATED = ("q_lengths", "kv_lengths", "q_offset", "kv_offset")


def make(*, rings: int = 1, layout: str = "contiguous",
         implementation=None, block_q=None, block_k=None, devices=None,
         check_vma: bool = True):
  """A harness over ``devices`` (default ``contract.RING_DEVICES``): the
  all-to-all over ``devices / rings`` of them, a ring over ``rings``
  groups (``rings > 1``: the hybrid), ``layout`` and the per-device
  kernel or the ring's block sizes as in ``aj.ulysses_attention``;
  ``check_vma`` is ``jax.shard_map``'s."""
  return functools.partial(_run, rings=rings, layout=layout,
                           implementation=implementation, block_q=block_q,
                           block_k=block_k, devices=devices,
                           check_vma=check_vma)


def _run(query, key, value, mask_parts, *, rings, layout, implementation,
         block_q, block_k, devices, check_vma, pages=None, **kw):
  if pages is not None:  # (the contract's paged cases)
    raise ValueError(
        "ulysses_attention takes no paged cache: a paged call attends one "
        "step's queries over pages every device would need whole; run it "
        "with the heads or batch split instead.")
  if devices is None:
    from tests import contract  # (contract may import this module)
    devices = contract.RING_DEVICES
  groups = devices // rings
  names = ("seq",) if rings == 1 else ("ring", "seq")
  mesh = jax.make_mesh((groups,) if rings == 1 else (rings, groups), names,
                       devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  axis = names[0] if rings == 1 else names  # the sequence's, ring major
  seq = P(None, None, axis)  # [B, N, T, H], and [B, N, T] lse, max logits
  t, s = query.shape[-2], key.shape[-2]
  zig = (rings if rings > 1 else groups) if layout == "zigzag" else None
  if zig is not None and (t % (2 * zig) or s % (2 * zig)):
    zig = None  # unpermuted: the attention function refuses the lengths
  return_lse = kw.pop("return_lse", False)
  return_max_logits = kw.pop("return_max_logits", False)
  returned = 1 + return_lse + return_max_logits
  arrays = {n: x for n, x in mask_parts.items()
            if n in _SEQUENCE + _REPLICATED + ("dense",) and x is not None}
  fixed = {n: x for n, x in mask_parts.items() if n not in arrays}
  if "bias" in kw:
    arrays["bias"] = kw.pop("bias")
  if zig is not None:  # the caller's permutation, once
    query, key, value = (ring_layout.zigzag(x, zig) for x in (query, key,
                                                             value))
    for n in _SEQUENCE:
      if n in arrays:
        arrays[n] = ring_layout.zigzag(arrays[n], zig, axis=-1)
    for n in ("dense", "bias"):
      if n in arrays:
        for ax in (-2, -1):
          if arrays[n].shape[ax] > 1:
            arrays[n] = ring_layout.zigzag(arrays[n], zig, axis=ax)

  def spec(name, x):
    if name in _SEQUENCE:
      return P(*(None,) * (x.ndim - 1), axis)
    if name in ("dense", "bias") and x.shape[-2] == t:
      return P(None, None, axis, None)  # this device's rows, every key
    return P()

  specs = {n: spec(n, x) for n, x in arrays.items()}

  # What the keywords hold enters as operands (replicated) where it is an
  # array; functions (a plain score_mod) stay closed over.
  leaves, treedef = jax.tree.flatten(kw)
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
  shared = [x for x, a in zip(leaves, is_array) if a]

  def local(q, k, v, arrays, shared):
    shared = iter(shared)
    kw = jax.tree.unflatten(treedef, [next(shared) if a else x
                                      for x, a in zip(leaves, is_array)])
    parts = {**fixed, **{n: x for n, x in arrays.items() if n != "bias"}}
    mask = aj.Mask(**parts) if any(
        x is not None and x is not False for x in parts.values()) else None
    return ulysses_lib.ulysses_attention(
        q, k, v, mask, axis_name="seq", ring_axis=None if rings == 1
        else "ring", layout=layout, bias=arrays.get("bias"),
        implementation=implementation, block_q=block_q, block_k=block_k,
        return_lse=return_lse, return_max_logits=return_max_logits, **kw)

  result = jax.shard_map(
      local, mesh=mesh, in_specs=(seq, seq, seq, specs, [P()] * len(shared)),
      out_specs=(seq,) * returned if returned > 1 else seq,
      check_vma=check_vma)(
          query, key, value, arrays, shared)
  if zig is None:
    return result
  result = result if returned > 1 else (result,)
  result = tuple(ring_layout.unzigzag(x, zig, axis=-2 if x.ndim == 4 else -1)
                 for x in result)
  return result if returned > 1 else result[0]


# The contract's column: 4 devices, the automatic kernel on each.
ulysses = make()
