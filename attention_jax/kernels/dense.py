"""The dense kernel: the whole ``[T, S]`` score matrix of one head at once.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim.

``Dense`` is the kernel (``kernels.base``); ``single_head`` its maths,
written for one head and lifted over leading dims by
``base.lift_heads``. Logits, softmax and the weighted sum run in the
compute dtype (float32, float64 for float64 inputs); one path whether or not
the weights are returned or dropout is on, so the numbers never change with
those options. NaN or inf in a key, value or query reaches only the rows
that may see it (``checks.finite_values``/``codes``/``poison``; one
query row, a decoding step, reads what it saw off its own logits and
output instead, so that a step makes no extra pass over the cache). The
only kernel with
weights and float64; its dropout draws the same keep mask as the flash
kernel's (``core/dropout.py``: one bit per (seed, b, h, q, kv)). With
``return_max_logits`` it also returns each row's maximum raw scaled logit
(``kernels.base``), read off the same ``[T, S]`` logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.core import dropout
from attention_jax.core import softmax
from attention_jax.kernels import base
from attention_jax.masking import intervals


@dataclasses.dataclass(frozen=True)
class Dense(base.Kernel):
  """Materialises one head's ``[T, S]`` scores: every feature, O(T * S)."""
  name = "dense"
  jit = True  # pure: eager calls compile it whole
  # Every mask field and option: the reference the others are checked by.
  implements = base.MASK_FIELDS | (base.OPTIONS - {"pages"})

  def supports(self, problem: base.Problem) -> str | None:
    del problem
    return None

  def __call__(self, problem: base.Problem):
    ops, p = problem.ops, problem
    seed = None
    if p.dropout_rng is not None and p.dropout_on:
      seed = dropout.seed_words(p.dropout_rng)  # [2]: the call's draw

    def head(q, k, v, h, seed, garbage):
      return single_head(
          q, k, v, h, seed, scale=p.scale, is_causal=ops.causal,
          window=ops.window, score_mod=ops.score_mod,
          dropout_rate=p.dropout_rate, out_dtype=p.out_dtype,
          compute_dtype=checks.compute_dtype(p.out_dtype),
          want_lse=p.return_lse, want_max_logits=p.return_max_logits,
          garbage=garbage)

    # One predicate for the whole call (a scalar: unmapped by the heads'
    # vmap, so each head's cond stays a branch and not a select).
    garbage = checks.any_nonfinite(ops.query, ops.key, ops.value)
    return base.lift_heads(head, ops, (seed, garbage), (1, 0))


def single_head(query, key, value, h, seed, *, scale, is_causal, window,
                score_mod, dropout_rate, out_dtype, compute_dtype, want_lse,
                want_max_logits=False, garbage=None):
  """One head: q ``[T, H]``, k ``[S, H]``, v ``[S, Hv]``.

  ``h`` is the head's ``base.Head`` (mask, bias, lengths, segment
  ids, sink, the head's ``(b, h)`` for score_mod, block mask), ``seed``
  the call's dropout seed (``dropout.seed_words``) or None: the keep mask
  is drawn per entry from ``(seed, b, h, q_idx, kv_idx)``, as every kernel
  with dropout draws it; ``window`` and ``score_mod`` as in
  ``intervals`` / the flash core; ``garbage`` a bool scalar, whether any of
  q, k, v holds a NaN or inf (None: search for the rows that see one
  anyway), so that a clean call makes no ``[T, S]`` pass for them.
  Returns ``(out [T, Hv], weights [T, S], lse [T] or None)``, and with
  ``want_max_logits`` also ``max_logits [T]`` (each row's largest raw
  ``scale * q . k`` where it attends, ``-inf`` where it attends nowhere; no
  gradient); weights, lse and max_logits in ``compute_dtype``, out in
  ``out_dtype``.
  """
  t, s = query.shape[0], key.shape[0]
  # NaN or inf anywhere reaches only the rows that may see it: every
  # product runs on finite operands, and those rows are poisoned at the end.
  # One query row (a decoding step) is the exception: its keys and values
  # are only zeroed where it does not look (a pass the pattern needs
  # anyway), and what it sees is read off its own logits and output. Any
  # other test would be one more pass over a decoding cache: a reduction
  # per key row (not vectorised on XLA:CPU) or a branch (whose operands
  # XLA copies).
  one_row = t == 1
  given = query, key, value  # the codes read them, only if there is garbage
  q_bad = None
  if one_row:
    q_bad = ~jnp.all(jnp.isfinite(query))
    query, = checks.finite_values(query)
  else:
    query, key, value = checks.finite_values(query, key, value)
  at = _Indices(h, t, s, intervals.bounds(is_causal, window))
  allowed = at.pattern(h)
  # Only a structural pattern blocks (iota comparisons, lengths, segments):
  # the operands are sanitized, and unseen keys and empty rows' queries
  # zeroed (finite garbage there could still overflow a product), so every
  # blocked logit is finite and the softmax may block with an additive
  # -inf, which XLA fuses with the products instead of a select pass over
  # [T, S].
  additive = (h.dense is None and h.bias is None and score_mod is None)
  query, key, value = _zero_unseen(query, key, value, h, at, allowed,
                                   additive, one_row)
  logits, raw, finite, bad_key = _logits(query, key, h, at, scale, score_mod,
                                         compute_dtype, one_row)
  if finite is not None:  # where a bias or score_mod blocks
    allowed = _and(allowed, finite, t, s)

  def codes():  # [T]: the largest code each row sees
    # The pattern is recomputed from its small operands here, so that the
    # branch takes no materialised [T, S] array.
    return checks.seen_codes(_and(at.pattern(h), finite, t, s),
                               *checks.codes(*given))

  if one_row:
    if allowed is not None:  # values only where the row attends
      value, = checks.zero_unseen(allowed[0], value)
    code = None  # from the logits (here) and the output (below)
  else:
    code = codes() if garbage is None else jax.lax.cond(
        garbage, codes, lambda: _zeros_like_result(codes))
  max_logits = None
  if want_max_logits:  # a statistic: no gradient
    seen = raw if allowed is None else jnp.where(allowed, raw, -jnp.inf)
    max_logits = jax.lax.stop_gradient(
        jnp.max(seen, axis=-1, initial=-jnp.inf))  # [T]
  weights, lse = _weights(logits, allowed, h, additive,
                          want_lse or h.sink is not None)
  probs = weights
  if seed is not None:  # inverted dropout: E[probs] == weights
    keep = dropout.keep_mask(seed, *h.index, at.q, at.kv,
                             dropout_rate)  # [T, S]
    probs = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("TS,SV->TV", probs, value.astype(compute_dtype),
                   preferred_element_type=compute_dtype)  # [T, Hv]
  if one_row:  # a value it attends to that is not finite makes out so
    code = _one_row_code(out, allowed, bad_key, q_bad, s)
  out, weights, lse, max_logits = checks.poison(
      code, out.astype(out_dtype), weights, lse, max_logits)
  if want_max_logits:
    return out, weights, lse, max_logits
  return out, weights, lse


def _and(a, b, t: int, s: int):
  """``a & b`` over ``[T, S]``, either None for everywhere."""
  if b is None:
    return a
  b = jnp.broadcast_to(b, (t, s))
  return b if a is None else a & b


class _Indices:
  """One head's rows and columns: ``rows [T, 1]``, ``cols [1, S]``, the
  band's offset, and the positions rules and score_mod see (``q``,
  ``kv``)."""

  def __init__(self, h, t: int, s: int, bounds: intervals.Bounds):
    self.t, self.s, self.bounds = t, s, bounds
    self.rows, self.cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    self.offset, q_start, kv_start = h.offsets(t, s)
    self.q, self.kv = self.rows + q_start, self.cols + kv_start

  def pattern(self, h):
    """Where the mask fields allow, ``[T, S]`` (None: everywhere)."""
    q_ids = None if h.q_segment_ids is None else h.q_segment_ids[:, None]
    kv_ids = None if h.kv_segment_ids is None else h.kv_segment_ids[None, :]
    allowed = _and(h.dense, intervals.visible(
        self.rows, self.cols, self.offset, self.bounds, h.q_lengths,
        h.kv_lengths, q_ids, kv_ids), self.t, self.s)
    if h.rule is not None:  # the predicate the flash core evaluates
      allowed = _and(allowed, h.rule.mask_fn(*h.index, self.q, self.kv),
                     self.t, self.s)
    return allowed


def _zero_unseen(query, key, value, h, at: _Indices, allowed, additive: bool,
                 one_row: bool):
  """Keys (and values) no query sees, and queries that see nothing, zeroed:
  finite garbage there could still overflow a product. One row's values
  wait for its bias and score_mod (``single_head``)."""
  t, s, bounds = at.t, at.s, at.bounds
  plain = _only_bounds(h)
  if allowed is not None and not (plain and _every_key_seen(bounds, t, s)):
    seen_keys = jnp.any(allowed, axis=0)  # [S]
    if one_row:
      key, = checks.zero_unseen(seen_keys, key)
    else:
      key, value = checks.zero_unseen(seen_keys, key, value)
  if (additive and allowed is not None
      and not (plain and _every_row_sees(bounds, t, s))):
    query, = checks.zero_unseen(jnp.any(allowed, axis=1), query)
  return query, key, value


def _logits(query, key, h, at: _Indices, scale, score_mod, compute_dtype,
            one_row: bool):
  """``(logits, raw, finite, bad_key)``: the scaled logits after the bias
  and score_mod ``[T, S]``, before them (what max_logits reads), where a
  -inf bias or score_mod blocks (None: nowhere) and, for one row, where a
  key is not finite (else None)."""
  t, s = at.t, at.s
  logits = jnp.einsum("TH,SH->TS", query, key,
                      preferred_element_type=compute_dtype)  # [T, S]
  logits = logits * jnp.asarray(scale, compute_dtype)
  bad_key = None
  if one_row:  # the query is finite: a NaN or inf here is the key's
    bad_key = ~jnp.isfinite(logits)  # [1, S]
    logits = jnp.where(bad_key, jnp.zeros((), logits.dtype), logits)
  raw = logits
  finite = None
  if h.bias is not None:
    logits = logits + jnp.broadcast_to(h.bias.astype(compute_dtype), (t, s))
    finite = logits > -jnp.inf
  if score_mod is not None:
    safe = logits if finite is None else jnp.where(finite, logits, 0.0)
    b, n = h.index
    logits = jnp.broadcast_to(score_mod(safe, b, n, at.q, at.kv),
                              (t, s)).astype(compute_dtype)
    if getattr(score_mod, "blocks", True):  # the built-ins never block
      finite = (logits > -jnp.inf) if finite is None else (
          finite & (logits > -jnp.inf))
  return logits, raw, finite, bad_key


def _weights(logits, allowed, h, additive: bool, want_lse: bool):
  """``(weights [T, S], lse [T] or None)``, a sink in the denominator."""
  if additive:
    weights, lse = softmax.softmax_and_lse(logits, allowed)  # [T, S], [T]
    lse = lse if want_lse else None
  else:
    weights = softmax.masked_softmax(logits, allowed)  # [T, S]
    lse = softmax.masked_logsumexp(logits, allowed) if want_lse else None
  if h.sink is not None:  # exp(sink) joins each row's denominator
    weights, _, lse = checks.with_sink(weights, lse, h.sink, h.q_lengths)
  return weights, lse


def _one_row_code(out, allowed, bad_key, q_bad, s: int):
  """One query row's code ``[1]``: a bad key or query it sees, else a
  value that made its output non-finite."""
  sees = jnp.ones((1, s), bool) if allowed is None else allowed
  return jnp.where(jnp.any(sees & bad_key) | (q_bad & jnp.any(sees)),
                   checks.BAD_KEY, jnp.where(
                       jnp.any(~jnp.isfinite(out)), checks.BAD_VALUE,
                       checks.CLEAN)).astype(jnp.float32)[None]


def _only_bounds(h) -> bool:
  """Whether the head's pattern is at most a causal bound and a window."""
  return all(x is None for x in (h.dense, h.kv_lengths, h.q_lengths, h.q_segment_ids,
                                 h.kv_segment_ids, h.rule, h.q_offset))


def _every_key_seen(b: intervals.Bounds, t: int, s: int) -> bool:
  """Whether bounds alone leave every key column seen by some query.

  The rows' intervals ``[r + s - t - left, r + s - t + right]`` overlap
  (``left + right >= 0``), so together they cover ``[s - t - left, s - 1 +
  right]``, which holds ``[0, s)`` unless the left bound cuts it.
  """
  return t > 0 and (b.left is None or b.left >= s - t)


def _every_row_sees(b: intervals.Bounds, t: int, s: int) -> bool:
  """Whether bounds alone leave every query row some key column.

  Row 0 sees up to column ``s - t + right``; the last row sees from
  ``s - 1 - left <= s - 1``, and a row between sees a column between.
  """
  return s > 0 and (b.right is None or s - t + b.right >= 0)


def _zeros_like_result(fn):
  """Zeros of ``fn()``'s type, without running it: inside ``shard_map``
  the other branch of a ``lax.cond`` varies over the same devices."""
  out = jax.eval_shape(fn)
  zeros = jnp.zeros(out.shape, out.dtype)
  manual = out.manual_axis_type  # None outside shard_map
  if manual is None or not manual.varying:
    return zeros
  return jax.lax.pcast(zeros, tuple(manual.varying), to="varying")
