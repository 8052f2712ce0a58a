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

On a mesh with explicit axes (``jax.sharding.AxisType.Explicit``) the
shardings are part of the array types: ``constrain_heads`` has nothing to
pin, the per-head attention runs with those axes auto (``auto_like``: its
vmaps mix shardings explicit mode refuses), and the ``W_o`` head sum, which
contracts the sharded heads axis, names its output sharding
(``head_sum_sharding``), as explicit mode requires.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from attention_jax.kernels import base as kernel_base

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


def _axes(entry) -> tuple[str, ...]:
  """The mesh axis names of one ``PartitionSpec`` entry."""
  if entry is None or entry is _FREE:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def head_sum_sharding(heads: jax.Array,
                      kernel: jax.Array) -> NamedSharding | None:
  """``out_sharding`` of ``[B, N, T, H] x [N, H, Dout] -> [B, T, Dout]``.

  With explicit mesh axes on a contracted axis (``N`` or ``H``, e.g. heads
  split over ``head_axis``) JAX refuses to guess the output's sharding: the
  sum over devices is then named here, keeping the heads' ``B``/``T``
  sharding and the kernel's ``Dout`` one (dropped if it reuses one of
  theirs), so each device ends with its part of the summed output. None
  when no contracted axis is explicitly sharded (no mesh, auto axes): the
  einsum is then left as it is.

  Example:
    >>> head_sum_sharding(jnp.ones((2, 3, 5, 4)), jnp.ones((3, 4, 6))) is None
    True
  """
  h_sharding, k_sharding = (jax.typeof(x).sharding for x in (heads, kernel))
  h_spec, k_spec = tuple(h_sharding.spec), tuple(k_sharding.spec)
  h_spec += (None,) * (4 - len(h_spec))
  k_spec += (None,) * (3 - len(k_spec))
  contracted = [h_spec[1], h_spec[3], k_spec[0], k_spec[1]]
  if not any(_axes(entry) for entry in contracted):
    return None
  kept = [entry if _axes(entry) else None for entry in (h_spec[0], h_spec[2])]
  used = {axis for entry in kept for axis in _axes(entry)}
  dout = k_spec[2] if _axes(k_spec[2]) and not used & set(
      _axes(k_spec[2])) else None
  # The operands' (abstract) mesh: also outside a `jax.set_mesh` block.
  mesh = h_sharding.mesh if not h_sharding.mesh.empty else k_sharding.mesh
  return NamedSharding(mesh, PartitionSpec(*kept, dout))


def explicit_axes() -> tuple[str, ...]:
  """The current mesh's explicit axes (``AxisType.Explicit``), if any."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == jax.sharding.AxisType.Explicit)


def auto_like(fn, like: jax.Array):
  """``fn`` with the mesh's explicit axes made auto inside, outputs as ``like``.

  The kernels vmap one head's function over ``[B, N]`` operands that need
  not share a sharding (replicated sinks or a memory's keys beside queries
  split over batch and heads), which explicit axes refuse; with auto axes
  XLA places them, as on an auto mesh. Every output (rank >= 3, ``[B, N, T,
  ...]``) comes back sharded as ``like``'s ``[B, N, T]``. ``fn`` itself
  without explicit axes. The JAX arrays among the (positional) arguments'
  leaves move to the auto axes; the rest (functions, NumPy constants) is
  passed as it is.

  Example:
    >>> auto_like(jnp.negative, jnp.ones((1, 2, 3)))(jnp.ones(2)).tolist()
    [-1.0, -1.0]
  """
  axes = explicit_axes()
  if not axes:
    return fn
  spec = PartitionSpec(*tuple(jax.typeof(like).sharding.spec)[:3])

  def call(*args):
    leaves, tree = jax.tree.flatten(args)
    moved = [isinstance(x, jax.Array) for x in leaves]

    def inner(*arrays):
      arrays = iter(arrays)
      full = [next(arrays) if m else x for x, m in zip(leaves, moved)]
      return fn(*jax.tree.unflatten(tree, full))

    return jax.sharding.auto_axes(inner, axes=axes, out_sharding=spec)(
        *(x for x, m in zip(leaves, moved) if m))

  return call


def _names(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def attention_partition(head_axis: str | None, batch_axis, batch: int
                        ) -> kernel_base.Partition | None:
  """The ``aj.kernels.Partition`` a layer hands its attention function.

  Heads over ``head_axis``; the batch over ``batch_axis`` (a name or a
  tuple of names, ``()`` for none). ``batch_axis`` None (the default)
  with a ``head_axis``: the mesh's other axes, when the product of their
  sizes divides ``B`` (on a ``data x model`` mesh, ``data``), else none
  (XLA then gathers a fused kernel's operands along them). Axes that the
  current mesh lacks, or that are manual here (inside a ``jax.shard_map``
  over them: the arrays are one device's already), are left out, so the
  same layer runs unsharded, in a shard_map, or on a mesh without them.
  None when nothing is split. An explicit ``batch_axis`` whose sizes do
  not divide ``B`` is refused (by ``scaled_dot_product_attention``).

  Example:
    >>> attention_partition("model", None, 4) is None  # no mesh set
    True
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  usable = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
            if kind != jax.sharding.AxisType.Manual}
  heads = tuple(a for a in _names(head_axis) if a in usable)
  if batch_axis is None:
    if not head_axis:
      return None
    others = tuple(a for a in mesh.axis_names
                   if a in usable and a not in _names(head_axis))
    size = math.prod(mesh.shape[a] for a in others)
    batch_names = others if others and batch % size == 0 else ()
  else:
    batch_names = tuple(a for a in _names(batch_axis) if a in usable)
  if not heads and not batch_names:
    return None
  return kernel_base.Partition(batch=batch_names, heads=heads)


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
