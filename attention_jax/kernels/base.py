"""The kernel interface: one validated problem, and kernels that say what they take.

Shape glossary: B batch, N query heads, K key/value heads, T query length,
S key/value length, H head dim, Hv value head dim; ``...`` leading dims.

``canonicalize`` checks a call once, in the caller's terms, and builds a
``Problem``: the operands with heads grouped (``operands.Operands``: the
mask's fields, the bias, sinks, score modifier and the (b, h) indices they
see), the scale, dropout and what to return. A kernel is a ``Kernel``:

* ``name``: what ``implementation=`` calls it;
* ``implements``: the features (``Problem.features``: the mask's fields,
  ``bias``/``sinks``/``score_mod``, the options set) it implements; a call
  asking for any other is refused with the feature's name, so a field
  added later can never be dropped by a kernel that does not know it;
* ``supports(problem) -> None | reason``: whether it gives the contract's
  numbers for this problem (a reason is a phrase for an error message);
* ``declines(problem) -> None | reason``: only for the automatic choice, a
  problem it can run but should not (too small to pay off);
* ``__call__(problem) -> Result``: ``out [..., N, T, Hv]``, heads merged
  again, and ``weights``/``lse``/``max_logits`` where asked for (None
  otherwise). Kernels never re-validate;
* ``forward_mode``: whether JAX can differentiate it forward (plain JAX
  or a custom JVP); one that cannot (a custom VJP) is refused by name
  under ``jax.jvp`` (``kernels.forward_mode``), reverse mode unchanged;
* ``partitionable``: whether XLA can split it over sharded batch and
  heads (pure JAX: yes); one that cannot (a Pallas call) runs per shard
  of the problem's ``Partition`` inside ``jax.shard_map``
  (``kernels.per_shard``), seeing the shard's problem.

``max_logits`` (QK-clip, logit-growth monitoring): per query row, the
maximum of the raw scaled logits ``scale * q . k`` over the keys the row
attends to (every mask field; ``-inf`` bias or ``score_mod`` entries block
like a mask), before the bias, ``score_mod`` and sinks; ``-inf`` for a row
with nothing to attend to. Float32 (float64 for float64 inputs), and not
differentiated: its gradient is zero (``lax.stop_gradient``).

The registry (``kernels/__init__.py``) lists them in the automatic choice's
order; the dispatcher (``dot_product``) walks it.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.core import broadcast
from attention_jax.core import checks
from attention_jax.kernels import operands
from attention_jax.masking import mask as mask_lib

# What every kernel returns (defined beside lift_heads, which builds it).
Result = broadcast.Result


class Pages(NamedTuple):
  """Keys and values read through a page table (a paged cache); a pytree.

  Position ``p`` of example ``b`` lives in page ``table[b, p // Z]``, slot
  ``p % Z``; an entry ``>= P`` (no page) is past the example's length.
  The call's ``ops.key``/``ops.value`` are then ``ShapeDtypeStruct``s of
  the logical ``[B, K, M * Z, H]`` the pages stand for: nothing the size
  of the keys is gathered; a kernel that declares ``pages`` reads them
  page by page.
  """
  key_pages: jax.Array  # [P, K, Z, H]
  value_pages: jax.Array  # [P, K, Z, Hv]
  table: jax.Array  # int32 [B, M]
  # float32 [P, K, Z]: quantised pages (int8, float8_e4m3fn) hold
  # ``x / scale`` per token and head; a kernel declaring "page_scales"
  # dequantises each page as it loads it.
  key_scales: jax.Array | None = None
  value_scales: jax.Array | None = None
  # bool scalar: True vouches that every key and value below each
  # example's length is finite (the paged cache tracks what it was
  # written), so a kernel need not search loaded pages for NaN or inf;
  # False or None: it must (garbage a row may not see never reaches it).
  finite: jax.Array | None = None

  @property
  def page_size(self) -> int:
    return self.key_pages.shape[2]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Partition:
  """How a call's leading dims are split over mesh axes (static, hashable).

  ``batch``: the mesh axes the batch ``B`` is split over (of ``[B, N, T,
  H]`` operands the axis before the heads; of ``[B, T, H]`` the one
  leading axis); ``heads``: those the heads are split over (``N``, and
  ``K`` for grouped keys and values: after grouping, ``K``). A name or a
  tuple of names each, ``()``/None for none. A kernel XLA cannot partition
  (``Kernel.partitionable`` False: a Pallas call) then runs per shard
  inside ``jax.shard_map`` over these axes (``kernels.per_shard``); the
  others are left to XLA's partitioner, which splits them by itself.

  Example:
    >>> Partition(batch="data", heads="model")
    Partition(batch=('data',), heads=('model',))
  """
  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()

  def __post_init__(self):
    for name in ("batch", "heads"):
      value = getattr(self, name)
      value = () if value is None else (
          (value,) if isinstance(value, str) else value)
      if not isinstance(value, (tuple, list)) or not all(
          isinstance(a, str) and a for a in value):
        raise TypeError(
            f"Partition's {name} must be a mesh axis name or a tuple of "
            f"them (None for none), got {getattr(self, name)!r}.")
      object.__setattr__(self, name, tuple(value))
    twice = sorted({a for a in self.axes if self.axes.count(a) > 1})
    if twice:
      raise ValueError(
          f"Partition uses mesh axis {twice} more than once (batch="
          f"{self.batch}, heads={self.heads}): a mesh axis splits one "
          "dimension.")

  @property
  def axes(self) -> tuple[str, ...]:
    return self.batch + self.heads

  def __bool__(self) -> bool:
    return bool(self.axes)


class Problem(NamedTuple):
  """One attention call, validated."""
  ops: operands.Operands  # operands, heads grouped, the mask's fields
  scale: Any  # float, or a scalar array
  out_dtype: Any
  dropout_rate: Any = 0.0
  dropout_rng: jax.Array | None = None
  return_weights: bool = False
  return_lse: bool = False
  return_max_logits: bool = False
  mask: mask_lib.Mask | None = None  # the call's normalised mask, whole
  pages: Pages | None = None  # keys and values in pages (a paged cache)
  # How the leading dims are split over the ambient mesh's axes (None:
  # not split, or left to XLA); checked against the mesh and the shapes.
  partition: Partition | None = None

  @property
  def features(self) -> frozenset[str]:
    """What this call asks of a kernel, by name (``Kernel.implements``).

    Every field the mask sets (its attributes, so a field added to ``Mask``
    is a feature without a line here), ``bias``, ``sinks`` and
    ``score_mod`` when given, and every option of this record that differs
    from its default (``dropout_rate``, ``return_weights``, ``return_lse``,
    ``return_max_logits``, and any option added to it later).
    """
    given = {} if self.mask is None else dict(vars(self.mask))
    for name in _CALL_OPERANDS:
      given[name] = getattr(self.ops, name)
    found = set()
    for name, x in given.items():
      if x is not None and x is not False:
        found.add(name)
    if self.pages is not None and self.pages.key_scales is not None:
      found.add("page_scales")  # quantised pages: dequantised on load
    for name, default in type(self)._field_defaults.items():
      if name in _NOT_FEATURES:
        continue
      value = getattr(self, name)
      if name == "dropout_rate":
        if self.dropout_on:
          found.add(name)
      elif value is not default and (isinstance(value, tuple)
                                     or value != default):
        found.add(name)
    return frozenset(found)

  @property
  def dropout_on(self) -> bool:
    return not (isinstance(self.dropout_rate, (int, float))
                and self.dropout_rate == 0.0)

  @property
  def scores(self) -> int:
    """``T * S``, the scores of one head."""
    return self.ops.query.shape[-2] * self.ops.key.shape[-2]


# The call's operands besides q, k, v that are features (Problem.features);
# the record's own fields that are not (the mask is read field by field).
_CALL_OPERANDS = ("bias", "sinks", "score_mod")
_NOT_FEATURES = ("mask", "dropout_rng", "partition")

# Every field a Mask can set, and everything a call can ask for: what a
# kernel declares it implements (``Kernel.implements``) is a subset.
MASK_FIELDS = frozenset({
    "causal", "window", "q_lengths", "kv_lengths", "q_segment_ids",
    "kv_segment_ids", "dense", "rule", "q_offset", "kv_offset"})
OPTIONS = frozenset({
    "bias", "sinks", "score_mod", "dropout_rate", "return_weights",
    "return_lse", "return_max_logits", "pages", "page_scales"})


class Kernel:
  """What every implementation provides (see the module docstring)."""
  name: ClassVar[str] = "kernel"
  # The features (Problem.features) this kernel implements; the choice
  # refuses a call asking for any other, naming it, before ``supports``
  # is trusted (a field or option added later reaches no kernel silently).
  implements: ClassVar[frozenset[str]] = frozenset()
  # Whether XLA's SPMD partitioner can split this kernel's computation over
  # sharded batch and head dims (pure JAX: it can). A kernel that is one
  # opaque call (a Pallas kernel) cannot: with a partition in the problem
  # it runs per shard inside jax.shard_map (kernels.per_shard).
  partitionable: ClassVar[bool] = True
  # Whether JAX can differentiate it forward (jax.jvp, jax.jacfwd): plain
  # JAX or a custom JVP. A kernel whose gradient is a custom VJP says
  # False, and the dispatcher refuses forward mode by its name
  # (kernels/forward_mode.py) instead of JAX's anonymous error.
  forward_mode: ClassVar[bool] = True
  # The backend it runs on ("gpu", "tpu"), None for any. Elsewhere it is
  # refused by that reason before ``supports`` is asked (``refusal``),
  # unless it runs in the Pallas interpreter (an ``interpret`` of True).
  backend: ClassVar[str | None] = None

  def supports(self, problem: Problem) -> str | None:
    """Why this kernel cannot run a call it declares (shapes, dtypes,
    backend), or None; what it does not declare is refused before."""
    del problem
    return None

  def declines(self, problem: Problem) -> str | None:
    del problem
    return None

  def __call__(self, problem: Problem):
    raise NotImplementedError


def canonicalize(query, key, value, mask, *, bias=None, scale=None,
                 score_mod=None, sinks=None, dropout_rate=0.0,
                 dropout_rng=None, return_weights: bool = False,
                 return_lse: bool = False,
                 return_max_logits: bool = False,
                 pages: Pages | None = None,
                 partition: Partition | None = None) -> Problem:
  """Every check of an attention call, once; the ``Problem`` kernels run.

  ``mask`` is a ``Mask`` or None (``mask.as_mask`` converts the other
  accepted values); ``scale`` None means ``1 / sqrt(H)``. With ``pages``
  (a paged cache) ``key`` and ``value`` are None: the pages stand for
  them (``operands.paged_operands``). ``partition`` (a ``Partition`` or
  None) is checked against the ambient mesh and the operands
  (``check_partition``).
  """
  if mask is None:
    mask = mask_lib.Mask()
  if not isinstance(mask, mask_lib.Mask):
    raise TypeError(
        f"canonicalize takes the call's mask as an aj.Mask (or None), got "
        f"{type(mask).__name__}: the public functions convert what they "
        "accept once (masking.mask.as_mask); convert it the same way first.")
  for name, flag in (("return_weights", return_weights),
                     ("return_lse", return_lse),
                     ("return_max_logits", return_max_logits)):
    checks.check_static_bool(name, flag)
  if pages is not None:
    if key is not None or value is not None:
      raise TypeError("a paged call reads its keys and values from the "
                      "pages: pass key=None and value=None with pages=.")
    key, value = operands.paged_operands(
        query, pages.key_pages, pages.value_pages, pages.table, mask,
        pages.key_scales, pages.value_scales)
  checks.check_dropout(dropout_rate, dropout_rng)
  # Dropout draws each entry's bit from its head's (b, h): core/dropout.py.
  ops = operands.attention_operands(query, key, value, mask,
                                  bias, sinks=sinks, score_mod=score_mod,
                                  head_index=dropout_rng is not None)
  if scale is None:
    scale = 1.0 / math.sqrt(ops.query.shape[-1])
  else:
    checks.check_call_scale(scale)
  out_dtype = jnp.result_type(ops.query, ops.key, ops.value)
  if pages is not None:
    pages = Pages(*(None if x is None else jnp.asarray(x) for x in pages))
  if partition is not None:
    partition = check_partition(partition, ops)
  return Problem(ops, scale, out_dtype, dropout_rate, dropout_rng,
                 bool(return_weights), bool(return_lse),
                 bool(return_max_logits), mask, pages, partition)


def split_dims(ops: operands.Operands) -> tuple[int | None, int | None]:
  """``(batch, heads)``: the positions of ``B`` and ``N`` among the
  caller's leading dims (``ops.leading``), as ``score_mod``'s ``(b, h)``
  count them: the last two of ``[..., B, N]``, the only one of ``[B]``
  (no heads), none without leading dims."""
  rank = len(ops.leading)
  if rank == 0:
    return None, None
  if rank == 1:
    return 0, None
  return rank - 2, rank - 1


def check_partition(partition, ops: operands.Operands) -> Partition | None:
  """``partition`` checked against the ambient mesh and the operands:
  the ``Partition`` (None when it splits nothing).

  Every axis must be in the mesh (``jax.set_mesh``) and not manual (inside
  a ``jax.shard_map`` over it the operands are already one device's
  shard: refused, as splitting them again would be wrong); the product of
  the batch axes' sizes must divide ``B``, that of the heads axes ``N``
  and ``K``.
  """
  if partition is None:
    return None
  if not isinstance(partition, Partition):
    raise TypeError(
        f"partition must be an aj.kernels.Partition (e.g. Partition(batch="
        f"'data', heads='model')) or None, got {partition!r}.")
  if not partition:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError(
        f"{partition} names mesh axes, but no mesh is set: call inside "
        "`with jax.set_mesh(mesh):` (or pass partition=None).")
  for axis in partition.axes:
    if axis not in mesh.axis_names:
      raise ValueError(
          f"{partition} names mesh axis {axis!r}, which the mesh does not "
          f"have (its axes: {tuple(mesh.axis_names)}).")
    kind = mesh.axis_types[mesh.axis_names.index(axis)]
    if kind == jax.sharding.AxisType.Manual:
      raise ValueError(
          f"{partition} names mesh axis {axis!r}, which is manual here "
          "(inside a jax.shard_map over it): the operands are already one "
          "device's shard along it; leave it out of the partition.")
  batch_dim, head_dim = split_dims(ops)
  lead = ops.leading
  for what, axes, dim in (("batch", partition.batch, batch_dim),
                          ("heads", partition.heads, head_dim)):
    if not axes:
      continue
    if dim is None:
      layout = ("[B, N, T, H] operands (4-D: the heads are axis 1)"
                if what == "heads" else "operands with a batch axis")
      raise ValueError(
          f"{partition} splits the {what} over {axes}, but the operands' "
          f"leading dims are {lead}: it needs {layout}.")
    size = math.prod(mesh.shape[a] for a in axes)
    counts = {"B": lead[dim]} if what == "batch" else {"N": lead[dim]}
    if what == "heads" and ops.groups is not None:
      counts["K"] = ops.groups.num_kv_heads
    for letter, n in counts.items():
      if n % size:
        raise ValueError(
            f"{partition} splits the {what} over mesh axes {axes} of size "
            f"{size}, which does not divide {letter} = {n} (leading dims "
            f"{lead}): each device must hold whole {what}; use axes whose "
            f"sizes divide {letter}, or leave the {what} unsplit.")
  return partition


def refusal(kernel: Kernel, problem: Problem) -> str | None:
  """Why ``kernel`` cannot run ``problem``, or None: keys and values in
  pages it does not read, then off its backend, then its ``supports``,
  then any feature it does not declare (``undeclared``)."""
  # A paged call's keys and values are pages, which only a kernel that
  # declares them may read: the others are not asked.
  if problem.pages is not None and "pages" not in kernel.implements:
    return undeclared(kernel, problem)
  here = jax.default_backend()
  if kernel.backend not in (None, here) and not getattr(
      kernel, "interpret", False):
    hint = (f" ({type(kernel).__name__}(interpret=True) runs it in the "
            "Pallas interpreter anywhere, slowly)"
            if hasattr(kernel, "interpret") else "")
    return (f"it needs a {kernel.backend.upper()}, the backend is "
            f"{here!r}{hint}")
  return kernel.supports(problem) or undeclared(kernel, problem)


def undeclared(kernel: Kernel, problem: Problem) -> str | None:
  """The reason ``kernel`` refuses what it does not declare, or None."""
  missing = problem.features - kernel.implements
  if not missing:
    return None
  listed = ", ".join(sorted(missing))
  return (f"it does not implement {listed} (not in {type(kernel).__name__}"
          f".implements); a kernel runs only what it declares")


def by_name(name: str, registry: Sequence[Kernel]) -> Kernel:
  """The kernel of ``registry`` called ``name``."""
  for kernel in registry:
    if kernel.name == name:
      return kernel
  raise ValueError(
      f"implementation must be None, a kernel, a sequence of them, or one of "
      f"{[k.name for k in registry]}, got {name!r}.")


def candidates(implementation, registry: Sequence[Kernel]
               ) -> tuple[tuple[Kernel, ...], bool]:
  """``(kernels to try in order, automatic)`` for an ``implementation=``:
  None is ``registry`` (``kernels.REGISTRY``), in its order."""
  if implementation is None:
    return tuple(registry), True
  if isinstance(implementation, (str, Kernel)):
    implementation = (implementation,)
  if not isinstance(implementation, Sequence) or not implementation:
    raise ValueError(
        f"implementation must be None, a kernel name "
        f"({[k.name for k in registry]}), a Kernel, or a non-empty sequence "
        f"of them; got {implementation!r}.")
  kernels = []
  for item in implementation:
    if isinstance(item, str):
      item = by_name(item, registry)
    if not isinstance(item, Kernel):
      raise TypeError(
          f"implementation entries must be kernel names or "
          f"attention_jax.kernels.Kernel instances, got {item!r}.")
    kernels.append(item)
  return tuple(kernels), False


def verdicts(kernels: Sequence[Kernel], problem: Problem, automatic: bool):
  """Yields ``(kernel, verdict, reason)`` in order: ``"refuses"``
  (``supports``' reason), ``"declines"`` (``declines``' reason, asked only
  when automatic) or ``"takes"`` (reason None). Lazy: ``choose`` stops at
  the first that takes the problem."""
  for kernel in kernels:
    # supports' reasons say most (and suggest a fix); what a kernel does not
    # declare is refused even when its supports() does not know the feature.
    reason = refusal(kernel, problem)
    if reason is not None:
      yield kernel, "refuses", reason
      continue
    reason = kernel.declines(problem) if automatic else None
    yield kernel, "takes" if reason is None else "declines", reason


def choose(kernels: Sequence[Kernel], problem: Problem,
           automatic: bool) -> Kernel:
  """The first kernel that takes ``problem``; else a ValueError with each
  kernel's reason."""
  reasons = []
  for kernel, verdict, reason in verdicts(kernels, problem, automatic):
    if verdict == "takes":
      return kernel
    reasons.append((kernel.name, reason))
  if len(reasons) == 1:
    name, reason = reasons[0]
    raise ValueError(f"implementation={name!r} is not possible: {reason}.")
  listed = "; ".join(f"{name}: {reason}" for name, reason in reasons)
  raise ValueError(f"no implementation takes this call ({listed}).")


# Below this many scores per head the dense kernel is as fast (see the
# performance page of the docs) and also yields the weights.
MIN_SCORES = 1024 * 1024


def asked_result(kernel: Kernel, problem: Problem, result) -> Result:
  """``result`` checked to be a named ``Result`` holding what ``problem``
  asked for, with nothing else (what the dispatcher and each shard of
  ``per_shard`` return). TypeError naming the kernel otherwise."""
  if not isinstance(result, Result):
    raise TypeError(
        f"kernel {kernel.name!r} returned {type(result).__name__}, not an "
        "aj.kernels.Result(out, weights, lse, max_logits) (absent values "
        "None): every kernel returns one named result.")
  for name in ("weights", "lse", "max_logits"):
    if getattr(problem, f"return_{name}") and getattr(result, name) is None:
      raise TypeError(  # a kernel that accepted the flag and ignored it
          f"kernel {kernel.name!r} was asked for {name} (return_{name}="
          f"True) but returned none: it must compute it or not declare "
          f"return_{name} in its implements.")
  return Result(result.out,
                result.weights if problem.return_weights else None,
                result.lse if problem.return_lse else None,
                result.max_logits if problem.return_max_logits else None)


def scale_in_query(problem: Problem) -> Problem:
  """``problem`` with a float scale: a concrete scalar array read as one,
  a traced one (a learned scale under ``jit``) folded into the queries
  (``scale * q . k == (scale * q) . k``; scale 1.0), so the blockwise
  kernels, which compile the scale in as a constant, run it too and its
  gradient flows through the product, outside their custom VJPs."""
  scale = problem.scale
  if isinstance(scale, (int, float)):
    return problem
  try:
    return problem._replace(scale=float(scale))
  except jax.errors.ConcretizationTypeError:
    q = problem.ops.query
    q = (q * scale.astype(jnp.float32)).astype(q.dtype)
    return problem._replace(ops=problem.ops._replace(query=q), scale=1.0)


def too_small(problem: Problem) -> str | None:
  """Why the automatic choice leaves a small problem to the dense kernel."""
  if problem.scores < MIN_SCORES:
    return (f"T * S = {problem.scores} is below {MIN_SCORES}, where the "
            "dense kernel is as fast")
  return None


def check_block_size(name: str, size) -> None:
  if size is not None:
    checks.check_positive_int(name, size)


def float32_only(problem: Problem) -> str | None:
  """The reason a float32-compute kernel refuses float64 inputs, or None."""
  if jnp.promote_types(problem.out_dtype, jnp.float32) != jnp.float32:
    return ("it computes in float32; float64 inputs need the dense kernel "
            "(implementation='dense')")
  return None


def no_max_logits(problem: Problem) -> str | None:
  """The reason a kernel without the raw row maxima refuses, or None."""
  if problem.return_max_logits:
    return ("it does not return max logits (return_max_logits=True); use "
            "'dense', 'flash' or ring attention")
  return None


def no_weights_or_dropout(problem: Problem) -> str | None:
  if problem.dropout_on:
    return ("it has no dropout (use 'flash', 'dense' or dropout_rate=0)")
  return no_weights(problem)


def no_weights(problem: Problem) -> str | None:
  """The reason a kernel that never forms ``[T, S]`` weights refuses."""
  if problem.return_weights:
    return ("it never forms the attention weights (use implementation="
            "'dense' or None with return_weights=True)")
  return None
