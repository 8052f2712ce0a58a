"""Tuning the flash kernel's block sizes for one call on this machine.

Shape glossary: T query length, S key/value length, H head dim, Hv value
head dim; ``...`` leading dims that broadcast (e.g. ``B, N``).

``flash_core.block_sizes`` picks blocks by pattern, measured on one 2-core
CPU; another machine may prefer others. ``autotune(query, key, value,
mask, ...)`` times ``Flash(block_q, block_k)`` at candidate pairs for that
call's lengths, head dims, dtype, head count and pattern on this backend
(compiled; every pair warmed up untimed, then run once, the fastest few
then the median of ``repeats`` runs; forward and backward by default,
training being the common case) and writes the winner to this machine's
cache (``block_cache``). From then on ``Flash()`` without block sizes (the
automatic choice where it runs flash, ``aj.blockwise_attention``) runs the
cached pair for calls with the same key; ``flash_blocks`` says which pair
a call would run and whether it came from the cache, ``automatic_kernel``
whether the automatic choice runs flash at all (``autotune`` warns when it
does not). The library never tunes by itself: only a call of
``autotune`` times anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import pathlib
import statistics
import sys
import time
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.kernels import base
from attention_jax.kernels import block_cache
from attention_jax.kernels import flash
from attention_jax.kernels import flash_core
from attention_jax.kernels.block_cache import FlashBlocks
from attention_jax.masking import mask as mask_lib

# Each side of the default grid; a side keeps the sizes up to its length
# rounded up to a power of two (larger ones are clipped to the length: the
# same walk). 4 x 4 pairs at most.
GRID = (128, 256, 512, 1024)
# Every candidate runs once untimed (the warm-up), then once timed (the
# screening); only the FINALISTS fastest then run ``repeats`` more times
# for a median. At B4 N8 T=2048 fwd+bwd a run takes seconds on 2 cores: 16
# candidates timed 1 + repeats times each would take minutes; the
# screening took about one, and the warm-up as long again.
FINALISTS = 4
# The warning of a tuning the automatic choice would not use.
_UNUSED = (
    "autotune: the automatic choice (implementation=None) runs the {kernel!r}"
    " kernel for this call, not flash ({why}), so it never reads the blocks"
    " tuned here. They apply where the flash kernel runs: "
    "implementation='flash' (or aj.kernels.Flash()), or "
    "aj.blockwise_attention without block_q/block_k. Check a call with "
    "aj.explain(...).")


@dataclasses.dataclass(frozen=True)
class Tuned:
  """What ``autotune`` measured.

  Attributes:
    blocks: the fastest ``(block_q, block_k)``.
    timings: ``{(block_q, block_k): seconds}``: the ``FINALISTS``' medians
      of ``repeats`` runs; the others' one screening run (each after an
      untimed warm-up run).
    key: the cache key of the call (``block_cache.cache_key``: this
      machine's fingerprint and the call's signature).
    path: the cache file written, or None (``cache=False``, the cache
      ``off``, or a ``BlockMask`` with tables, whose sizes nothing
      overrides).
    automatic: the kernel the automatic choice (``implementation=None``)
      runs for this call on this backend (``automatic_kernel``):
      ``"flash"`` when it runs the tuned blocks; another name
      (``"dense"`` below ``MIN_SCORES`` scores per head, a fused kernel
      on a GPU or TPU) means they apply only where flash is asked for
      (``implementation="flash"``, ``aj.blockwise_attention``), and
      ``autotune`` warned so.
  """
  blocks: tuple[int, int]
  timings: dict[tuple[int, int], float]
  key: str
  path: pathlib.Path | None = None
  automatic: str = "flash"


def _problem(query, key, value, mask, *, bias, scale, score_mod, sinks):
  return base.canonicalize(query, key, value, mask, bias=bias, scale=scale,
                           score_mod=score_mod, sinks=sinks)


def _problem_of(q, k, v, m, b, s, *, scale, score_mod):
  """The timed program's ``Problem`` (its operands, positionally)."""
  return _problem(q, k, v, m, bias=b, scale=scale, score_mod=score_mod,
                  sinks=s)


def flash_blocks(query, key, value, mask=None, *, bias=None, scale=None,
                 is_causal: bool = False, score_mod: Any = None,
                 sinks=None, block_q: int | None = None,
                 block_k: int | None = None) -> FlashBlocks:
  """The blocks a flash call would run, and where they come from.

  Takes what ``aj.scaled_dot_product_attention`` takes (arrays or
  ``jax.ShapeDtypeStruct``s: only shapes and dtypes are read; nothing
  runs) and ``Flash``'s ``block_q``/``block_k``. Whether a call runs the
  flash kernel at all is ``aj.explain``'s answer (on a GPU or TPU the
  automatic choice often runs another).

  Args:
    query: ``[..., T, H]``.
    key: ``[..., S, H]``.
    value: ``[..., S, Hv]``.
    mask: an ``aj.Mask``, a dense mask array or an ``aj.BlockMask``.
    bias: optional ``[..., T, S]``-broadcastable float.
    scale: the logits' scale (None: ``1 / sqrt(H)``).
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``.
    score_mod: a score modifier, as the attention call takes it.
    sinks: optional per-head sink logits.
    block_q: ``Flash(block_q=...)``; None for the automatic pick.
    block_k: ``Flash(block_k=...)``; None for the automatic pick.

  Returns:
    ``FlashBlocks(block_q, block_k, source)``; ``source`` is ``"cache"``
    (tuned on this machine), ``"defaults"``, ``"given"`` or
    ``"block_mask"``.

  Example:
    >>> q = jax.ShapeDtypeStruct((4, 8, 2048, 64), jnp.float32)
    >>> aj.kernels.flash_blocks(q, q, q, is_causal=True)  # doctest: +SKIP
    FlashBlocks(block_q=256, block_k=512, source='defaults')
  """
  flash.Flash(block_q, block_k)  # checks the sizes
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  found = []

  def probe(q, k, v, m, b, s):
    found.append(block_cache.blocks(
        _problem(q, k, v, m, bias=b, scale=scale, score_mod=score_mod,
                 sinks=s), block_q, block_k))

  # Traced abstractly: ShapeDtypeStructs serve, and no array is touched.
  jax.eval_shape(probe, query, key, value, mask, bias, sinks)
  return found[0]


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def default_candidates(problem: base.Problem) -> list[tuple[int, int]]:
  """``GRID`` on each side, pruned to sizes up to the length rounded up to
  a power of two, and ``flash_core.block_sizes``' default pair (so the
  winner is never slower than the defaults as measured); a ``BlockMask``
  with tables allows only its own pair."""
  ops = problem.ops
  bm = ops.rule
  if bm is not None and bm.kinds is not None:
    return [(bm.block_q, bm.block_k)]
  t, s = ops.query.shape[-2], ops.key.shape[-2]
  qs = [b for b in GRID if b <= _pow2_at_least(t)] or [GRID[0]]
  ks = [b for b in GRID if b <= _pow2_at_least(s)] or [GRID[0]]
  pairs = [(bq, bk) for bq in qs for bk in ks]
  default = flash_core.block_sizes(ops, None, None)
  # The walk clips blocks to the lengths: a default past them is a pair
  # already listed.
  clipped = {(min(bq, t), min(bk, s)) for bq, bk in pairs}
  if (min(default[0], t), min(default[1], s)) not in clipped:
    pairs.append(default)
  return pairs


def _check_candidates(candidates, problem: base.Problem):
  """The caller's pairs, checked, without repeats (in their order)."""
  if isinstance(candidates, (str, bytes)) or not isinstance(
      candidates, Sequence) or not candidates:
    raise TypeError(f"candidates must be a non-empty sequence of "
                    f"(block_q, block_k) pairs of ints, got {candidates!r}.")
  pairs = []
  for pair in candidates:
    if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence)
        or len(pair) != 2):
      raise TypeError(f"candidates must hold (block_q, block_k) pairs of "
                      f"ints, got the entry {pair!r}.")
    checks.check_positive_int("candidates' block_q", pair[0])
    checks.check_positive_int("candidates' block_k", pair[1])
    pair = (int(pair[0]), int(pair[1]))
    if pair not in pairs:
      pairs.append(pair)
  bm = problem.ops.rule
  if bm is not None and bm.kinds is not None:
    own = (bm.block_q, bm.block_k)
    if any(pair != own for pair in pairs):
      raise ValueError(
          f"candidates {pairs} include sizes other than the block mask's "
          f"{own}: its tables fix the blocks. Pass candidates=None, or "
          "tune the rule itself (aj.Mask(rule=mask_fn): its tables are "
          "built at each candidate's sizes).")
  return pairs


class _Candidate(NamedTuple):
  blocks: tuple[int, int]  # (block_q, block_k)
  run: Callable[[], Any]  # one call of the compiled program on the operands


def _compile(fn, args) -> Callable[[], Any]:
  """``fn`` compiled for ``args`` (compile time is never timed), as a
  call on them."""
  return functools.partial(jax.jit(fn).lower(*args).compile(), *args)


def _seconds(candidate: _Candidate) -> float:
  """Wall seconds of one run of ``candidate``, to its outputs' readiness."""
  start = time.perf_counter()
  jax.block_until_ready(candidate.run())
  return time.perf_counter() - start


def _compiled(pairs, problem_of, args, fwd_bwd: bool) -> list[_Candidate]:
  """Each pair's program (``Flash(block_q, block_k)`` on the operands;
  with ``fwd_bwd``, ``jax.grad`` of the output's sum in q, k and v), run
  once untimed: a first run pays allocations and cold caches (up to ten
  times a later one's time measured), which the screening must not."""

  def attend(kernel, q, k, v, m, b, s):
    return kernel(problem_of(q, k, v, m, b, s)).out

  def loss(kernel, *a):
    return jnp.sum(attend(kernel, *a).astype(jnp.float32))

  found = []
  for bq, bk in pairs:
    kernel = flash.Flash(bq, bk)
    fn = (jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2))
          if fwd_bwd else functools.partial(attend, kernel))
    candidate = _Candidate((bq, bk), _compile(fn, args))
    jax.block_until_ready(candidate.run())  # the warm-up, untimed
    found.append(candidate)
  return found


def _fastest(candidates: list[_Candidate], repeats: int
             ) -> tuple[tuple[int, int], dict[tuple[int, int], float]]:
  """``(the fastest pair, {pair: seconds})``: every candidate timed once
  (the screening), the ``FINALISTS`` fastest then by the median of
  ``repeats`` runs; ties go to the earlier candidate."""
  timings = {c.blocks: _seconds(c) for c in candidates}
  finalists = sorted(candidates, key=lambda c: timings[c.blocks])[:FINALISTS]
  for c in finalists:
    timings[c.blocks] = statistics.median(
        _seconds(c) for _ in range(repeats))
  order = [c.blocks for c in candidates]  # the given order, for ties
  winner = min((c.blocks for c in finalists),
               key=lambda pair: (timings[pair], order.index(pair)))
  return winner, timings


def automatic_kernel(problem: base.Problem) -> tuple[str, str | None]:
  """``(name, why)``: the kernel the automatic choice
  (``implementation=None``) runs for ``problem`` on this backend, and why
  it passes over the flash kernel (None when it runs flash)."""
  # The package's REGISTRY (register() rebinds it), read when called: the
  # package imports this module, so importing it would be a cycle.
  registry = sys.modules[__package__].REGISTRY
  chosen = base.choose(registry, problem, automatic=True)
  if chosen.name == flash.Flash.name:
    return chosen.name, None
  for kernel, verdict, reason in base.verdicts(registry, problem, True):
    if kernel.name == flash.Flash.name:
      return chosen.name, (f"flash {verdict}: {reason}" if reason
                           else f"{chosen.name!r} comes first in "
                           "aj.kernels.REGISTRY")
  return chosen.name, "flash is not in aj.kernels.REGISTRY"


def autotune(query, key, value, mask=None, *, bias=None, scale=None,
             is_causal: bool = False, score_mod: Any = None, sinks=None,
             candidates: Sequence[tuple[int, int]] | None = None,
             repeats: int = 3, fwd_bwd: bool = True,
             cache: bool = True) -> Tuned:
  """Times the flash kernel at candidate block sizes for one call.

  Each candidate runs ``Flash(block_q, block_k)`` on these operands,
  compiled (``jax.jit``, compile time not counted), once untimed (a
  warm-up: a first run can take ten times a later one), then once timed (a
  screening); the ``FINALISTS`` (4) fastest then run ``repeats`` times
  more, and the one with the least median wins. With ``fwd_bwd`` it times
  ``jax.grad`` of the output's sum with respect to query, key and value
  (a training step's attention); else the forward alone. The winner is
  written to this machine's cache under the call's key, where ``Flash()``
  without sizes finds it (``flash_blocks`` shows it): calls of the same
  lengths, head dims, dtype, head counts, pattern kind, score modifier
  and no dropout then run it. At B4 N8 T=2048 fwd+bwd on 2 CPU cores the
  screening took about a minute, and the warm-up runs as long again; call
  it once per shape, outside ``jax.jit``, on the machine that will run,
  with nothing else loading it (other work skews the timings).

  Only the flash kernel reads tuned blocks. Where the automatic choice
  runs another kernel for this call (``dense`` below ``MIN_SCORES``
  scores per head, e.g. B2 N4 T=512; a fused kernel on a GPU or TPU) the
  tuning still runs and is cached, for calls that ask for flash
  (``implementation="flash"``, ``aj.blockwise_attention``), and a
  ``UserWarning`` says so; ``Tuned.automatic`` names the kernel.

  Args:
    query: float ``[..., T, H]`` (concrete: it runs).
    key: float ``[..., S, H]``.
    value: float ``[..., S, Hv]``.
    mask: an ``aj.Mask``, a dense mask array or an ``aj.BlockMask`` (whose
      tables fix the blocks: only its pair runs, and nothing is cached).
    bias: optional float broadcastable to ``[..., T, S]``.
    scale: the logits' scale (None: ``1 / sqrt(H)``).
    is_causal: shorthand for ``mask & aj.Mask(causal=True)``.
    score_mod: a score modifier, as ``aj.scaled_dot_product_attention``
      takes it.
    sinks: optional per-head sink logits.
    candidates: ``(block_q, block_k)`` pairs to time; None is
      ``default_candidates``: 128..1024 a side, up to each length rounded
      up to a power of two, and the default pair (16 pairs at most).
    repeats: timed runs per candidate (after the warm-up).
    fwd_bwd: time forward and backward (True) or the forward alone.
    cache: write the winner to the cache (``block_cache.cache_path()``:
      ``$AJ_AUTOTUNE_CACHE``, else the user's cache directory).

  Returns:
    A ``Tuned``: ``blocks`` the winner, ``timings`` every pair's seconds,
    ``key`` the cache key, ``path`` the file written (or None),
    ``automatic`` the kernel the automatic choice runs for this call.

  Raises:
    TypeError: traced operands (call it outside ``jax.jit``), or badly
      typed ``candidates``/``repeats``/flags.
    ValueError: the flash kernel refuses the call (float64, dropout is
      not taken here), or candidates a block mask's tables do not allow.

  Example:
    >>> import warnings
    >>> q = jnp.ones((1, 2, 256, 32))
    >>> with warnings.catch_warnings(record=True) as said:
    ...   tuned = aj.kernels.autotune(q, q, q, is_causal=True,
    ...                               candidates=[(128, 128), (256, 256)],
    ...                               repeats=1, cache=False)
    >>> tuned.blocks in tuned.timings
    True
    >>> tuned.automatic  # T * S below MIN_SCORES: flash only when asked for
    'dense'
    >>> "the automatic choice" in str(said[0].message)
    True
  """
  for name, flag in (("is_causal", is_causal), ("fwd_bwd", fwd_bwd),
                     ("cache", cache)):
    checks.check_static_bool(name, flag)
  checks.check_positive_int("repeats", repeats)
  leaves = jax.tree_util.tree_leaves((query, key, value, mask, bias, sinks,
                                      scale))
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    raise TypeError("autotune runs the call to time it: call it outside "
                    "jax.jit / grad / vmap, with concrete arrays.")
  mask = mask_lib.as_mask(mask, is_causal=is_causal)
  problem = _problem(query, key, value, mask, bias=bias, scale=scale,
                     score_mod=score_mod, sinks=sinks)
  default = flash.Flash()
  reason = base.refusal(default, problem)
  if reason is not None:
    raise ValueError(f"autotune times the flash kernel, which refuses this "
                     f"call: {reason}.")
  pairs = (default_candidates(problem) if candidates is None
           else _check_candidates(candidates, problem))
  automatic, why = automatic_kernel(problem)
  if why is not None:
    warnings.warn(_UNUSED.format(kernel=automatic, why=why), stacklevel=2)
  problem_of = functools.partial(_problem_of, scale=scale,
                                 score_mod=score_mod)
  winner, timings = _fastest(
      _compiled(pairs, problem_of, (query, key, value, mask, bias, sinks),
                fwd_bwd), repeats)
  key_text = block_cache.cache_key(problem)
  path = None
  bm = problem.ops.rule
  if cache and (bm is None or bm.kinds is None):
    path = block_cache.store(key_text, {
        "blocks": list(winner),
        "timings": {f"{bq}x{bk}": round(t, 6)
                    for (bq, bk), t in timings.items()},
        "mode": "fwd+bwd" if fwd_bwd else "fwd",
        "repeats": repeats,
    })
  return Tuned(winner, timings, key_text, path, automatic)
