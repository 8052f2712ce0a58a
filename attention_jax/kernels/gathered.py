"""The gathered kernel: each query over the keys of its token selection.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim, k the tokens a query chose, c the queries of one chunk.

A token selection (``aj.select_tokens``: DeepSeek's sparse attention picks
each query's top-k keys) leaves every query ``k`` keys, scattered over the
sequence: nearly every ``[bq, bk]`` block holds some query's choice, so
the flash walk would visit them all. This kernel gathers each query's
keys and values instead (``[c, k, H]`` per chunk of queries) and runs the
softmax over them: O(T * k) work and memory per head, never ``[T, S]``.
The rest of the mask (causality, windows, lengths, segment ids) and the
score modifier are evaluated at the gathered (query, key) pairs; sinks
join each row's denominator. A key chosen twice counts once (the rule is
membership). Gradients by JAX's autodiff of the gather (a scatter-add
into the keys and values), each chunk recomputed in the backward pass
(``jax.checkpoint``) so its ``[c, k, H]`` gathers are not kept. Forward
mode too.

It takes nothing else: a call without a token selection, or with a dense
mask, a bias, dropout, weights, max logits or pages, is refused (by name,
with the kernel that takes it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.core import softmax
from attention_jax.kernels import base
from attention_jax.masking import intervals
from attention_jax.masking import selection


@dataclasses.dataclass(frozen=True)
class Gathered(base.Kernel):
  """Token selections by gathering each query's keys: O(T * k) per head.

  Args:
    chunk: queries gathered at a time (memory ``chunk * k * (H + Hv)`` per
      head and step).
  """
  chunk: int = 128
  name = "gathered"
  jit = True  # pure: eager calls compile it whole
  implements = frozenset({
      "causal", "window", "q_lengths", "kv_lengths", "q_segment_ids",
      "kv_segment_ids", "rule", "sinks", "score_mod", "return_lse"})
  requires = frozenset({"rule"})  # (the other calls never reach supports)

  def __post_init__(self):
    checks.check_positive_int("chunk", self.chunk)

  def supports(self, problem: base.Problem) -> str | None:
    if not selection.is_token_selection(problem.ops.rule):
      return ("it attends over a token selection only (aj.select_tokens as "
              "the mask's rule: DSA's top-k keys per query); use 'flash' or "
              "'dense' for other masks")
    return None

  def __call__(self, problem: base.Problem):
    ops, p = problem.ops, problem

    def head(q, k, v, h):
      return single_head(q, k, v, h, scale=p.scale, is_causal=ops.causal,
                         window=ops.window, score_mod=ops.score_mod,
                         out_dtype=p.out_dtype, want_lse=p.return_lse,
                         chunk=self.chunk)

    return base.lift_heads(head, ops)


def single_head(query, key, value, h: base.Head, *, scale, is_causal, window,
                score_mod, out_dtype, want_lse: bool, chunk: int):
  """One head: q ``[T, H]``, k ``[S, H]``, v ``[S, Hv]`` and its ``Head``
  (whose rule is a token selection); ``(out [T, Hv], None, lse [T] or
  None)``."""
  t, s = query.shape[0], key.shape[0]
  compute = checks.compute_dtype(out_dtype)
  picks = selection.head_tokens(h.rule, *h.index)  # [T, k]
  c = min(chunk, t)
  tp = -(-t // c) * c
  picks = jnp.pad(picks, ((0, tp - t), (0, 0)), constant_values=-1)
  q_pad = jnp.pad(query, ((0, tp - t), (0, 0)))
  bounds = intervals.bounds(is_causal, window)
  offset, q_start, kv_start = h.offsets(t, s)
  q_ids = None if h.q_segment_ids is None else jnp.pad(
      h.q_segment_ids, (0, tp - t))

  @jax.checkpoint  # the backward pass gathers again: no [T, k, H] kept
  def one_chunk(i):
    rows = i * c + jnp.arange(c)  # [c]
    chosen = jnp.sort(jax.lax.dynamic_slice_in_dim(picks, i * c, c), -1)
    repeat = jnp.concatenate([jnp.zeros((c, 1), bool),
                              chosen[:, 1:] == chosen[:, :-1]], -1)
    ok = (chosen >= 0) & (chosen < s) & ~repeat & (rows[:, None] < t)
    cols = jnp.where(ok, chosen, 0)  # [c, k]
    seen = intervals.visible(
        rows[:, None], cols, offset, bounds, h.q_lengths, h.kv_lengths,
        None if q_ids is None else jax.lax.dynamic_slice_in_dim(
            q_ids, i * c, c)[:, None],
        None if h.kv_segment_ids is None else h.kv_segment_ids[cols])
    if seen is not None:
      ok = ok & seen
    qi = jax.lax.dynamic_slice_in_dim(q_pad, i * c, c)  # [c, H]
    kg, vg = key[cols], value[cols]  # [c, k, H], [c, k, Hv]
    logits = jnp.einsum("cH,ckH->ck", qi, kg,
                        preferred_element_type=compute)
    logits = logits * jnp.asarray(scale, compute)
    if score_mod is not None:
      b, n = h.index
      logits = jnp.broadcast_to(score_mod(
          jnp.where(ok, logits, 0.0), b, n, rows[:, None] + q_start,
          cols + kv_start), logits.shape).astype(compute)
      ok = ok & (logits > -jnp.inf)
    weights = softmax.masked_softmax(logits, ok)  # [c, k]
    lse = softmax.masked_logsumexp(logits, ok)  # [c]
    # Values a row does not attend to are zeroed: NaN there stays out.
    vg = jnp.where(ok[..., None], vg, jnp.zeros((), vg.dtype))
    out = jnp.einsum("ck,ckV->cV", weights, vg.astype(compute),
                     preferred_element_type=compute)
    return out, lse

  out, lse = jax.lax.map(one_chunk, jnp.arange(tp // c))
  out = out.reshape(tp, -1)[:t]
  lse = lse.reshape(tp)[:t]
  if h.sink is not None:  # exp(sink) joins each row's denominator
    out, _, lse = checks.with_sink(out, lse, h.sink, h.q_lengths)
  return out.astype(out_dtype), None, lse if want_lse else None
