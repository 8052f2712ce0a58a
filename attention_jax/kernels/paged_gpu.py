"""Our Pallas GPU paged decode kernel: split-KV over a paged cache, Triton.

Shape glossary: B sequences, N query heads, K key/value heads, G = N // K
(Gp: padded to a power of two >= 16, Triton's smallest dot), Z page size, M
pages per sequence, C partitions (split-KV), Mp pages per partition (a
power of two), P pages in the pool, H (Hv) key (value) head dim.

``PagedGpu`` is a paged cache's decoding step (``aj.paged_attention`` with
one query per sequence) as one ``pallas_call`` per sequence (vmapped over
``B``), grid ``(K, C)``: program ``(k, c)`` holds the G query heads of
key/value head ``k`` (GQA: a key is loaded once for all of them) and walks
partition ``c`` of the sequence's pages, ``Mp`` of them, which its
``BlockSpec`` index map picks out of the page table; each page is loaded by
its index in the table, dequantised if the pool is (int8/float8 with
``page_scales``), and met with an online softmax. The partitions' outputs
and log-sum-exps are merged after the call (``merge_attentions``; a sink is
one more part): split-KV (flash-decoding), so one query row over a long
sequence runs on ``K * C`` programs instead of ``K``.

Each sequence's visible key slots are one interval ``[lo, hi)`` (its length,
causality at its position, a window: ``paged_decode.span``), computed
outside; pages outside it are never loaded, slots outside it are masked
and their values zeroed (garbage past a length never reaches a row), and a
NaN or inf the row may see spoils that row alone (the dot carries it).

Gradients: the flash core's backward over the same pages
(``paged_decode.with_flash_backward``). ``interpret=True`` runs it in
Pallas's interpreter on any backend (a check, not a speed); on a GPU it
lowers through Triton (checked by lowering for ``cuda`` from a CPU: not yet
run on a GPU), which needs ``H``, ``Hv`` and ``Z`` powers of two >= 16.
``C`` defaults to enough partitions for ``B * K * C >= 128`` programs (a
machine's SMs; flash-decoding's rule, not tuned on hardware), at most one
per page.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from attention_jax.core import merge
from attention_jax.kernels import base
from attention_jax.kernels import paged_decode

_PROGRAMS = 128  # the programs split-KV aims for by default (~ a GPU's SMs)


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class PagedGpu(base.Kernel):
  """Split-KV paged decoding in Pallas (Triton); see the module docstring."""
  splits: int | None = None  # C; None: by _PROGRAMS
  interpret: bool = False
  num_warps: int = 4
  name = "paged_gpu"
  float64 = False  # float32 compute
  backend = "gpu"
  # One Pallas call: XLA cannot split it over sharded batch or heads, so
  # with a partition it runs per shard (kernels.per_shard).
  partitionable = False
  forward_mode = False  # its gradient is a custom VJP
  implements = frozenset({
      "pages", "page_scales", "causal", "window", "kv_lengths", "q_offset",
      "kv_offset", "sinks", "return_lse"})

  def __post_init__(self):
    base.check_block_size("splits", self.splits)
    base.check_block_size("num_warps", self.num_warps)
    paged_decode.check_interpret(self.interpret)

  def supports(self, problem: base.Problem) -> str | None:
    reason = paged_decode.refusal(problem)
    if reason:
      return reason
    if not self.interpret:
      pages = problem.pages
      for name, size in (("head dim H", pages.key_pages.shape[-1]),
                         ("value head dim Hv", pages.value_pages.shape[-1]),
                         ("page size Z", pages.page_size)):
        if size < 16 or size != _pow2(size):
          return (f"Triton's dots need a {name} that is a power of two "
                  f">= 16, got {size}")
    return None

  def __call__(self, problem: base.Problem):
    st, arrays = paged_decode.step(problem)
    m = arrays.pages.table.shape[1]
    b, k = arrays.query.shape[0], arrays.pages.key_pages.shape[1]
    splits = self.splits or -(-_PROGRAMS // (b * k))
    per = _pow2(-(-m // min(splits, m)))  # Mp
    config = (self.interpret, self.num_warps, -(-m // per), per)
    out, lse = _run(st, config, arrays)
    return paged_decode.result(problem, out,
                               lse if problem.return_lse else None)


def _kernel(lohi_ref, table_ref, q_ref, k_ref, v_ref, *refs, z: int,
            per: int, quantized: bool):
  """Program ``(k, c)``: its G heads over partition ``c``'s pages."""
  if quantized:
    k_scale_ref, v_scale_ref, o_ref, lse_ref = refs
  else:
    o_ref, lse_ref = refs
  c = pl.program_id(1)
  lo, hi = lohi_ref[0], lohi_ref[1]
  first_slot = c * per * z
  j_lo = jnp.clip(lo // z - c * per, 0, per)
  j_hi = jnp.clip(-(-hi // z) - c * per, j_lo, per)
  q = q_ref[...]  # [Gp, H], scaled
  gp, hv = q.shape[0], v_ref.shape[-1]

  def page(ref, scale_ref, p):
    x = ref[p]  # [Z, H]: the page, by its index in the table
    if scale_ref is None:
      return x
    return x.astype(jnp.float32) * scale_ref[p][:, None]

  def body(j, carry):
    m_prev, l_prev, o_prev = carry
    p = table_ref[j]
    kj = page(k_ref, k_scale_ref if quantized else None, p)
    vj = page(v_ref, v_scale_ref if quantized else None, p)
    cols = first_slot + j * z + jnp.arange(z)
    ok = (cols >= lo) & (cols < hi)  # [Z]
    logits = jax.lax.dot_general(
        q, kj.astype(q.dtype), (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32)  # [Gp, Z]
    logits = jnp.where(ok[None, :], logits, -jnp.inf)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))
    shift = jnp.where(m_next > -jnp.inf, m_next, 0.0)
    p_blk = jnp.exp(logits - shift[:, None])  # 0 where not ok
    rescale = jnp.exp(m_prev - shift)
    vj = jnp.where(ok[:, None], vj, jnp.zeros((), vj.dtype))
    o_next = o_prev * rescale[:, None] + jax.lax.dot_general(
        p_blk.astype(vj.dtype), vj, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)
    return m_next, l_prev * rescale + p_blk.sum(-1), o_next

  init = (jnp.full((gp,), -jnp.inf, jnp.float32),
          jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, hv), jnp.float32))
  m_i, l_i, o = jax.lax.fori_loop(j_lo, j_hi, body, init)
  seen = l_i > 0
  o_ref[...] = (o / jnp.where(seen, l_i, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m_i + jnp.log(jnp.where(seen, l_i, 1.0)),
                           -jnp.inf)


def _forward(st: paged_decode.Static, config, a: paged_decode.Arrays):
  """``(out [B, N, Hv], lse [B, N])`` by the kernel, partitions merged."""
  interpret, num_warps, count, per = config
  pages = a.pages
  b, n, h = a.query.shape
  p, k, z, hv = pages.value_pages.shape
  g = n // k
  gp = max(16, _pow2(g))
  lo, hi = paged_decode.span(st, a)
  lohi = jnp.stack([lo, hi], axis=1)  # [B, 2]
  table = jnp.minimum(jnp.asarray(pages.table, jnp.int32), p - 1)
  table = jnp.pad(table, ((0, 0), (0, count * per - table.shape[1])))
  q = (a.query.astype(jnp.float32) * st.scale).astype(a.query.dtype)
  q = jnp.pad(q.reshape(b, k, g, h), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  quantized = pages.key_scales is not None
  pool = lambda x: pl.BlockSpec((p, None) + x.shape[2:],  # noqa: E731
                                lambda kh, c: (0, kh) + (0,) * (x.ndim - 2))
  in_specs = [pl.BlockSpec((2,), lambda kh, c: (0,)),
              pl.BlockSpec((per,), lambda kh, c: (c,)),  # the partition's pages
              pl.BlockSpec((None, gp, h), lambda kh, c: (kh, 0, 0)),
              pool(pages.key_pages), pool(pages.value_pages)]
  extra = ()
  if quantized:
    in_specs += [pool(pages.key_scales), pool(pages.value_scales)]
    extra = (pages.key_scales, pages.value_scales)
  call = pl.pallas_call(
      functools.partial(_kernel, z=z, per=per, quantized=quantized),
      grid=(k, count), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, gp, hv),
                              lambda kh, c: (kh, c, 0, 0)),
                 pl.BlockSpec((None, None, gp), lambda kh, c: (kh, c, 0))],
      out_shape=[jax.ShapeDtypeStruct((k, count, gp, hv), a.query.dtype),
                 jax.ShapeDtypeStruct((k, count, gp), jnp.float32)],
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=2))
  run = lambda lohi, table, q: call(lohi, table, q, pages.key_pages,  # noqa: E731
                                    pages.value_pages, *extra)
  outs, lses = jax.vmap(run)(lohi, table, q)  # [B, K, C, Gp, Hv]
  outs = outs[:, :, :, :g].reshape(b, k, count, g, hv)
  lses = lses[:, :, :, :g]
  parts_out = [outs[:, :, c].reshape(b, n, hv) for c in range(count)]
  parts_lse = [lses[:, :, c].reshape(b, n) for c in range(count)]
  if a.sinks is not None:  # a sink is a part with output 0
    parts_out.append(jnp.zeros_like(parts_out[0]))
    parts_lse.append(jnp.broadcast_to(a.sinks.astype(jnp.float32), (b, n)))
  return merge.merge_attentions(parts_out, parts_lse)


_run = paged_decode.with_flash_backward(_forward)
