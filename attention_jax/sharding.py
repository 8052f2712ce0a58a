"""Head (tensor) parallelism: whole heads per device along one mesh axis.

Shape glossary: B batch, T query length, N query heads, K key/value heads,
H head dim, D model dim.

With a mesh axis ``head_axis`` of size M, the parameters are split along
their heads axis (Megatron-style, whole heads per device): ``W_q`` kernels
``[D, N, H]`` and biases ``[N, H]`` (and ``W_k``/``W_v``, ``[Dkv, K, H]``,
``[K, H]``) by ``N`` (``K``), ``W_o`` kernels ``[N, H, Dout]`` by ``N``; the
``W_o`` bias ``[Dout]`` and qk-norm scales ``[H]`` are replicated. Each
device then projects, attends and weights its own ``N/M`` heads with no
communication; the only collective is the sum of the partial ``W_o``
products (one all-reduce per attention call).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

_FREE = PartitionSpec.UNCONSTRAINED


def projection_specs(head_axis: str) -> dict[str, dict[str, tuple]]:
  """``{layer: {"kernel": spec, "bias": spec}}`` for ``W_q/W_k/W_v/W_o/W_g``.

  Each spec names the mesh axis per parameter axis: the heads axis of
  every kernel (``[D, N, H]``, ``[N, H, Dout]``) and bias (``[N, H]``) is
  split over ``head_axis``; the rest is replicated.

  Example:
    >>> projection_specs("model")["W_q"]
    {'kernel': (None, 'model', None), 'bias': ('model', None)}
  """
  split_heads = {"kernel": (None, head_axis, None), "bias": (head_axis, None)}
  return {"W_q": split_heads, "W_k": split_heads, "W_v": split_heads,
          "W_g": split_heads,  # the output gate [D, N, G], per head like W_q
          "W_o": {"kernel": (head_axis, None, None), "bias": (None,)}}


def mesh_axis_size(axis: str | None) -> int | None:
  """Size of ``axis`` in the current mesh (``jax.set_mesh``), else None."""
  if axis is None:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or axis not in mesh.axis_names:
    return None
  return mesh.shape[axis]


def check_heads_divide(num_heads: int, num_kv_heads: int,
                       head_axis: str | None) -> None:
  """ValueError unless both head counts divide the ``head_axis`` size."""
  size = mesh_axis_size(head_axis)
  if size is None:
    return
  for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
    if n % size:
      raise ValueError(
          f"{name}={n} is not divisible by the size {size} of mesh axis "
          f"{head_axis!r}: head parallelism keeps whole heads per device. "
          "Use a smaller model axis or more heads.")


def constrain_heads(x: jax.Array, head_axis: str | None) -> jax.Array:
  """Pins ``[B, N, T, H]`` heads to ``head_axis`` (batch left to the caller).

  A no-op without ``head_axis`` or outside a mesh that has it, so the same
  code runs unsharded.
  """
  if mesh_axis_size(head_axis) is None:
    return x
  mesh = jax.sharding.get_abstract_mesh()
  kind = mesh.axis_types[mesh.axis_names.index(head_axis)]
  if kind == jax.sharding.AxisType.Explicit:
    return x  # explicit axes carry the sharding in the types already
  spec = PartitionSpec(_FREE, head_axis, _FREE, None)
  return jax.lax.with_sharding_constraint(x, spec)
