"""The attention kernels and their registry.

Each kernel is one file (``base.Kernel``: ``supports``, ``declines``,
``__call__`` on a validated ``base.Problem``). ``REGISTRY`` lists the ones
the automatic choice walks, in its order: the first that supports the
problem and does not decline it runs. ``Ring`` is not in it: it needs a
mesh axis (``aj.ring_attention``, or ``implementation=Ring(axis_name)``
inside ``jax.shard_map``).

Adding a kernel: one file with a ``base.Kernel`` subclass, one line here.
"""

from __future__ import annotations

from collections.abc import Sequence

from attention_jax.kernels.base import Kernel
from attention_jax.kernels.base import Problem
from attention_jax.kernels.cudnn import Cudnn
from attention_jax.kernels.dense import Dense
from attention_jax.kernels.flash import Flash
from attention_jax.kernels.pallas_gpu import PallasGpu
from attention_jax.kernels.ring import Ring
from attention_jax.kernels.splash import Splash

REGISTRY: tuple[Kernel, ...] = (
    Cudnn(),  # GPU only
    Splash(),  # TPU only
    PallasGpu(),  # GPU only
    Flash(),
    Dense(),
)

__all__ = ["REGISTRY", "Cudnn", "Dense", "Flash", "Kernel", "PallasGpu",
           "Problem", "Ring", "Splash", "by_name", "candidates", "choose"]


def by_name(name: str) -> Kernel:
  """The registered kernel called ``name``."""
  for kernel in REGISTRY:
    if kernel.name == name:
      return kernel
  raise ValueError(
      f"implementation must be None, a kernel, a sequence of them, or one of "
      f"{[k.name for k in REGISTRY]}, got {name!r}.")


def candidates(implementation) -> tuple[tuple[Kernel, ...], bool]:
  """``(kernels to try in order, automatic)`` for an ``implementation=``."""
  if implementation is None:
    return REGISTRY, True
  if isinstance(implementation, (str, Kernel)):
    implementation = (implementation,)
  if not isinstance(implementation, Sequence) or not implementation:
    raise ValueError(
        f"implementation must be None, a kernel name ({[k.name for k in REGISTRY]}), "
        f"a Kernel, or a non-empty sequence of them; got {implementation!r}.")
  kernels = []
  for item in implementation:
    if isinstance(item, str):
      item = by_name(item)
    if not isinstance(item, Kernel):
      raise TypeError(
          f"implementation entries must be kernel names or "
          f"attention_jax.kernels.Kernel instances, got {item!r}.")
    kernels.append(item)
  return tuple(kernels), False


def choose(kernels: Sequence[Kernel], problem: Problem,
           automatic: bool) -> Kernel:
  """The first kernel that takes ``problem``; else a ValueError with each
  kernel's reason."""
  reasons = []
  for kernel in kernels:
    reason = kernel.supports(problem)
    if reason is None and automatic:
      reason = kernel.declines(problem)
    if reason is None:
      return kernel
    reasons.append((kernel.name, reason))
  if len(reasons) == 1:
    name, reason = reasons[0]
    raise ValueError(f"implementation={name!r} is not possible: {reason}.")
  listed = "; ".join(f"{name}: {reason}" for name, reason in reasons)
  raise ValueError(f"no implementation takes this call ({listed}).")
