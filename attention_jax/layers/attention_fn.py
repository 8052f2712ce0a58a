"""The ``attention_fn`` protocol: how a layer hands its heads to attention.

Shape glossary: B batch, N query heads, K key/value heads (K divides N), T
query length, S key/value length (a cache's slots while decoding), H head
dim, Hv value head dim.

A layer calls its ``attention_fn`` as ::

  attention_fn(q, k, v, mask, **options)

with ``q [B, N, T, H]``, ``k [B, K, S, H]``, ``v [B, K, S, Hv]`` and
``mask`` one ``aj.Mask`` holding everything the layer and the call ask for
(``aj.Mask()`` when nothing is masked; ``is_causal`` is folded into it,
never passed). ``options`` holds each of these only when the call uses it,
each with ``scaled_dot_product_attention``'s meaning (docs/options.md):

=====================================  ======================================
``scale``                              the layer sets one (else the
                                       function's default: ``1 / sqrt(H)``)
``bias``                               the call gives one
``score_mod``                          the layer's T5 table, score modifier
                                       and soft cap, chained
``sinks``                              the layer learns sink logits ``[N]``
``dropout_rate``, ``dropout_rng``      dropout is on
``return_weights``, ``return_lse``,    the call asks for them (``True``)
``return_max_logits``
=====================================  ======================================

It returns ``out [B, N, T, Hv]``, or ``(out, *extras)`` with the extras
asked for in the order weights ``[B, N, T, S]``, lse ``[B, N, T]``,
max_logits ``[B, N, T]``. Every option changes the numbers, so a function
that cannot honour one must raise, never drop it: one with named
parameters does (Python's ``TypeError``, which the layer annotates with
what it passed); one with ``**kwargs`` must refuse what it does not
implement. Nothing reads the function's signature.

Or ``attention_fn`` chooses a kernel: None (automatic), a kernel name, an
``aj.kernels`` kernel or a list of them. ``as_attention_fn`` turns that
into an ``Implementation``: ``scaled_dot_product_attention`` with the
choice, and the layer's mesh axes, which it reads as the call's
``partition`` (so a kernel XLA cannot partition runs per shard). A function
is given no partition: it sees the whole arrays, as any jitted code does.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax.typing import ArrayLike

from attention_jax import kernels
from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.layers import sharding
from attention_jax.masking import mask as mask_lib
from attention_jax.masking.mask import Mask

# A function of the protocol above, or a kernel choice (as_attention_fn).
AttentionFn = Callable[..., Any]
# The options a layer may pass, in the order of the table above.
OPTIONS = ("scale", "bias", "score_mod", "sinks", "dropout_rate",
           "dropout_rng", "return_weights", "return_lse", "return_max_logits")
EXTRAS = ("return_weights", "return_lse", "return_max_logits")
NO_MASK = Mask()


@dataclasses.dataclass(frozen=True, eq=False)
class Implementation:
  """``scaled_dot_product_attention`` with ``implementation=`` chosen.

  ``head_axis``/``batch_axis`` are the layer's mesh axes: each call's
  ``partition`` is read from them (``sharding.attention_partition``), so
  a kernel XLA cannot partition (``pallas_gpu``, ``splash``) runs on each
  device's heads inside ``jax.shard_map`` rather than on gathered operands.
  """
  implementation: Any = None
  head_axis: str | None = None
  batch_axis: str | tuple[str, ...] | None = None

  def __call__(self, q, k, v, mask, **options):
    """The protocol's return: ``out``, or it and the extras asked for."""
    asked = tuple(options.get(name, False) for name in EXTRAS)
    return Result(*self.run(q, k, v, mask, **options)).returned(asked)

  def run(self, q, k, v, mask, **options):
    """The call's ``kernels.Result`` (what ``Keys.attend`` reads: the
    extras not asked for are None, so nothing is packed and unpacked)."""
    if (self.head_axis is not None or self.batch_axis is not None) and (
        "partition" not in options):
      options["partition"] = sharding.attention_partition(
          self.head_axis, self.batch_axis, q.shape[0])
    return dot_product.run(q, k, v, mask, implementation=self.implementation,
                           **options)


def as_attention_fn(attention_fn: Any, *, scale: float | None = None,
                    head_axis: str | None = None,
                    batch_axis: Any = None) -> AttentionFn:
  """``attention_fn=`` as the callable a layer calls, checked once.

  A kernel choice (None, a name, a kernel, a list) becomes an
  ``Implementation`` with the layer's mesh axes; a function is kept as it
  is. Refused: a kernel class (not an instance), a list holding anything
  but kernels, and a ``functools.partial`` fixing ``scale`` in a layer
  that sets one too (the layer's keyword would override it silently).

  Example:
    >>> as_attention_fn("flash").implementation
    'flash'
  """
  if isinstance(attention_fn, type):
    raise TypeError(
        f"attention_fn is the class {attention_fn.__name__}; pass a function "
        f"of the attention_fn protocol or an implementation (a kernel name, "
        f"or an instance such as {attention_fn.__name__}()).")
  if isinstance(attention_fn, (list, tuple)):
    if not all(isinstance(x, (str, kernels.Kernel)) for x in attention_fn):
      raise TypeError(
          f"attention_fn as a list is implementations to try in order "
          f"(kernel names or aj.kernels instances), got {attention_fn!r}; a "
          "function of the attention_fn protocol is passed alone.")
  elif callable(attention_fn) and not isinstance(attention_fn,
                                                   kernels.Kernel):
    fixed = getattr(attention_fn, "keywords", None)
    if (scale is not None and isinstance(attention_fn, functools.partial)
        and "scale" in fixed):
      raise ValueError(
          f"scale={scale!r} was given, and attention_fn fixes scale="
          f"{fixed['scale']!r} (functools.partial), which the layer's would "
          "override silently: set the scale in one place.")
    return attention_fn
  elif attention_fn is not None and not isinstance(attention_fn,
                                                   (str, kernels.Kernel)):
    raise TypeError(
        f"attention_fn must be None, a kernel name, an aj.kernels kernel, a "
        f"list of them, or a function of the attention_fn protocol, got "
        f"{type(attention_fn).__name__}.")
  return Implementation(attention_fn, head_axis, batch_axis)


class Result(NamedTuple):
  """One attention call's results; the extras not asked for are None."""
  out: jax.Array  # [B, N, T, Hv]
  weights: jax.Array | None = None  # [B, N, T, S]
  lse: jax.Array | None = None  # [B, N, T]
  max_logits: jax.Array | None = None  # [B, N, T]

  def returned(self, asked: tuple[bool, bool, bool]):
    """The public functions' return: ``out`` alone, or a tuple with the
    asked-for extras in the order weights, lse, max_logits."""
    if not any(asked):
      return self.out
    extra = [x for x, on in zip(self[1:], asked) if on]
    return (self.out, *extra)


def results(result, options: dict[str, Any]) -> Result:
  """An ``attention_fn``'s return read as a ``Result``, its length checked
  against the ``return_*`` options it was given."""
  result = result if isinstance(result, tuple) else (result,)
  asked = list(filter(options.__contains__, EXTRAS))
  if len(result) != 1 + len(asked):
    names = ", ".join(["out"] + [name[len("return_"):] for name in asked])
    raise TypeError(
        f"attention_fn returned {len(result)} value(s), but this call asked "
        f"for ({names}): an attention_fn given a return_* option returns "
        "what it asks for, in the order weights, lse, max_logits.")
  given = dict(zip(asked, result[1:]))
  return Result(result[0], given.get("return_weights"),
                given.get("return_lse"), given.get("return_max_logits"))


def _note(error: TypeError, fn, options: dict[str, Any]) -> None:
  """Says, on a ``TypeError`` from ``fn``, what the layer passed it."""
  name = getattr(fn, "__name__", type(fn).__name__)
  error.add_note(
      f"attention_fn {name} was called as (q, k, v, mask, "
      f"{', '.join(f'{k}=...' for k in options)}): a layer passes each "
      "option it uses (layers/attention_fn.py), and a function that cannot "
      "honour one must refuse it; leave the option out of the layer and "
      "the call, or accept it with scaled_dot_product_attention's meaning.")


class Keys(NamedTuple):
  """What the queries attend over: keys and values ``[B, K, S, H|Hv]``, the
  mask over their ``S`` columns, and the bias and score modifier that read
  them (a cache write restates all of them over its slots)."""
  key: jax.Array
  value: jax.Array
  mask: Mask
  bias: jax.Array | None = None
  score_mod: Any = None

  def attend(self, fn: AttentionFn, q: jax.Array,
             options: dict[str, Any]) -> Result:
    """``fn(q, key, value, mask, **options)`` with this bias and score
    modifier among the options."""
    if self.bias is not None:
      options = {**options, "bias": self.bias}
    if self.score_mod is not None:
      options = {**options, "score_mod": self.score_mod}
    if isinstance(fn, Implementation):  # ours: its Result as it is
      return Result(*fn.run(q, self.key, self.value, self.mask, **options))
    try:
      result = fn(q, self.key, self.value, self.mask, **options)
    except TypeError as error:
      _note(error, fn, options)
      raise
    return results(result, options)


def call_options(*, scale=None, sinks=None, dropout_rate=0.0,
                 dropout_rng=None, asked=(False, False, False),
                 ) -> dict[str, Any]:
  """The options a call passes (bias and score_mod travel with ``Keys``):
  each only when in play, dropout only when its rate is not a Python 0."""
  options = {}
  if scale is not None:
    options["scale"] = scale
  if sinks is not None:
    options["sinks"] = sinks
  if not (isinstance(dropout_rate, (int, float)) and dropout_rate == 0.0):
    options["dropout_rate"] = dropout_rate
    options["dropout_rng"] = dropout_rng
  for name, on in zip(EXTRAS, asked):
    if on is not True and on is not False:  # traced, or not a bool
      checks.check_static_bool(name, on)
    if on:
      options[name] = True
  return options


def attend_heads(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: Mask | ArrayLike | None = None,
    *,
    bias: jax.Array | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    score_mod: Any = None,
    sinks: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    attention_fn: AttentionFn | Any = None,
    return_weights: bool = False,
    return_lse: bool = False,
    return_max_logits: bool = False,
    partition: Any = None,
) -> jax.Array | tuple[jax.Array, ...]:
  """Attention of N query heads over K shared key/value heads, through
  ``attention_fn`` (the protocol of this module's docstring).

  Args:
    query: ``[B, N, T, H]`` projected queries.
    key: ``[B, K, S, H]`` projected keys; ``K`` divides ``N``.
    value: ``[B, K, S, Hv]`` projected values.
    mask: an ``aj.Mask`` or a dense bool array broadcastable to ``[B, N,
      T, S]``, handed on as one ``aj.Mask``.
    bias, scale, score_mod, sinks, dropout_rate, dropout_rng: the options
      above, passed on only when given (dropout only when on).
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``.
    attention_fn: a function of the protocol, or a kernel choice (None:
      automatic).
    return_weights, return_lse, return_max_logits: also return them.
    partition: an ``aj.kernels.Partition`` (how ``B`` and the heads are
      split over the mesh), passed on as ``partition=`` when given: a
      kernel choice takes it, a function must name it.

  Returns:
    ``out [B, N, T, Hv]``, followed, in this order and only when asked, by
    ``weights [B, N, T, S]``, ``lse [B, N, T]``, ``max_logits [B, N, T]``.

  Example:
    >>> q, kv = jnp.ones((2, 4, 3, 8)), jnp.ones((2, 2, 5, 8))  # N=4, K=2
    >>> out, w = attend_heads(q, kv, kv, return_weights=True)
    >>> out.shape, w.shape
    ((2, 4, 3, 8), (2, 4, 3, 5))
  """
  fn = as_attention_fn(attention_fn, scale=scale)
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  asked = (return_weights, return_lse, return_max_logits)
  options = call_options(scale=scale, sinks=sinks, dropout_rate=dropout_rate,
                         dropout_rng=dropout_rng, asked=asked)
  if partition is not None:
    options["partition"] = partition
  keys = Keys(key, value, NO_MASK if mask is None else mask, bias, score_mod)
  return keys.attend(fn, query, options).returned(asked)
