"""The cuDNN kernel: ``jax.nn.dot_product_attention(implementation="cudnn")``.

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads, H head dim.

``Cudnn`` is the kernel (``kernels.base``): it refuses (``supports``)
whatever would not give our numbers. Our layout is ``[B, N, T, H]``,
jax.nn's ``[B, T, N, H]``; jax.nn does grouped-query attention itself
(``K`` dividing ``N``). Not run on a GPU in this project's CI: the
dispatcher only picks it where ``supports`` finds nothing in the way.

Where jax.nn's semantics differ from ours (read from jax 0.10's
``jax/_src/nn/functions.py`` and ``jax/_src/cudnn/fused_attention_stablehlo.py``):

* Alignment. jax.nn's causal mask is ``tril`` and its window
  ``i - left <= j <= i + right``: top-left, query ``i`` at key position
  ``i``; ours puts query row ``i`` at key column ``i + offset``, with
  ``offset = S - T`` (bottom-right) or the mask's positions ``q_offset -
  kv_offset``. ``intervals.jax_nn_band`` decides: jax.nn's own flags where
  the offset is concretely 0 and ``T == S`` (jax.nn's cuDNN alignment for
  ``T != S`` has not been checked on a GPU here), an explicit ``[B|1, N|1,
  T, S]`` band mask otherwise.
* Rows that may see nothing. jax.nn's xla path fills blocked logits with a
  large finite negative, so such a row is the mean of all values; its cuDNN
  path adds the mask as a large finite negative bias (``-2 << 40`` in
  bfloat16), so such a row is again an average of values, and what cuDNN
  writes for rows past ``q_seqlen`` or with ``kv_seqlen == 0`` is decided in
  the kernel, not in jax. Ours is exactly 0: ``attention`` zeroes those rows
  with ``where`` (jax.nn's xla path already zeroes rows past the length).
* Windows. cuDNN has only a left window (``sliding_window_length = left +
  1``, top-left); jax.nn raises for ``right > 0`` unless the mask type is
  plain ``CAUSAL`` (not ``PADDING_CAUSAL``), and without a causal mask
  cuDNN's band has no right bound. So at offset 0 a window whose right
  bound resolves to 0 (``is_causal``, or ``right == 0``) goes as
  ``is_causal=True, local_window_size=(left, 0)``; every other band goes as
  an explicit mask (as causality does at other offsets), and ``supports``
  refuses two-sided windows and windows at other offsets so that the
  automatic choice never builds a ``[T, S]`` mask for them.
* Garbage. cuDNN adds its mask as a finite bias, so a NaN or inf key or
  value would reach every row (``0 * NaN`` is NaN) and what it does with one
  is the kernel's. Ours reaches only the rows that may see it, by
  construction rather than by trusting the kernel: q, k and v are
  ``checks.sanitize``'d before the call (cuDNN only ever sees finite
  numbers), and when any entry was not finite (one ``lax.cond``: nothing is
  spent otherwise) each row's code is worked out in plain JAX from our own
  pattern (band, mask, finite bias, lengths; ``checks.seen_codes_by_rows``)
  and the rows that may see a bad key, value or query are set to NaN
  (``checks.poison``), passing no gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.masking import intervals

# Parts of a problem jax.nn.dot_product_attention has no counterpart for.
_NOT_IN_JAX_NN = {
    "segment_ids": "jax.nn.dot_product_attention takes no segment ids",
    "sinks": "jax.nn's cuDNN kernel has no attention sinks",
    "score_mod": "jax.nn's cuDNN kernel takes no score modifier",
    "rule": "jax.nn's cuDNN kernel takes no mask rule",
}


@dataclasses.dataclass(frozen=True)
class Cudnn(base.Kernel):
  """jax.nn's fused GPU kernel, where it gives the contract's numbers."""
  name = "cudnn"
  min_scores = base.MIN_SCORES
  backend = "gpu"
  # jax.nn's cuDNN call carries custom_partitioning rules: XLA splits it
  # over batch and heads itself (query, key and value sharded alike).
  partitionable = True
  forward_mode = False  # its gradient is a custom VJP
  # jax.nn's arguments, and positions (its band or an explicit one,
  # intervals.jax_nn_band); segment ids, rules, sinks, score modifiers and
  # the lse have no counterpart there.
  implements = frozenset({"causal", "window", "q_lengths", "kv_lengths",
                          "dense", "bias", "q_offset", "kv_offset"})

  def supports(self, problem: base.Problem) -> str | None:
    reason = (base.no_weights_or_dropout(problem)
              or base.no_max_logits(problem))
    if reason:
      return reason
    ops = problem.ops
    q, k, v, mask, bias, lengths, q_lengths = _caller(ops)
    structured = {"q_lengths": q_lengths, "window": ops.window,
                  "segment_ids": ops.q_segment_ids, "sinks": ops.sinks,
                  "score_mod": ops.score_mod, "rule": ops.rule}
    return problem_of(q, k, v, mask, bias, lengths, problem.return_lse,
                      {n: x for n, x in structured.items() if x is not None},
                      is_causal=ops.causal, offset=_offset(ops))

  def __call__(self, problem: base.Problem):
    q, k, v, mask, bias, lengths, q_lengths = _caller(problem.ops)
    out = attention(q, k, v, mask, bias, lengths, q_lengths,
                    scale=problem.scale, is_causal=problem.ops.causal,
                    window=problem.ops.window, offset=_offset(problem.ops))
    return base.Result(out)


def _offset(ops: base.Operands):
  """The mask's ``q_offset - kv_offset``, ``[B|1, N|1]`` (heads merged), or
  None for the bottom-right alignment (as ``base.Head.offsets``)."""
  if not ops.positioned:
    return None
  return base.merge_groups(ops.q_offset - ops.kv_offset, ops.groups, -1)


def _caller(ops: base.Operands):
  """The operands with heads merged again (jax.nn groups heads itself)."""
  g, merge = ops.groups, base.merge_groups
  return (merge(ops.query, g, -3), merge(ops.key, g, -3),
          merge(ops.value, g, -3), merge(ops.dense, g, -3),
          merge(ops.bias, g, -3), merge(ops.kv_lengths, g, -1),
          merge(ops.q_lengths, g, -1))


def _per_example_problem(name, lengths, batch) -> str | None:
  """Why ``lengths`` is not one length per example (``[B, 1]`` or scalar)."""
  shape = checks.shape_of(lengths)
  if shape == () or (len(shape) == 2 and shape[1] == 1
                     and shape[0] in (1, batch)):
    return None
  return (f"it takes one length per example: the mask's {name} must be "
          f"[B] (or [B, 1]) or a scalar, got {shape}")


def _structured_problem(structured, t, s, offset, batch,
                        is_causal) -> str | None:
  """Why cuDNN cannot give our numbers for the structured arguments."""
  for name, value in structured.items():
    if value is None:
      continue
    if name == "q_lengths":
      problem = _per_example_problem(name, value, batch)
      if problem:
        return problem
    elif name == "window":
      _, right = value
      if right > 0 and not is_causal:
        return (f"window={value!r}: cuDNN has only a left window "
                "(jax.nn raises for right > 0 without a plain causal mask)")
      at = s - t if offset is None else offset
      if not intervals.jax_nn_flags_exact(
          t, s, at, intervals.bounds(is_causal, value), cudnn=True):
        where = (f"offset (S - T = {s - t})" if offset is None
                 else f"offset, T = {t} != S = {s}" if t != s
                 else "offset (q_offset - kv_offset, not concretely 0)")
        return (f"window={value!r} with query row i at key column i + "
                f"{where}: cuDNN's window is taken only top-left with T == "
                "S, so it would be an explicit [T, S] mask; the flash "
                "kernels skip the blocks outside it")
    elif name in _NOT_IN_JAX_NN:
      return f"{name}: {_NOT_IN_JAX_NN[name]}"
    else:
      return f"{name} is not wired to cuDNN here"
  return None


def problem_of(query, key, value, mask, bias, lengths, return_lse,
            structured=None, *, is_causal=False, offset=None) -> str | None:
  """Why the cuDNN kernel cannot take these inputs, or None if it can.

  ``structured`` maps the pattern arguments in use to their values
  (``window`` as a checked ``(left, right)``; None: none). ``is_causal``
  only widens what is accepted: a causal window ``(left, right > 0)`` is
  ``(left, 0)``. ``offset``: the mask's ``q_offset - kv_offset`` (None:
  ``S - T``); a window is taken only where it is concretely 0 and ``T ==
  S`` (``intervals.jax_nn_flags_exact``). None is
  returned only where
  ``attention`` gives our numbers, so the automatic choice never changes
  them.
  """
  if jax.default_backend() != "gpu":
    return f"it needs a GPU, the backend is {jax.default_backend()!r}"
  dtype = jnp.result_type(query, key, value)
  if dtype not in (jnp.float16, jnp.bfloat16):
    return f"it needs float16/bfloat16 inputs, got {dtype}"
  shapes = [checks.shape_of(x) for x in (query, key, value)]
  if any(len(s) != 4 for s in shapes) or shapes[1] != shapes[2]:
    return f"it needs [B, N, T, H] inputs with equal key/value shapes: {shapes}"
  h = shapes[0][-1]
  if h > 128 or h % 8:
    return f"it needs a head dim <= 128 and a multiple of 8, got {h}"
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None and x.ndim != 4:
      return f"{name} must be 4-D [B|1, N|1, T|1, S|1], got {x.shape}"
  batch, t, s = shapes[0][0], shapes[0][2], shapes[1][2]
  if lengths is not None:
    problem_ = _per_example_problem("kv_lengths", lengths, batch)
    if problem_:
      return problem_
  if return_lse:
    return "it does not return the log-sum-exp"
  return _structured_problem(structured or {}, t, s, offset, batch,
                             is_causal)


def _per_example(lengths, batch: int, limit: int) -> jax.Array:
  """``[B, 1]``/``[1, 1]``/scalar lengths as jax.nn's int32 ``[B]``."""
  lengths = jnp.clip(jnp.asarray(lengths), 0, limit).astype(jnp.int32)
  return jnp.broadcast_to(jnp.reshape(lengths, (-1,)), (batch,))


def _grid(t: int, s: int) -> tuple[jax.Array, jax.Array]:
  """Query rows ``[1, 1, T, 1]`` and key columns ``[1, 1, 1, S]``."""
  return (jnp.arange(t)[None, None, :, None],
          jnp.arange(s)[None, None, None, :])


def _on_grid(offset):
  """A scalar offset as it is, a ``[B|1, N|1]`` one as ``[B|1, N|1, 1, 1]``."""
  return offset if jnp.ndim(offset) == 0 else jnp.asarray(offset)[..., None,
                                                                   None]


def _rows_seeing_something(t, s, offset, b: intervals.Bounds, kv, q, mask,
                           bias):
  """Bool ``[B|1, N|1, T]``: the rows with a key to see (None: all rows)."""
  rows, cols = _grid(t, s)
  kv_lengths = None if kv is None else kv[:, None, None, None]  # [B,1,1,1]
  ok = intervals.visible(rows, cols, _on_grid(offset), b, kv_lengths=kv_lengths)
  finite_bias = None if bias is None else bias > -jnp.inf  # -inf blocks
  for extra in (mask, finite_bias):
    if extra is not None:
      ok = extra if ok is None else ok & extra
  sees = None if ok is None else jnp.any(ok, axis=-1)
  if q is not None:
    below = jnp.arange(t)[None, None, :] < q[:, None, None]  # [B, 1, T]
    sees = below if sees is None else sees & below
  return sees


def attention(query, key, value, mask, bias, lengths, q_lengths=None, *,
              scale, is_causal, window=None, offset=None,
              implementation="cudnn"):
  """jax.nn's fused kernel with our semantics.

  Args:
    query: ``[B, N, T, H]``; key, value: ``[B, K, S, H]``.
    mask: bool ``[B|1, N|1, T|1, S|1]`` or None (True = may attend).
    bias: ``[B|1, N|1, T|1, S|1]`` or None.
    lengths, q_lengths: key/value and query lengths, ``[B, 1]``, ``[1, 1]``
      or scalar, or None.
    scale: logit multiplier.
    is_causal: causal mask (query row ``i`` at key column ``i + offset``).
    window: checked ``(left, right)`` or None, around the same position.
    offset: query row ``i`` stands at key column ``i + offset``: the mask's
      ``q_offset - kv_offset``, an int or ``[B|1, N|1]``; None is ``S - T``
      (bottom-right).
    implementation: jax.nn's; ``"xla"`` tests this wiring on any backend.

  Returns:
    ``[B, N, T, H]``; rows past ``q_lengths`` or seeing no key are 0, rows
    that may see a NaN or inf key, value or query are NaN.
  """
  batch, heads, t, _ = query.shape
  s = key.shape[-2]
  b = intervals.bounds(is_causal, window)
  garbage = checks.any_nonfinite(query, key, value)
  query, key, value, q_code, kv_code = checks.sanitize(query, key, value)
  kv_code = jnp.repeat(kv_code, heads // key.shape[1], axis=1)  # [B, N, S]
  offset = s - t if offset is None else offset
  given_mask = mask
  # jax.nn's own band at offset 0 (top-left); an explicit one elsewhere, and
  # for a right bound (cuDNN has only a left window).
  jax_band = intervals.jax_nn_band(t, s, offset, b, cudnn=True)
  if jax_band.mask is not None:  # [T, S] or [B|1, N|1, T, S]
    band = jnp.reshape(jax_band.mask, (1,) * (4 - jax_band.mask.ndim)
                       + jax_band.mask.shape)
    mask = band if mask is None else mask & band
  if mask is not None:
    mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))
  kv = None if lengths is None else _per_example(lengths, batch, s)
  q = None if q_lengths is None else _per_example(q_lengths, batch, t)
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # [B, N, T, H] <-> [B, T, N, H]
  out = swap(jax.nn.dot_product_attention(
      swap(query), swap(key), swap(value), bias=bias, mask=mask, scale=scale,
      is_causal=jax_band.is_causal, query_seq_lengths=q,
      key_value_seq_lengths=kv, local_window_size=jax_band.local_window_size,
      implementation=implementation))
  sees = _rows_seeing_something(t, s, offset, b, kv, q, mask, bias)
  if sees is not None:  # jax.nn gives a mean of values there, ours is 0
    out = jnp.where(sees[..., None], out, jnp.zeros((), out.dtype))

  def visible(start, size):  # rows [start, start + size): [B|1, N|1, size, S]
    rows = start + jnp.arange(size)[None, None, :, None]
    cols = jnp.arange(s)[None, None, None, :]
    ok = intervals.visible(
        rows, cols, _on_grid(offset), b,
        None if q is None else q[:, None, None, None],
        None if kv is None else kv[:, None, None, None])
    for extra in (given_mask, None if bias is None else bias > -jnp.inf):
      if extra is not None:
        extra = jax.lax.dynamic_slice_in_dim(
            jnp.broadcast_to(extra, extra.shape[:2] + (t, s)), start, size, 2)
        ok = extra if ok is None else ok & extra
    return ok

  code = jax.lax.cond(
      garbage,
      lambda: checks.seen_codes_by_rows(visible, q_code, kv_code, t),
      lambda: jnp.zeros(q_code.shape, jnp.float32))  # [B, N, T]
  out, = checks.poison(code, out)
  return out
