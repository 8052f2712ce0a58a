"""The TPU paged decode kernel: JAX's Pallas TPU paged attention over our pages.

Shape glossary: B sequences, N query heads, K key/value heads, G = N // K,
Z page size, M pages per sequence, P pages in the pool, H head dim.

``PagedTpu`` runs ``jax.experimental.pallas.ops.tpu.paged_attention`` (jax
0.10.2): one query per sequence (a decoding step) over the pages its table
names, G query heads per key/value head, the pages streamed block by block
with double-buffered DMA. On a non-TPU backend it runs only as
``PagedTpu(interpret=True)`` (the Pallas TPU interpreter: a check, not a
speed). JAX's newer ragged paged attention (mixed prefill and decode) was
the first choice; its kernel fails in this jax's TPU interpreter
(``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``),
so it could not be checked here.

What it implements, and the bridge:

* One query (``T == 1``) seeing every key of its sequence below its
  length, which is what causality at a decoding step's positions says:
  with ``q_offset``/``kv_offset`` the query sees the keys at positions up
  to its own, so the length given to the kernel is ``min(kv_lengths,
  q_offset - kv_offset + 1)`` (traced values welcome). A window, a rule, a
  dense mask, segment ids or query lengths would need a lower bound or a
  pattern the kernel has no place for: not declared, refused by name.
* The scale: the kernel has none; the query is multiplied by it first.
* Layout: the kernel reads ``[K, P, Z, H]`` pools; ours are ``[P, K, Z,
  H]``, so each call transposes the pool (a copy of the whole pool per
  call: a TPU-resident pool in the kernel's layout is left to do).
  Table entries past a sequence's pages (``P``: none) are clamped to a
  real page; the kernel never uses them below the length.
* Precision: the TPU multiplies float32 in bfloat16 passes (and the
  interpreter does the same), so float32 inputs would miss the contract's
  float32 tolerance: refused; bfloat16 queries and pages run.
* A sequence with nothing to see (length 0) gets output 0 (the kernel
  leaves its output block unwritten).
* Garbage: the kernel masks by adding a large negative number, so NaN or
  inf past a length (a reused page's leftovers) would spoil the row; the
  pages are made finite in the transposing copy, and a row whose visible
  slots held NaN or inf is poisoned after the call.
* Gradients: the kernel has no backward; the call is a ``custom_vjp``
  whose backward is the flash kernel's on the same pages (FlashAttention-2
  recomputation: exact, as the contract requires).
* No lse, sinks, score modifiers (soft cap included: the kernel caps
  before the length mask, which is ours, but the cap has to come from an
  ``aj.soft_cap`` it cannot read back out of a ``ScoreMod``) or quantised
  pages (its quantised tensors carry other scales).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from attention_jax.kernels import base
from attention_jax.kernels import paged_decode


def _compute_block(m: int) -> int:
  """Pages per compute block: the largest divisor of ``M`` up to 8 (the
  kernel needs one that divides the pages per sequence)."""
  return max(d for d in range(1, min(m, 8) + 1) if m % d == 0)


@dataclasses.dataclass(frozen=True)
class PagedTpu(base.Kernel):
  """JAX's TPU paged decode attention (see the module docstring)."""
  interpret: bool = False
  name = "paged_tpu"
  backend = "tpu"
  # One Pallas call: XLA cannot split it over sharded batch or heads, so
  # with a partition it runs per shard (kernels.per_shard).
  partitionable = False
  forward_mode = False  # its gradient is a custom VJP
  implements = frozenset({"pages", "causal", "kv_lengths", "q_offset",
                          "kv_offset"})

  def __post_init__(self):
    paged_decode.check_interpret(self.interpret)

  def supports(self, problem: base.Problem) -> str | None:
    reason = paged_decode.refusal(problem)
    if reason:
      return reason
    if jnp.dtype(problem.out_dtype) != jnp.bfloat16:
      return ("a TPU multiplies float32 in bfloat16 passes, which misses "
              "float32's tolerance: give bfloat16 queries and pages (or "
              "use the flash kernel)")
    return None

  def __call__(self, problem: base.Problem):
    st, arrays = paged_decode.step(problem)
    return paged_decode.result(problem, _run(st, self.interpret, arrays))


def _forward(st: paged_decode.Static, interpret: bool,
             a: paged_decode.Arrays):
  """The Pallas call: ``[B, N, Hv]``, 0 where a sequence sees nothing."""
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
  from jax.experimental.pallas.ops.tpu.paged_attention import (  # noqa: PLC0415
      paged_attention_kernel as tpu_paged,
  )

  pages = a.pages
  p, k, z, _ = pages.key_pages.shape
  _, lengths = paged_decode.span(st, a)  # causal: up to the query's slot
  table = jnp.minimum(jnp.asarray(pages.table, jnp.int32), p - 1)

  def finite(pool):  # fused into the transposing copy: no pass of its own
    ok = jnp.isfinite(pool)
    return (jnp.swapaxes(jnp.where(ok, pool, jnp.zeros((), pool.dtype)), 0, 1),
            ~jnp.all(ok, axis=-1))  # [K, P, Z, H], [P, K, Z]

  k_pages, k_bad = finite(pages.key_pages)
  v_pages, v_bad = finite(pages.value_pages)
  # The kernel masks by adding a large negative number, so NaN or inf in a
  # slot past a length (a free page's leftovers) would reach the row: the
  # pages are made finite above, and a row that sees a bad slot below its
  # length is poisoned after the call instead.
  pos = jnp.arange(table.shape[1] * z)  # [M * Z]
  slot_bad = (k_bad | v_bad)[table[:, pos // z], :, pos % z]  # [B, MZ, K]
  seen = slot_bad & (pos[None, :, None] < lengths[:, None, None])
  seen = jnp.repeat(jnp.any(seen, axis=1), a.query.shape[1] // k,
                    axis=1)  # [B, N]
  q = (a.query.astype(jnp.float32) * st.scale).astype(a.query.dtype)
  call = functools.partial(
      tpu_paged.paged_attention, q, k_pages, v_pages, lengths, table,
      pages_per_compute_block=_compute_block(table.shape[1]))
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      out = call()
  else:
    out = call()
  out = jnp.where((lengths > 0)[:, None, None], out,
                  jnp.zeros((), out.dtype))
  return jnp.where(seen[..., None], jnp.nan, out)


_run = paged_decode.with_flash_backward(_forward, returns_lse=False)
