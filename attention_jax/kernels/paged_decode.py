"""What the fused paged decode kernels share: one record of a decoding step
over pages, and its gradient by the flash core.

Shape glossary: B sequences, N query heads, K key/value heads, G = N // K,
Z page size, M pages per sequence, P pages in the pool, H (Hv) key (value)
head dim.

``Step`` is a paged ``Problem`` with one query per sequence, as a fused
decode kernel reads it: queries ``[B, N, H]``, each sequence's length and
the query's and keys' positions ``[B]``, the pages, sinks ``[N]``. Its
pattern is the static causal flag and window: the query at position
``q_offset`` sees the keys at ``kv_offset + j`` for ``j`` below the length,
up to its own position if causal, down to ``window[0]`` before it. ``span``
turns that into each sequence's visible key interval ``[lo, hi)``, all a
one-query kernel needs.

``with_flash_backward(forward)`` makes a forward of the step's arrays
differentiable: its backward is the flash core's over the same pages
(``flash_core.paged_head`` per sequence and head; FlashAttention-2
recomputation), exact, as the contract asks of every kernel.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.kernels import base
from attention_jax.kernels import flash_core


class Arrays(NamedTuple):
  """The step's arrays (a pytree, what the custom VJP differentiates)."""
  query: jax.Array  # [B, N, H]
  pages: base.Pages
  lengths: jax.Array  # int32 [B]
  q_offset: jax.Array  # int32 [B]
  kv_offset: jax.Array  # int32 [B]
  sinks: jax.Array | None  # [N]


class Static(NamedTuple):
  """The step's static pattern and scale (hashable)."""
  scale: float
  causal: bool
  window: tuple[int, int] | None


def one_per_sequence(x, b: int, name: str):
  """``x`` (aligned to the call's leading dims) as ``[B]``, or a reason."""
  x = jnp.asarray(x, jnp.int32)
  if any(d != 1 for d in x.shape[1:]):
    raise ValueError(f"{name} per head")
  return jnp.broadcast_to(x.reshape(x.shape[:1] or (1,)), (b,))


def check_interpret(interpret) -> None:
  if not isinstance(interpret, bool):
    raise TypeError(f"interpret must be a Python bool, got {interpret!r}.")


def refusal(problem: base.Problem) -> str | None:
  """Why a one-query paged kernel cannot read ``problem``, or None (its
  backend is checked before: ``base.refusal``)."""
  ops = problem.ops
  if problem.pages is None:
    return "it reads a paged cache only (aj.paged_attention)"
  if ops.query.shape[-2] != 1:
    return (f"it decodes one query per sequence, got T = "
            f"{ops.query.shape[-2]} (prefill with the flash kernel)")
  for name, x in (("kv_lengths", ops.kv_lengths), ("q_offset", ops.q_offset),
                  ("kv_offset", ops.kv_offset)):
    if x is not None and any(d != 1 for d in jnp.shape(x)[1:]):
      return f"it takes one {name} per sequence, not per head"
  if (ops.causal or ops.window is not None) and not ops.positioned:
    return ("causality and windows need the query's position (the mask's "
            "q_offset/kv_offset, which aj.paged_attention gives)")
  return None


def step(problem: base.Problem) -> tuple[Static, Arrays]:
  """The step of a paged ``problem`` that ``refusal`` let through."""
  ops, pages = problem.ops, problem.pages
  b = pages.table.shape[0]
  q = jnp.asarray(ops.query)
  n = math.prod(q.shape[1:-2])  # query heads, grouped or not
  q = q.reshape(b, n, q.shape[-1])  # [B, N, H]
  zero = jnp.zeros((b,), jnp.int32)
  q_offset = zero if ops.q_offset is None else one_per_sequence(
      ops.q_offset, b, "q_offset")
  kv_offset = zero if ops.kv_offset is None else one_per_sequence(
      ops.kv_offset, b, "kv_offset")
  sinks = None
  if ops.sinks is not None:
    sinks = jnp.broadcast_to(base.merge_groups(ops.sinks, ops.groups, -1),
                             ops.query.shape[:1] + (n,))[0]  # [N]
  return (Static(float(problem.scale), ops.causal, ops.window),
          Arrays(q, pages, one_per_sequence(ops.kv_lengths, b, "kv_lengths"),
                 q_offset, kv_offset, sinks))


def span(st: Static, a: Arrays):
  """``(lo, hi)`` int32 ``[B]``: the key slots the query sees."""
  pos = a.q_offset - a.kv_offset  # the query's position in slots
  lo, hi = jnp.zeros_like(a.lengths), a.lengths
  if st.causal:
    hi = jnp.minimum(hi, pos + 1)
  if st.window is not None:
    left, right = st.window
    lo = jnp.maximum(lo, pos - left)
    hi = jnp.minimum(hi, pos + right + 1)
  return lo, jnp.maximum(hi, lo)


def result(problem: base.Problem, out, lse=None) -> base.Result:
  """``out [B, N, Hv]`` (``lse [B, N]``) in the call's layout."""
  ops = problem.ops
  out = out.reshape(ops.query.shape[:-1] + (out.shape[-1],))
  if lse is not None:
    lse = lse.reshape(ops.query.shape[:-1])
  return base.Result(base.merge_groups(out, ops.groups, -3),
                          lse=base.merge_groups(lse, ops.groups, -2))


def flash_reference(st: Static, a: Arrays):
  """The step by the flash core over the pages: ``(out [B, N, Hv], lse
  [B, N])`` (the backward of the fused kernels)."""
  n, k = a.query.shape[1], a.pages.key_pages.shape[1]
  z = a.pages.key_pages.shape[2]

  def one(q_row, row, length, q_off, kv_off, head, sink):
    kv_head = head // (n // k)
    out, _, lse = flash_core.paged_head(
        q_row[None], flash_core.PagedRows(a.pages.key_pages, kv_head, row,
                                          a.pages.key_scales),
        flash_core.PagedRows(a.pages.value_pages, kv_head, row,
                             a.pages.value_scales),
        base.Head(kv_lengths=length, q_offset=q_off, kv_offset=kv_off,
                       sink=sink), scale=st.scale, is_causal=st.causal,
        window=st.window, block_q=1, block_k=z, out_dtype=a.query.dtype)
    return out[0], lse[0]

  heads = jnp.arange(n, dtype=jnp.int32)
  sinks = a.sinks
  per_head = jax.vmap(one, in_axes=(0, None, None, None, None, 0,
                                    None if sinks is None else 0))
  return jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, None, None))(
      a.query, jnp.asarray(a.pages.table, jnp.int32), a.lengths, a.q_offset,
      a.kv_offset, heads, sinks)


def with_flash_backward(forward, *, returns_lse: bool = True):
  """``forward(static, config, arrays) -> (out, lse)`` (or ``out`` alone,
  ``returns_lse=False``) made differentiable by the flash core's backward
  (module docstring); ``static`` and ``config`` hashable."""

  def reference(st, a):
    out, lse = flash_reference(st, a)
    return (out, lse) if returns_lse else out

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def run(st, config, a):
    return forward(st, config, a)

  def fwd(st, config, a):
    return forward(st, config, a), a

  def bwd(st, config, a, cotangents):
    del config
    _, vjp = jax.vjp(lambda a: reference(st, a), a)
    (d_a,) = vjp(cotangents)
    return (d_a,)

  run.defvjp(fwd, bwd)
  return run


