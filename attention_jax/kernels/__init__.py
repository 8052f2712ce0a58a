"""The attention kernels, their registry, and what a kernel is written with.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim; ``...`` leading dims.

Each kernel is one file (``base.Kernel``: ``supports``, ``declines``,
``__call__`` on a validated ``base.Problem``). ``REGISTRY`` lists the ones
the automatic choice walks, in its order: the first that supports the
problem and does not decline it runs. ``Ring`` is not in it: it needs a
mesh axis and this device's positions (``aj.ring_attention``, or
``implementation=Ring(axis_name)`` with ``Ring.localize``'s mask, inside
``jax.shard_map``). A kernel's ``name`` is its class's, lower case
(``Flash`` is ``"flash"``, ``aj.blockwise_attention``'s kernel); one
name per kernel.

A kernel written outside the library needs only the names here (see "Writing
a kernel" in the usage docs): ``Kernel`` and ``Problem``; ``lift_heads``
runs a single-head function over the leading dims, giving it a ``Head`` of
that head's operands; ``allowed`` is where the head's mask lets a query see
a key; ``zero_unseen`` keeps padding's NaN out of the products,
``with_sink`` applies a sink, ``masked_softmax`` / ``masked_logsumexp``
hold the fully-masked-row policy; ``no_weights_or_dropout``,
``no_max_logits`` and ``float32_only`` are the refusals the library's
kernels share (``Kernel.float64 = False`` has the choice refuse float64
inputs with ``float32_only``'s reason; ``Kernel.min_scores`` has it pass
over calls below that many scores per head). ``Partition`` says how a
call's batch and heads are split over mesh axes (``partition=``): a kernel
with ``partitionable = False`` (one Pallas call) then runs per shard
(``per_shard``).
``register`` adds a kernel to the automatic choice
(``with register(kernel):`` for a scope), ``unregister`` removes it.
"""

from __future__ import annotations

import jax.numpy as jnp

from attention_jax.core.checks import compute_dtype
from attention_jax.core.checks import with_sink
from attention_jax.core.checks import zero_unseen
from attention_jax.core.softmax import masked_logsumexp
from attention_jax.core.softmax import masked_softmax
from attention_jax.kernels import base
from attention_jax.kernels.autotune import Tuned
from attention_jax.kernels.autotune import autotune
from attention_jax.kernels.autotune import flash_blocks
from attention_jax.kernels.base import MASK_FIELDS
from attention_jax.kernels.base import MIN_SCORES
from attention_jax.kernels.base import OPTIONS
from attention_jax.kernels.base import Head
from attention_jax.kernels.base import Kernel
from attention_jax.kernels.base import Operands
from attention_jax.kernels.base import Pages
from attention_jax.kernels.base import Partition
from attention_jax.kernels.base import Problem
from attention_jax.kernels.base import Result
from attention_jax.kernels.base import choose
from attention_jax.kernels.base import float32_only
from attention_jax.kernels.base import lift_heads
from attention_jax.kernels.base import no_max_logits
from attention_jax.kernels.base import no_weights_or_dropout
from attention_jax.kernels.base import undeclared
from attention_jax.kernels.base import verdicts
from attention_jax.kernels.block_cache import FlashBlocks
from attention_jax.kernels.cudnn import Cudnn
from attention_jax.kernels.dense import Dense
from attention_jax.kernels.flash import Flash
from attention_jax.kernels.gathered import Gathered
from attention_jax.kernels.paged_gpu import PagedGpu
from attention_jax.kernels.paged_tpu import PagedTpu
from attention_jax.kernels.pallas_gpu import PallasGpu
from attention_jax.kernels.ring import Ring
from attention_jax.kernels.splash import Splash
from attention_jax.masking import intervals

# Rebound (never mutated) by register/unregister: a tuple read through the
# module, so the automatic choice sees every registration.
REGISTRY: tuple[Kernel, ...] = (
    Cudnn(),  # GPU only
    Splash(),  # TPU only
    PagedTpu(),  # TPU only: a paged cache's decoding step
    PagedGpu(),  # GPU only: a paged cache's decoding step
    PallasGpu(),  # GPU only
    Gathered(),  # token selections only: each query's chosen keys
    Flash(),
    Dense(),
)

__all__ = ["MASK_FIELDS", "MIN_SCORES", "OPTIONS", "REGISTRY", "Cudnn", "Dense",
           "Flash", "FlashBlocks", "Gathered", "Head", "Kernel", "Operands",
           "PagedGpu", "PagedTpu",
           "Pages",
           "PallasGpu", "Partition",
           "Problem",
           "Registration", "Result", "Ring", "Splash", "Tuned",
           "allowed", "autotune", "by_name",
           "candidates", "choose", "compute_dtype", "flash_blocks",
           "float32_only",
           "lift_heads", "masked_logsumexp", "masked_softmax",
           "no_max_logits", "no_weights_or_dropout", "register",
           "undeclared", "unregister", "verdicts", "with_sink", "zero_unseen"]


def _names() -> list[str]:
  return [k.name for k in REGISTRY]


def by_name(name: str) -> Kernel:
  """The registered kernel called ``name``."""
  return base.by_name(name, REGISTRY)


def candidates(implementation) -> tuple[tuple[Kernel, ...], bool]:
  """``(kernels to try in order, automatic)`` for an ``implementation=``
  (``base.candidates`` over ``REGISTRY``)."""
  return base.candidates(implementation, REGISTRY)


class Registration:
  """A kernel's place in ``REGISTRY``; ``with`` unregisters it on exit."""

  def __init__(self, kernel: Kernel):
    self.kernel = kernel

  def __enter__(self) -> Kernel:
    return self.kernel

  def __exit__(self, *exc) -> None:
    unregister(self.kernel.name)

  def __repr__(self):
    return f"Registration({self.kernel!r})"


def register(kernel: Kernel, *, before: str | None = None) -> Registration:
  """Adds ``kernel`` to the automatic choice (``REGISTRY``).

  Args:
    kernel: an instance of a ``Kernel`` subclass whose ``name`` no
      registered kernel has.
    before: the name of the registered kernel it is tried before; None
      tries it first. (``"dense"`` takes every call, so a kernel after it
      never runs automatically.)

  Returns:
    A ``Registration``: ``with register(kernel): ...`` unregisters it when
    the block ends (what tests do); otherwise it stays until
    ``unregister(kernel.name)``. While registered, ``implementation=`` also
    takes its name.

  Raises:
    TypeError: ``kernel`` is not a ``Kernel`` instance (e.g. the class).
    ValueError: its name is taken, or ``before`` names no registered
      kernel.

  Example:
    >>> class Mine(aj.kernels.Dense):
    ...   name = "mine"
    >>> with aj.kernels.register(Mine(), before="dense"):
    ...   [k.name for k in aj.kernels.REGISTRY][-2:]
    ['mine', 'dense']
    >>> "mine" in [k.name for k in aj.kernels.REGISTRY]
    False
  """
  global REGISTRY
  if not isinstance(kernel, Kernel):
    hint = (" (the class: pass an instance, e.g. Mine())"
            if isinstance(kernel, type) else "")
    raise TypeError(f"register takes an attention_jax.kernels.Kernel "
                    f"instance, got {kernel!r}{hint}.")
  name = kernel.name
  if not isinstance(name, str) or not name or name == Kernel.name:
    raise ValueError(f"kernel {kernel!r} needs its own name (a class "
                     f"attribute name = \"...\"), got {name!r}.")
  if name in _names():
    raise ValueError(
        f"a kernel named {name!r} is already registered (names: "
        f"{_names()}): give yours another name, "
        "or unregister the other first.")
  at = 0
  if before is not None:
    if before not in _names():
      raise ValueError(f"before must name a registered kernel, one of "
                       f"{_names()}, got {before!r}.")
    at = _names().index(before)
  REGISTRY = REGISTRY[:at] + (kernel,) + REGISTRY[at:]
  return Registration(kernel)


def unregister(name: str | Kernel) -> Kernel:
  """Removes the kernel called ``name`` (or that kernel) from ``REGISTRY``;
  returns it (``register(kernel)`` puts it back, first)."""
  global REGISTRY
  name = name.name if isinstance(name, Kernel) else name
  if name not in _names():
    raise ValueError(f"no registered kernel is called {name!r} (names: "
                     f"{_names()}).")
  kernel = REGISTRY[_names().index(name)]
  REGISTRY = tuple(k for k in REGISTRY if k is not kernel)
  return kernel


def allowed(ops: Operands, head: Head, t: int, s: int):
  """Where one head's query may see a key: bool ``[T, S]``, or None (all).

  Every mask field of the call (the dense mask, causality and the window
  bottom-right aligned, query and key lengths, segment ids, a rule at the
  head's ``(b, h)``), as ``Dense`` evaluates it; not a bias's or score
  modifier's ``-inf`` (a kernel adds those where it forms the logits).
  ``ops`` is ``problem.ops``, ``head`` what ``lift_heads`` hands the
  single-head function.
  """
  rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  q_segment_ids = None if head.q_segment_ids is None else head.q_segment_ids[:, None]
  kv_segment_ids = None if head.kv_segment_ids is None else head.kv_segment_ids[None, :]
  offset, q_start, kv_start = head.offsets(t, s)
  parts = [head.dense, intervals.visible(
      rows, cols, offset, intervals.bounds(ops.causal, ops.window),
      head.q_lengths, head.kv_lengths, q_segment_ids, kv_segment_ids)]
  if head.rule is not None:
    parts.append(head.rule.mask_fn(*head.index, rows + q_start,
                                         cols + kv_start))
  out = None
  for part in parts:
    if part is not None:
      part = jnp.broadcast_to(part, (t, s))
      out = part if out is None else out & part
  return out
