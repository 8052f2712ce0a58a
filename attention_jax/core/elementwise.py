"""Whether a score modifier is elementwise in the scores: a jaxpr walk.

Shape glossary: T query length, S key/value length (a score block is
``[T, S]`` in the dense kernel and ``[bq, bk]`` in the blockwise ones).

Every kernel calls ``score_mod(score, b, h, q_idx, kv_idx)`` on the scores
it holds: the dense kernel on one head's whole ``[T, S]``, the blockwise
ones on each visited block. A modifier whose output at ``(i, j)`` reads
any other score (a sum, a row's standard deviation, a sort) therefore
gives a different answer in each kernel, and the automatic choice moves
between them with the sequence length. Elementwise means: entry ``(i, j)``
of the output is a function of ``score[i, j]``, of ``b``, ``h``,
``q_idx[i]``, ``kv_idx[j]`` and of arrays read at those indices, nothing
else.

``mixing_primitive`` traces the modifier (abstractly: nothing is
computed) and follows what depends on ``score`` through the program: an
elementwise primitive carries the dependence on; a reduction, a
contraction, a slice, a sort or any primitive not known to be elementwise
that receives it is reported by name. Reading a table at indices computed
from the score (a gather whose operand does not depend on it) stays
elementwise.

``reads`` answers a plainer question with the same tracing: whether the
output depends on given inputs at all (a tree's mask refuses a modifier
that reads ``q_idx``/``kv_idx``: ``masking/tree.py``).
"""

from __future__ import annotations

from jax.extend import core as jax_core

# Primitives whose output element is a function of the same element of
# each input (jaxprs broadcast explicitly, so equal shapes or scalars).
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan",
    "atan2", "atanh", "bessel_i0e", "bessel_i1e", "bitcast_convert_type",
    "cbrt", "ceil", "clamp", "clz", "convert_element_type", "copy", "copy_p",
    "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp",
    "exp2", "expm1", "floor", "ge", "gt", "igamma", "igammac", "integer_pow",
    "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max",
    "min", "mul", "ne", "neg", "nextafter", "not", "or", "population_count",
    "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
    "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh",
    "xor"})
# Shape-only primitives that keep each element where it is (size-1 axes
# added, removed or broadcast); "pvary" only marks a value as varying over
# shard_map's devices (a modifier reading a per-device array, e.g. the
# global head index inside ulysses_attention, applies it to the scores).
_PLACING = frozenset({"broadcast_in_dim", "squeeze", "expand_dims", "pvary"})
# Call-like primitives: the dependence is followed into their programs.
_PROGRAM_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Loops carry values from one iteration to the next: ``reads`` does not
# follow their programs (every output depends on every input).
_LOOPS = frozenset({"scan", "while"})


def mixing_primitive(closed) -> str | None:
  """The first primitive of ``closed`` (``jax.make_jaxpr(fn)(score,
  ...)``) that mixes the entries of its first input, or None when the
  program is elementwise in it."""
  flags = [i == 0 for i in range(len(closed.jaxpr.invars))]
  _, culprit = _walk(closed.jaxpr, flags)
  return culprit


def _walk(jaxpr, invar_flags) -> tuple[list[bool], str | None]:
  """Which outputs of ``jaxpr`` depend on the flagged inputs, and the first
  primitive that mixes their entries (None if none does)."""
  tracked = {v for v, on in zip(jaxpr.invars, invar_flags) if on}
  dep = lambda v: not isinstance(v, jax_core.Literal) and v in tracked
  for eqn in jaxpr.eqns:
    inputs = [dep(v) for v in eqn.invars]
    if not any(inputs):
      continue
    name = eqn.primitive.name
    keeps_place = (name in _ELEMENTWISE or name in _PLACING
                   or (name == "reshape" and _same_elements(eqn))
                   # a table read at indices computed from the scores
                   or (name == "gather" and not inputs[0]))
    if keeps_place:
      outputs = [True] * len(eqn.outvars)
    elif name == "cond" and not inputs[0]:
      outputs = [False] * len(eqn.outvars)
      for branch in eqn.params["branches"]:
        flags, culprit = _walk(branch.jaxpr, inputs[1:])
        if culprit:
          return [], culprit
        outputs = [a or b for a, b in zip(outputs, flags)]
    else:
      inner = next((eqn.params[p] for p in _PROGRAM_PARAMS
                    if p in eqn.params), None)
      if inner is None:
        return [], name
      inner = getattr(inner, "jaxpr", inner)
      outputs, culprit = _walk(inner, inputs[:len(inner.invars)])
      if culprit:
        return [], culprit
    tracked.update(v for v, on in zip(eqn.outvars, outputs) if on)
  return [dep(v) for v in jaxpr.outvars], None


def _same_elements(eqn) -> bool:
  """A reshape that only adds or removes size-1 axes."""
  drop = lambda shape: tuple(d for d in shape if d != 1)
  return drop(eqn.invars[0].aval.shape) == drop(eqn.params["new_sizes"])


def reads(closed, inputs) -> bool:
  """Whether the output of ``closed`` (``jax.make_jaxpr(fn)(...)``) depends
  on any of its inputs at the positions ``inputs``: a data-dependence walk
  (every primitive carries a dependence on; call-like programs and a
  cond's branches are followed inside, so an input that a called program
  ignores is not read; a loop passes it to every output)."""
  flags = [i in inputs for i in range(len(closed.jaxpr.invars))]
  return any(_depends(closed.jaxpr, flags))


def _depends(jaxpr, invar_flags) -> list[bool]:
  """Which outputs of ``jaxpr`` depend on the flagged inputs."""
  tracked = {v for v, on in zip(jaxpr.invars, invar_flags) if on}
  dep = lambda v: not isinstance(v, jax_core.Literal) and v in tracked
  for eqn in jaxpr.eqns:
    inputs = [dep(v) for v in eqn.invars]
    if not any(inputs):
      continue
    outputs = [True] * len(eqn.outvars)
    inner = next((eqn.params[p] for p in _PROGRAM_PARAMS
                  if p in eqn.params), None)
    inner = getattr(inner, "jaxpr", inner)
    if eqn.primitive.name == "cond" and not inputs[0]:
      branches = [_depends(b.jaxpr, inputs[1:])
                  for b in eqn.params["branches"]]
      outputs = [any(flags) for flags in zip(*branches)]
    elif (inner is not None and eqn.primitive.name not in _LOOPS
          and len(inner.invars) == len(eqn.invars)
          and len(inner.outvars) == len(eqn.outvars)):
      outputs = _depends(inner, inputs)
    tracked.update(v for v, on in zip(eqn.outvars, outputs) if on)
  return [dep(v) for v in jaxpr.outvars]
