"""Implementations vs a reference, then timed: ``python -m benchmarks.gpu_check``.

Meant to be run whenever a GPU or a TPU is at hand (the same script is the
TPU twin; it also runs on CPU, where a kernel that needs another backend is
skipped with its reason, or runs in Pallas's interpreter with
``--interpret=pallas_gpu,splash``). On the default
backend it checks ``aj.scaled_dot_product_attention`` with
``implementation=None`` ("auto") and with every kernel of
``aj.kernels.REGISTRY`` by its name, and ``aj.ring_attention`` ("ring": the
sequence split over every device inside ``jax.shard_map``; skipped with one
device), and ``aj.multi_head_attention`` with ``attention_fn=`` None and
each registered kernel's name, against the test suite's reference
``tests.reference.masked_attention`` (an explicit boolean ``allowed [B, N,
T, S]`` written out here from each case, a plain masked softmax, repeated
key/value heads) computed in float64 on CPU and in float32 at
``"highest"`` matmul precision elsewhere. Compared: outputs, the
log-sum-exp where the implementation returns it, and the gradients of a
random projection of both (``q``, ``k``, ``v``; for multi-head attention the
input and every parameter).

The paged level (``--paged``, on by default): a decoding step through
``aj.paged_attention`` (B sequences of ragged lengths, their pages
scattered over the pool; causal, and a window with sinks; float32 and
bfloat16) for "auto", the flash kernel and the paged kernels
(``PAGED_KERNELS``, checked at this level only), output and lse against a
float64 reference over each sequence's keys (forward only), then a decode
step timed at the longest length.

The case grid: plain, causal, causal cross-attention (``T < S``, bottom-right
aligned), grouped-query (``K = N / 4``, causal), key padding lengths (one
example of length 0, whose rows see nothing), a causal sliding window,
packed documents (segment ids), sinks, a soft cap, ALiBi and a T5 bias
(score modifiers), each with float32 and bfloat16 inputs; the
patterns go in as ``aj.Mask`` fields (lengths ``[B]``, segment ids ``[B,
T]``, the window), causality as ``is_causal``. Checks run under
``jax.default_matmul_precision("highest")`` so that float32 tolerances are
float32 rounding, not TF32's (the GPU default for float32 matmuls, about
1e-3 relative); bfloat16 inputs keep their own precision. Before a kernel
runs, its ``supports(problem)`` is asked: a kernel that cannot run on this
backend at all (cuDNN off a GPU) is skipped with its reason; one that
refuses a case it is known not to take (cuDNN: float32, segment ids) is
skipped with its message; one that takes the case only without the
log-sum-exp (cuDNN) runs without it; any other refusal or exception is a
FAIL.

Then forward and forward+backward of each implementation are timed at the
default matmul precision, medians of ``--repeats`` after a compiling call:
B4 N8 T=S=4096 H64 causal on a GPU, B1 N4 T=S=1024 H64 on CPU, tiny with
``--quick``. Then (``--patterns``) each pattern of ``PATTERNS`` (plain,
causal, window, packed documents, sinks, soft cap, ALiBi, T5 bias) at T = S
= 2k, 8k and 32k (B * T = 32k tokens, N8 H64, bfloat16) for the automatic
choice, cuDNN, splash, the Pallas GPU kernel, the flash core and
``jax.nn.dot_product_attention`` (plain, causal and window only), each as
a ratio to the flash core; points past ``--budget_s`` seconds of the whole
run are skipped and say so (the default fits one run in 8 minutes). Prints
a PASS/FAIL table and the timing tables, writes ``--out`` (JSON) if given,
and exits non-zero on any FAIL.

Layout ``[B, N, T, H]``; shape glossary: B batch, N query heads, K key/value
heads, T query length, S key/value length, H head dim, D model dim (N * H).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import attention_jax as aj
from attention_jax.kernels import base as kernel_base
from attention_jax.masking import mask as mask_lib
from tests import reference

# Normalised max error allowed per input dtype: max |got - want| over
# max(1, max |want|) for outputs and lse; for gradients over max(1, the
# largest |want| of all the call's gradients), since some are sums whose
# terms cancel (W_k's bias gets exactly 0: adding q . b to a whole row of
# logits changes no softmax), so their own size says nothing about their
# rounding. float32 (highest precision): the kernels and the reference
# round differently over <= 1024 keys, ~sqrt(S) * 6e-8 ~ 2e-6, and the flash
# backward recomputes P from the lse (a few more roundings); 1e-4 / 5e-4 leave
# room while a key masked wrongly moves outputs by ~1e-3 or more. bfloat16
# (eps 3.9e-3): the output's final rounding plus, in the flash kernels and
# cuDNN, P rounded to bfloat16 before P @ V, as in tests/contract.py.
TOLERANCES = {"float32": {"fwd": 1e-4, "grad": 5e-4},
              "bfloat16": {"fwd": 3e-2, "grad": 1e-1}}
# "auto" is implementation=None: the choice users get by default (on a GPU
# with 16-bit inputs and T * S >= 1024 * 1024, cuDNN). "ring" is
# aj.ring_attention over every device. The kernels in between are
# aj.kernels.REGISTRY's, by name (see ``implementations``).
AUTO, RING, JAX_NN = "auto", "ring", "jax.nn"
CASES = ("plain", "causal", "causal_cross", "gqa_causal", "lengths",
         "window", "segments", "sinks", "softcap", "alibi", "t5")
# Cases of the multi-head level: K < N heads projected, per-example lengths
# and segment ids, a window, through the layer's mask handling.
MHA_CASES = ("gqa_causal", "lengths", "window", "segments")
DTYPES = ("float32", "bfloat16")
# What a kernel (by name) is known to refuse: (feature -> why).
_NO_TRITON = "its Triton lowering cannot read arrays at traced indices"
KNOWN_REFUSALS = {
    "cudnn": {"float32": "cuDNN takes float16/bfloat16 only",
              "segments": "cuDNN takes no segment ids",
              "sinks": "jax.nn's cuDNN kernel has no sinks",
              "softcap": "jax.nn's cuDNN kernel takes no score modifier",
              "alibi": "jax.nn's cuDNN kernel takes no score modifier",
              "t5": "jax.nn's cuDNN kernel takes no score modifier"},
    "pallas_gpu": {"alibi": _NO_TRITON, "t5": _NO_TRITON},
    "splash": {"alibi": "splash's only score modifier is a soft cap",
               "t5": "splash's only score modifier is a soft cap"},
}
# The backend each accelerator kernel needs (unless interpreted).
BACKENDS = {"cudnn": "gpu", "pallas_gpu": "gpu", "splash": "tpu",
            "paged_gpu": "gpu", "paged_tpu": "tpu"}
# Kernels that read a paged cache only: checked at the paged level alone.
PAGED_KERNELS = ("paged_gpu", "paged_tpu")
PAGED_CASES = ("decode_causal", "decode_window_sinks")
# What a paged kernel is known to refuse at the paged level.
KNOWN_PAGED_REFUSALS = {
    "paged_tpu": {"float32": "a TPU multiplies float32 in bfloat16 passes",
                  "window": "JAX's TPU paged attention has no window",
                  "sinks": "JAX's TPU paged attention has no sinks"},
}
# The T5 case's buckets and reach (tests/contract.py's choice).
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128


def kernel_names() -> tuple[str, ...]:
  """The registered kernels' names, in the automatic choice's order."""
  return tuple(kernel.name for kernel in aj.kernels.REGISTRY)


def implementations(level: str = "sdpa") -> tuple[str, ...]:
  """What is checked at ``level``: "auto", every registered kernel, and (for
  ``scaled_dot_product_attention``, ``level="sdpa"``) "ring"; at
  ``level="paged"`` (``aj.paged_attention``) "auto", the flash kernel and
  the paged kernels."""
  if level == "paged":
    return (AUTO, "flash", *PAGED_KERNELS)
  names = tuple(n for n in kernel_names() if n not in PAGED_KERNELS)
  return (AUTO, *names) + ((RING,) if level == "sdpa" else ())


def _define_flags():
  """The command line's flags, defined only when run as a program."""
  global _QUICK, _OUT, _REPEATS, _CASES, _TIMING, _IMPLS, _PATTERNS
  global _BUDGET, _INTERPRET, _PAGED
  _QUICK = flags.DEFINE_bool(
      "quick", False, "Tiny shapes everywhere (a CPU smoke run, seconds).")
  _OUT = flags.DEFINE_string("out", None, "Write the results here (JSON).")
  _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per point.",
                                  lower_bound=1)
  _CASES = flags.DEFINE_list("cases", [],
                             f"Only these cases (default all): {CASES}.")
  _TIMING = flags.DEFINE_bool("timing", True, "Time fwd and fwd+bwd.")
  _IMPLS = flags.DEFINE_list(
      "impls", [], "Only these implementations (default all): "
      f"{implementations()}.")
  _PATTERNS = flags.DEFINE_bool(
      "patterns", True, f"Time {PATTERNS} at long sequences (bfloat16).")
  _BUDGET = flags.DEFINE_float(
      "budget_s", 420.0, "Seconds the whole run may take before the pattern "
      "timings skip their remaining points (8 minutes on one GPU, with "
      "start-up and the last compiles).")
  _PAGED = flags.DEFINE_bool(
      "paged", True, "Check and time a decoding step through a paged cache "
      f"({PAGED_CASES}): 'auto', the flash kernel, {PAGED_KERNELS}.")
  _INTERPRET = flags.DEFINE_list(
      "interpret", [], "Registered accelerator kernels to run in Pallas's "
      "interpreter (e.g. pallas_gpu on CPU: slow, a correctness check).")


@dataclasses.dataclass(frozen=True)
class Sizes:
  check: tuple[int, int, int, int]  # B, N, T = S, H of the checks
  window: int  # causal window (tokens, the query's own included)
  docs: int  # packed documents per example
  time: tuple[int, int, int, int]  # B, N, T = S, H of the timings


def sizes(quick: bool) -> Sizes:
  if quick:
    return Sizes((2, 4, 32, 16), 8, 3, (1, 2, 128, 16))
  if jax.default_backend() in ("gpu", "tpu"):
    return Sizes((2, 8, 1024, 64), 128, 5, (4, 8, 4096, 64))
  return Sizes((2, 4, 1024, 32), 128, 5, (1, 4, 1024, 64))


# --------------------------------------------------------------------------
# The reference: tests.reference.masked_attention, the contract suite's, on
# an ``allowed`` written out here from the case (not from the library's
# mask).


def _ref_dtype():
  return jnp.float64 if jax.default_backend() == "cpu" else jnp.float32


@contextlib.contextmanager
def _reference_mode():
  """float64 available on CPU; nothing to switch elsewhere."""
  if jax.default_backend() == "cpu":
    with jax.enable_x64(True):
      yield
  else:
    yield


def _reference_fn(case: Case):
  """The case's attention as ``reference.masked_attention``.

  Called like the library's functions (``mask``/``is_causal`` are accepted
  and ignored: ``case.allowed()`` stands for them), also as
  ``multi_head_attention``'s ``attention_fn``. Computes in the inputs'
  dtype (the reference dtype, upcast by the caller), at the matmul
  precision in effect.
  """
  allowed = case.allowed()  # [B, N, T, S]

  def attention(query, key, value, mask=None, is_causal=False,
                return_lse=False, **extras):
    del mask, is_causal, extras  # written out in `allowed` and the case
    out, lse = reference.masked_attention(
        query, key, value, None, allowed,
        **case.reference_extras(query.dtype))
    return (out, lse) if return_lse else out

  return attention


# --------------------------------------------------------------------------
# Cases.


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
  name: str
  b: int
  n: int
  k: int
  t: int
  s: int
  h: int
  causal: bool = False  # bottom-right: key j <= i + S - T
  window: tuple[int, int] | None = None  # (left, right), bottom-right
  kv_lengths: np.ndarray | None = None  # int32 [B]
  segment_ids: np.ndarray | None = None  # int32 [B, T] (T == S)
  softcap: float | None = None  # aj.soft_cap(c), after ALiBi / T5
  sinks: np.ndarray | None = None  # float32 [N] sink logits
  slopes: np.ndarray | None = None  # float32 [N]: aj.alibi
  t5_table: np.ndarray | None = None  # float32 [T5_BUCKETS, N]
  features: frozenset[str] = frozenset()

  def extras(self) -> dict:
    """The library's keywords for the case's sinks and score modifiers."""
    kw, mods = {}, []
    if self.sinks is not None:
      kw["sinks"] = jnp.asarray(self.sinks)
    if self.slopes is not None:
      mods.append(aj.alibi(jnp.asarray(self.slopes)))
    if self.t5_table is not None:
      mods.append(aj.t5_relative_bias(jnp.asarray(self.t5_table),
                                      max_distance=T5_MAX_DISTANCE))
    if self.softcap is not None:
      mods.append(aj.soft_cap(self.softcap))
    if mods:
      kw["score_mod"] = mods[0] if len(mods) == 1 else aj.chain(*mods)
    return kw

  def reference_extras(self, dtype) -> dict:
    """The same, as ``reference.masked_attention``'s arguments."""
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)  # noqa: E731
    return {"softcap": self.softcap, "sinks": cast(self.sinks),
            "slopes": cast(self.slopes), "t5_table": cast(self.t5_table),
            "t5_max_distance": T5_MAX_DISTANCE}

  def mask_parts(self):
    """``(static, arrays)``: the case's ``aj.Mask`` fields besides causality
    (which goes in as ``is_causal``). The arrays go through ``jit`` as
    arguments, so that XLA does not constant-fold work on them at compile
    time."""
    static = {} if self.window is None else {"window": self.window}
    arrays = {}
    if self.kv_lengths is not None:
      arrays["kv_lengths"] = jnp.asarray(self.kv_lengths)
    if self.segment_ids is not None:
      arrays["q_segment_ids"] = jnp.asarray(self.segment_ids)
    return static, arrays

  def allowed(self) -> np.ndarray:
    """Bool ``[B, N, T, S]``: where query ``i`` may see key ``j``."""
    i = np.arange(self.t)[:, None] + (self.s - self.t)  # the key position
    j = np.arange(self.s)[None, :]
    allowed = np.ones((self.b, self.n, self.t, self.s), bool)
    if self.causal:
      allowed &= j <= i
    if self.window is not None:
      left, right = self.window
      allowed &= (j >= i - left) & (j <= i + right)
    if self.kv_lengths is not None:
      allowed &= j < self.kv_lengths[:, None, None, None]
    if self.segment_ids is not None:
      ids = self.segment_ids
      allowed &= (ids[:, :, None] == ids[:, None, :])[:, None]
    return allowed


def _mask(static, arrays) -> aj.Mask | None:
  return aj.Mask(**static, **arrays) if static or arrays else None


def build_case(name: str, z: Sizes) -> Case:
  b, n, t, h = z.check
  k, s, fields, features = n, t, {}, set()
  if name == "causal":
    fields["causal"] = True
  elif name == "causal_cross":
    t = t // 2
    fields["causal"] = True
  elif name == "gqa_causal":
    k = max(1, n // 4)
    fields["causal"] = True
  elif name == "lengths":
    lengths = [s, s - s // 4 - 3, 1, 0][:b] if b >= 4 else [s - s // 4 - 3,
                                                            0][:b]
    fields["kv_lengths"] = np.array(lengths, np.int32)  # [B]
  elif name == "window":
    fields["causal"] = True
    fields["window"] = (z.window - 1, 0)
  elif name == "segments":
    fields["causal"] = True
    ids = []
    for e in range(b):  # contiguous documents, other cut points per example
      cuts = np.sort(np.random.default_rng(e).choice(
          np.arange(1, t), z.docs - 1, replace=False))
      ids.append(np.searchsorted(cuts, np.arange(t), side="right"))
    fields["segment_ids"] = np.array(ids, np.int32)  # [B, T]
    features.add("segments")
  elif name == "sinks":
    fields["causal"] = True
    fields["sinks"] = np.random.default_rng(7).normal(size=n).astype(
        np.float32)
    features.add("sinks")
  elif name == "softcap":
    fields["causal"] = True
    fields["softcap"] = 2.0  # low enough to bend the unit-normal logits
    features.add("softcap")
  elif name == "alibi":
    fields["causal"] = True
    fields["slopes"] = np.asarray(aj.alibi_slopes(n), np.float32)
    features.add("alibi")
  elif name == "t5":
    fields["t5_table"] = np.random.default_rng(8).normal(
        size=(T5_BUCKETS, n)).astype(np.float32)
    features.add("t5")
  elif name != "plain":
    raise ValueError(f"unknown case {name!r}; known: {CASES}")
  return Case(name, b, n, k, t, s, h, features=frozenset(features), **fields)


def _normal(seed, shape, dtype):
  x = np.random.default_rng(seed).standard_normal(shape, np.float32)
  return jnp.asarray(x, dtype)


def _max_abs(x) -> float:
  x = np.asarray(x, np.float64)
  x = x[np.isfinite(x)]
  return float(np.abs(x).max()) if x.size else 0.0


def _err(got, want, scale=None) -> float:
  """max |got - want| / max(1, scale); inf where finiteness differs.

  ``scale`` defaults to ``max |want|``.
  """
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  finite = np.isfinite(want)
  if (np.isfinite(got) != finite).any() or (got[~finite]
                                            != want[~finite]).any():
    return float("inf")
  if not finite.any():
    return 0.0
  scale = max(1.0, _max_abs(want) if scale is None else scale)
  return float(np.abs(got[finite] - want[finite]).max()) / scale


def _loss(out, lse, cot, cot_lse):
  total = jnp.sum(out.astype(jnp.promote_types(out.dtype, jnp.float32))
                  * cot)
  if lse is not None:  # -inf rows contribute nothing
    total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)
  return total


# The Mask's array fields and how each is split over the ring: lengths are
# global (replicated), segment ids this device's shard of the sequence.
_RING_FIELDS = ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")


def _ring(query, key, value, mask=None, is_causal=False, return_lse=False,
          **extras):
  """ring_attention with T and S split over every device."""
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("seq",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  seq = P(None, None, "seq")
  mask = mask_lib.as_mask(mask)
  static, arrays = {}, {}
  if mask is not None:
    for field in ("dense", "rule"):
      if getattr(mask, field) is not None:
        raise ValueError(f"the ring check passes no {field} mask")
    static = {"causal": mask.causal, "window": mask.window}
    arrays = {f: getattr(mask, f) for f in _RING_FIELDS
              if getattr(mask, f) is not None}
  specs = {f: P() if f.endswith("lengths")
           else P(*[None] * (jnp.ndim(x) - 1), "seq")
           for f, x in arrays.items()}

  def local(q, k, v, arrays):
    m = None if mask is None else aj.Mask(**static, **arrays)
    return aj.ring_attention(q, k, v, m, axis_name="seq",
                             is_causal=is_causal, return_lse=return_lse,
                             **extras)

  return jax.shard_map(
      local, mesh=mesh, in_specs=(seq, seq, seq, specs),
      out_specs=(seq, seq) if return_lse else seq)(query, key, value, arrays)


# Kernels run in Pallas's interpreter with --interpret (names of the
# registry's accelerator kernels; see run_check).
_INTERPRETED: set[str] = set()


def _kernel(impl: str) -> kernel_base.Kernel:
  """The registered kernel ``impl``, interpreted if asked."""
  kernel = aj.kernels.by_name(impl)
  if impl in _INTERPRETED:
    kernel = dataclasses.replace(kernel, interpret=True)
  return kernel


def _sdpa_fn(impl: str):
  if impl == RING:
    return _ring
  if impl == JAX_NN:
    return _jax_nn
  return functools.partial(aj.scaled_dot_product_attention,
                           implementation=None if impl == AUTO
                           else _kernel(impl))


def _jax_nn(query, key, value, mask=None, is_causal=False, **extras):
  """``jax.nn.dot_product_attention`` (its own choice of implementation)
  on our ``[B, N, T, H]`` layout: a timing peer for what it can express."""
  if extras:
    raise ValueError(f"jax.nn takes no {sorted(extras)}")
  mask = mask_lib.as_mask(mask)
  window = None if mask is None else mask.window
  if mask is not None and any(
      getattr(mask, f) is not None for f in
      ("q_lengths", "kv_lengths", "q_segment_ids", "dense", "rule")):
    raise ValueError("jax.nn is timed with causal masks and windows only")
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  return swap(jax.nn.dot_product_attention(
      swap(query), swap(key), swap(value), is_causal=is_causal,
      local_window_size=window))


@functools.cache
def _probe() -> kernel_base.Problem:
  """The plainest problem (bfloat16, no mask): a kernel that refuses it
  cannot run on this backend at all."""
  x = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
  return kernel_base.canonicalize(x, x, x, None)


def _unavailable(impl: str) -> str | None:
  """Why ``impl`` cannot run on this machine at all, or None.

  A registered kernel is asked (``supports``) about the plainest problem;
  on a GPU every kernel must take it (its refusals are then judged case by
  case).
  """
  if impl == RING:
    if len(jax.devices()) < 2:
      return f"needs more than one device; {len(jax.devices())} here"
    return None
  if impl in (AUTO, JAX_NN):
    return None
  needs = BACKENDS.get(impl)
  if needs is not None and impl not in _INTERPRETED:
    if jax.default_backend() != needs:
      return (f"unavailable: it needs a {needs.upper()}, the backend is "
              f"{jax.default_backend()!r}")
    return None  # on its backend, refusals are judged case by case
  if jax.default_backend() != "cpu":
    return None
  reason = _kernel(impl).supports(_probe())
  return None if reason is None else f"unavailable: {reason}"


def _refusal(impl: str, case: Case, dtype: str,
             return_lse: bool) -> str | None:
  """The registered kernel's own reason not to take the case, or None."""
  q = jnp.zeros((case.b, case.n, case.t, case.h), dtype)
  kv = jnp.zeros((case.b, case.k, case.s, case.h), dtype)
  mask = mask_lib.as_mask(_mask(*case.mask_parts()), is_causal=case.causal)
  problem = kernel_base.canonicalize(q, kv, kv, mask, return_lse=return_lse,
                                     **case.extras())
  return _kernel(impl).supports(problem)


def _known_refusal(impl, features) -> str | None:
  known = KNOWN_REFUSALS.get(impl, {})
  reasons = [known[f] for f in sorted(features) if f in known]
  return "; ".join(reasons) or None


def _plan(row, impl: str, case: Case, dtype: str, lse: bool) -> bool | None:
  """Whether to run ``impl`` with the lse (``lse`` says whether it is
  wanted); None when ``row`` is settled without running (SKIP or FAIL).

  "auto" and "ring" run as asked. A registered kernel is asked first
  (``supports``): a kernel unavailable here is a SKIP; one that takes the
  case only without the lse runs without it; a refusal the kernel is known
  for (``KNOWN_REFUSALS``) is a SKIP with its message, any other a FAIL.
  """
  why = _unavailable(impl)
  if why:
    row["status"], row["reason"] = "SKIP", why
    return None
  if impl in (AUTO, RING, JAX_NN):
    return lse
  try:
    reason = _refusal(impl, case, dtype, lse)
    if reason is not None and lse:
      without = _refusal(impl, case, dtype, False)
      if without is None:
        return False  # it returns no lse: its output and gradients are checked
      reason = without
  except Exception as err:  # noqa: BLE001 - reported as a FAIL row
    row["status"], row["reason"] = "FAIL", f"{type(err).__name__}: {err}"
    traceback.print_exc()
    return None
  if reason is None:
    return lse
  known = _known_refusal(impl, case.features | {dtype})
  if known is None:
    row["status"], row["reason"] = "FAIL", f"refused: {reason}"
  else:
    row["status"], row["reason"] = "SKIP", f"refused ({known}): {reason}"
  return None


def _row(level, case, dtype, impl, **extra):
  return {"level": level, "case": case.name, "dtype": dtype, "impl": impl,
          "shape": f"B{case.b} N{case.n} K{case.k} T{case.t} S{case.s} "
                   f"H{case.h}", "status": None, "out_err": None,
          "lse_err": None, "grad_err": None, "grad_worst": None,
          "reason": None, **extra}


def _compare(row, got, want, names, dtype):
  """Fills the errors and the status of ``row`` from ``(out, lse, grads)``."""
  (out, lse, grads), (ref_out, ref_lse, ref_grads) = got, want
  tol = TOLERANCES[dtype]
  row["out_err"] = _err(out, ref_out)
  if lse is not None:
    row["lse_err"] = _err(lse, ref_lse)
  scale = max(_max_abs(r) for r in ref_grads)  # the call's largest gradient
  errs = {name: _err(g, r, scale)
          for name, g, r in zip(names, grads, ref_grads, strict=True)}
  row["grad_worst"] = max(errs, key=errs.get)
  row["grad_err"] = errs[row["grad_worst"]]
  ok = (row["out_err"] <= tol["fwd"] and (row["lse_err"] is None
                                          or row["lse_err"] <= tol["fwd"])
        and row["grad_err"] <= tol["grad"])
  row["status"] = "PASS" if ok else "FAIL"
  row["tolerance"] = tol


def _run_guarded(row, impl, features, run):
  """``run()``; a refusal is a SKIP when known, anything else a FAIL."""
  try:
    return run()
  except (ValueError, TypeError) as err:
    known = _known_refusal(impl, features)
    if known is None:
      row["status"], row["reason"] = "FAIL", f"{type(err).__name__}: {err}"
    else:
      row["status"] = "SKIP"
      row["reason"] = f"refused ({known}): {str(err).splitlines()[0]}"
  except Exception as err:  # noqa: BLE001 - reported as a FAIL row
    row["status"] = "FAIL"
    row["reason"] = f"{type(err).__name__}: {err}"
    traceback.print_exc()
  return None


def check_sdpa(case: Case, dtype: str, impls) -> list[dict]:
  """One case and dtype, every implementation of the attention function."""
  q = _normal(0, (case.b, case.n, case.t, case.h), dtype)
  k = _normal(1, (case.b, case.k, case.s, case.h), dtype)
  v = _normal(2, (case.b, case.k, case.s, case.h), dtype)
  cot = _normal(3, (case.b, case.n, case.t, case.h), jnp.float32)
  cot_lse = _normal(4, (case.b, case.n, case.t), jnp.float32)
  static, arrays = case.mask_parts()

  def value_and_grads(fn, with_lse, q=q, k=k, v=v):
    def loss(q, k, v, arrays, cot, cot_lse):
      kw = {"mask": _mask(static, arrays), "is_causal": case.causal,
            **case.extras()}
      res = fn(q, k, v, return_lse=True, **kw) if with_lse else (
          fn(q, k, v, **kw), None)
      return _loss(*res, cot, cot_lse if with_lse else None), res
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(
        loss, (0, 1, 2), has_aux=True))(q, k, v, arrays, cot, cot_lse)
    return out, lse, grads

  wants = {}

  def want(with_lse):  # the reference, with or without the lse in the loss
    if with_lse not in wants:
      with _reference_mode(), jax.default_matmul_precision("highest"):
        # The same (rounded) inputs, upcast: the reference's gradients are
        # then not rounded back to the inputs' dtype.
        ref_qkv = [jnp.asarray(x, _ref_dtype()) for x in (q, k, v)]
        wants[with_lse] = jax.tree.map(np.asarray, value_and_grads(
            _reference_fn(case), with_lse, *ref_qkv))
    return wants[with_lse]

  rows = []
  for impl in impls:
    row = _row("sdpa", case, dtype, impl)
    rows.append(row)
    # "auto" is asked for no lse: asking for one would steer it off cuDNN.
    with_lse = _plan(row, impl, case, dtype, lse=impl != AUTO)
    if with_lse is None:
      continue
    features = case.features | {dtype}
    got = _run_guarded(row, impl, features, lambda impl=impl, lse=with_lse: (
        _with_precision(value_and_grads, _sdpa_fn(impl), lse)))
    if got is not None:
      _compare(row, got, want(with_lse), ("dq", "dk", "dv"), dtype)
  return rows


def _with_precision(fn, *args):
  with jax.default_matmul_precision("highest"):
    return jax.tree.map(np.asarray, fn(*args))


def check_mha(case: Case, dtype: str, impls) -> list[dict]:
  """One case and dtype through ``aj.multi_head_attention``'s dispatch."""
  d = case.n * case.h
  params = aj.init_multi_head_params(jax.random.key(0), d, case.n,
                                     num_kv_heads=case.k)
  params = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
  x = np.asarray(_normal(5, (case.b, case.t, d), jnp.float32))
  cot = _normal(6, (case.b, case.t, d), jnp.float32)
  static, arrays = case.mask_parts()  # lengths [B], segment ids [B, T]

  def value_and_grads(params, x, attention_fn):
    def loss(params, x, arrays, cot):
      out = aj.multi_head_attention(params, x, x, x, _mask(static, arrays),
                                    is_causal=case.causal,
                                    attention_fn=attention_fn)
      return jnp.sum(out.astype(jnp.float32) * cot), out
    (_, out), grads = jax.jit(jax.value_and_grad(
        loss, (0, 1), has_aux=True))(params, x, arrays, cot)
    return out, None, grads

  cast = lambda tree, dt: jax.tree.map(lambda a: jnp.asarray(a, dt), tree)
  # The reference sees the same (rounded) inputs, upcast.
  rounded = cast((params, x), dtype)
  with _reference_mode(), jax.default_matmul_precision("highest"):
    ref_in = cast(rounded, _ref_dtype())
    want = value_and_grads(*ref_in, attention_fn=_reference_fn(case))
    want = jax.tree.map(np.asarray, want)
  ref_out, _, (ref_gp, ref_gx) = want
  names = ["dx"] + [jax.tree_util.keystr(p) for p, _ in
                    jax.tree_util.tree_leaves_with_path(ref_gp)]
  flat_want = (ref_out, None, [ref_gx, *jax.tree.leaves(ref_gp)])
  rows = []
  for impl in impls:
    row = _row("mha", case, dtype, impl)
    rows.append(row)
    if _plan(row, impl, case, dtype, lse=False) is None:
      continue
    # attention_fn takes an implementation: None (automatic) or a name.
    attention_fn = None if impl == AUTO else impl
    got = _run_guarded(row, impl, case.features | {dtype},
                       lambda fn=attention_fn: _with_precision(
                           value_and_grads, *rounded, fn))
    if got is not None:
      out, _, (gp, gx) = got
      _compare(row, (out, None, [gx, *jax.tree.leaves(gp)]), flat_want,
               names, dtype)
  return rows


# --------------------------------------------------------------------------
# Timing.


# --------------------------------------------------------------------------
# The paged level: a decoding step through aj.paged_attention (forward).


def paged_sizes(quick: bool) -> tuple[int, int, int, int, int, int]:
  """``(B, N, K, H, Z, L)``: sequences, heads, page size, longest length.
  H and Z are powers of two >= 16 (the Triton kernel's dots need them)."""
  if quick:
    return 2, 4, 2, 16, 16, 80
  if jax.default_backend() in ("gpu", "tpu"):
    return 8, 8, 2, 128, 64, 4096
  return 8, 8, 2, 64, 64, 1024


def _paged_cache(dtype: str, quick: bool, lengths=None):
  """A paged cache of B sequences (ragged unless ``lengths``), their pages
  scattered over the pool (written round-robin a page at a time); and
  the keys and values ``[B, K, L, H]`` it holds (float32)."""
  b, _, k, h, z, length = paged_sizes(quick)
  if lengths is None:  # ragged: the longest, and shorter ones down to 1/3
    lengths = np.linspace(length, max(1, length // 3), b).astype(np.int32)
  lengths = np.asarray(lengths, np.int32)
  m = -(-int(lengths.max()) // z)
  keys = np.asarray(_normal(1, (b, k, m * z, h), dtype), np.float32)
  values = np.asarray(_normal(2, (b, k, m * z, h), dtype), np.float32)
  cache = aj.init_paged_cache(b * m, z, k, h, batch_size=b, max_pages=m,
                              dtype=dtype)
  for start in range(0, m * z, z):
    n = np.clip(lengths - start, 0, z).astype(np.int32)
    cache = aj.paged_cache.append(
        cache, jnp.asarray(keys[:, :, start:start + z], dtype),
        jnp.asarray(values[:, :, start:start + z], dtype),
        new_lengths=jnp.asarray(n))
  return cache, keys, values, lengths


def _paged_case(name: str):
  """``(mask, sinks?, window)`` of a paged case: the newest token of each
  sequence attends causally (to a window of 64 tokens with sinks)."""
  if name == "decode_causal":
    return aj.Mask(causal=True), False, None
  return aj.Mask(causal=True, window=(63, 0)), True, 63


def _paged_reference(q, keys, values, lengths, window, sinks, scale):
  """float64 ``[B, N, Hv]`` and lse ``[B, N]``: query ``q [B, N, H]`` of
  each sequence's last token over its keys ``[B, K, L, H]``."""
  b, n, _ = q.shape
  k = keys.shape[1]
  out = np.zeros((b, n, values.shape[-1]))
  lse = np.zeros((b, n))
  for i in range(b):
    j = np.arange(lengths[i])
    ok = j <= lengths[i] - 1
    if window is not None:
      ok &= j >= lengths[i] - 1 - window
    for h in range(n):
      kv = h // (n // k)
      s = scale * keys[i, kv, :lengths[i]] @ q[i, h]
      s = np.where(ok, s, -np.inf)
      top = s.max()
      if sinks is not None:
        top = max(top, sinks[h])
      w = np.exp(s - top)
      total = w.sum() + (np.exp(sinks[h] - top) if sinks is not None else 0)
      out[i, h] = (w / total) @ values[i, kv, :lengths[i]]
      lse[i, h] = top + np.log(total)
  return out, lse


def _paged_kernel(impl: str, *, interpreted: bool):
  """``(kernel or None for "auto", why it cannot run here or None)``; with
  ``interpreted``, a kernel asked for with ``--interpret`` runs anywhere."""
  needs = BACKENDS.get(impl)
  if (needs is not None and jax.default_backend() != needs
      and not (interpreted and impl in _INTERPRETED)):
    return None, (f"it needs a {needs.upper()}, the backend is "
                  f"{jax.default_backend()!r}")
  if impl == AUTO:
    return None, None
  return (aj.kernels.Flash() if impl == "flash" else _kernel(impl)), None


def check_paged(dtype: str, impls, quick: bool) -> list[dict]:
  """Both paged cases in ``dtype``: each implementation's output and lse
  against the float64 reference (forward only: a decoding step)."""
  b, n, k, h, z, _ = paged_sizes(quick)
  cache, keys, values, lengths = _paged_cache(dtype, quick)
  q = _normal(0, (b, n, 1, h), dtype)
  rows = []
  for name in PAGED_CASES:
    mask, with_sinks, window = _paged_case(name)
    sinks = (jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
             if with_sinks else None)
    ref_out, ref_lse = _paged_reference(
        np.asarray(q, np.float64)[:, :, 0], keys, values, lengths, window,
        None if sinks is None else np.asarray(sinks), h ** -0.5)
    features = {dtype, "window", "sinks"} if with_sinks else {dtype}
    for impl in impls:
      row = {"level": "paged", "case": name, "dtype": dtype, "impl": impl,
             "shape": f"B{b} N{n} K{k} T1 L{int(lengths.max())} H{h} Z{z}",
             "status": None, "out_err": None, "lse_err": None,
             "grad_err": None, "grad_worst": None, "reason": None}
      rows.append(row)
      kernel, why = _paged_kernel(impl, interpreted=True)
      if why:
        row["status"], row["reason"] = "SKIP", f"unavailable: {why}"
        continue
      # A kernel that returns no lse (PagedTpu) has its output checked.
      with_lse = kernel is None or "return_lse" in kernel.implements
      call = jax.jit(lambda q, c, s, kernel=kernel, mask=mask, lse=with_lse:
                     aj.paged_attention(q, c, mask, sinks=s,
                                        implementation=kernel,
                                        return_lse=lse))
      try:
        with jax.default_matmul_precision("highest"):
          got = jax.tree.map(np.asarray, call(q, cache, sinks))
          out, lse = got if with_lse else (got, None)
      except (ValueError, TypeError) as err:
        known = KNOWN_PAGED_REFUSALS.get(impl, {})
        reasons = [known[f] for f in sorted(features) if f in known]
        row["status"] = "SKIP" if reasons else "FAIL"
        row["reason"] = (f"refused ({'; '.join(reasons)}): " if reasons
                         else f"{type(err).__name__}: ") + str(
                             err).splitlines()[0]
        continue
      except Exception as err:  # noqa: BLE001 - reported as a FAIL row
        row["status"], row["reason"] = "FAIL", f"{type(err).__name__}: {err}"
        traceback.print_exc()
        continue
      row["out_err"] = _err(out[:, :, 0], ref_out)
      if lse is not None:
        row["lse_err"] = _err(lse[:, :, 0], ref_lse)
      tol = TOLERANCES[dtype]
      row["status"] = ("PASS" if max(row["out_err"], row["lse_err"] or 0.0)
                       <= tol["fwd"] else "FAIL")
      row["tolerance"] = tol
  return rows


def time_paged(quick: bool, repeats: int, impls,
               dtype: str = "bfloat16") -> list[dict]:
  """A decode step of B sequences all at the longest length, each
  implementation that takes it, in ``dtype``; median ms."""
  b, n, _, h, z, length = paged_sizes(quick)
  cache, *_ = _paged_cache(dtype, quick, lengths=[length] * b)
  q = _normal(0, (b, n, 1, h), dtype)
  rows = []
  for impl in impls:
    row = {"shape": f"B{b} N{n} T1 L{length} H{h} Z{z} (paged)",
           "dtype": dtype, "impl": impl, "mode": "fwd", "ms": None,
           "compile_s": None, "reason": None}
    rows.append(row)
    kernel, why = _paged_kernel(impl, interpreted=False)  # not timed so
    if why:
      row["reason"] = why
      continue
    call = jax.jit(lambda q, c, kernel=kernel: aj.paged_attention(
        q, c, aj.Mask(causal=True), implementation=kernel))
    _time_row(row, call, (q, cache), repeats)
  return rows


def _time_row(row: dict, call, args, repeats: int) -> None:
  """Fills ``row``'s ``ms`` (median of ``repeats`` calls after a compiling
  one) and ``compile_s``, or its ``reason`` when the call is refused."""
  try:
    start = time.perf_counter()
    jax.block_until_ready(call(*args))
    first = time.perf_counter() - start
  except ValueError as err:
    row["reason"] = f"refused: {str(err).splitlines()[0]}"
    return
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(call(*args))
    times.append(time.perf_counter() - start)
  row["ms"] = 1e3 * statistics.median(times)
  row["compile_s"] = max(first - row["ms"] / 1e3, 0.0)


def time_impls(z: Sizes, repeats: int, impls=None,
               dtypes=DTYPES) -> list[dict]:
  """fwd and fwd+bwd of each implementation, causal, in each dtype."""
  impls = implementations() if impls is None else impls
  b, n, t, h = z.time
  case = Case("timing", b, n, n, t, t, h, causal=True)
  rows = []
  for dtype in dtypes:
    q, k, v = (_normal(i, (b, n, t, h), dtype) for i in range(3))
    for impl in impls:
      for mode in ("fwd", "fwd+bwd"):
        row = {"shape": f"B{b} N{n} T{t} H{h}", "dtype": dtype, "impl": impl,
               "mode": mode, "ms": None, "compile_s": None, "reason": None}
        rows.append(row)
        check = {}
        if _plan(check, impl, case, dtype, lse=False) is None:
          row["reason"] = check["reason"]
          continue
        fn = functools.partial(_sdpa_fn(impl), is_causal=True)
        if mode == "fwd":
          call = jax.jit(fn)
        else:
          call = jax.jit(jax.grad(
              lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
              (0, 1, 2)))
        _time_row(row, call, (q, k, v), repeats)
  return rows


# --------------------------------------------------------------------------
# Timing by pattern: the structured cases at long sequences, bfloat16.

PATTERNS = ("plain", "causal", "window", "segments", "sinks", "softcap",
            "alibi", "t5")
# The timed peers: the default choice, each accelerator kernel, the flash
# core (pure JAX, the ratios' denominator) and jax.nn.
PATTERN_IMPLS = (AUTO, "cudnn", "splash", "pallas_gpu", "flash", JAX_NN)


def pattern_sizes(quick: bool) -> tuple[tuple[int, ...], int, int, int]:
  """``(lengths T = S, tokens B * T, N, H)`` of the pattern timings."""
  if quick:
    return (128,), 128, 2, 16
  if jax.default_backend() == "cpu":
    return (1024, 2048), 2048, 4, 64
  return (2048, 8192, 32768), 32768, 8, 64


def _pattern_case(pattern: str, b: int, n: int, t: int, h: int) -> Case:
  z = Sizes((b, n, t, h), window=min(t, 1024), docs=max(2, t // 1024),
            time=(b, n, t, h))
  return build_case("plain" if pattern == "plain" else pattern, z)


def time_patterns(quick: bool, repeats: int, impls=PATTERN_IMPLS,
                  budget_s: float = 420.0, patterns=PATTERNS) -> list[dict]:
  """fwd and fwd+bwd per pattern, length and implementation (bfloat16).

  Each point is asked of the kernel first (``supports``); a refusal is
  reported with its reason. Points past ``budget_s`` seconds of this
  function are skipped and say so, so that one run fits its slot.
  """
  lengths, tokens, n, h = pattern_sizes(quick)
  known = set(implementations()) | {JAX_NN}
  impls = [i for i in impls if i in known]
  start_all = time.perf_counter()
  rows = []
  for pattern in patterns:
    for t in lengths:
      b = max(1, tokens // t)
      case = _pattern_case(pattern, b, n, t, h)
      q, k, v = (_normal(i, (b, n, t, h), jnp.bfloat16) for i in range(3))
      static, arrays = case.mask_parts()
      for impl in impls:
        for mode in ("fwd", "fwd+bwd"):
          row = {"pattern": pattern, "shape": f"B{b} N{n} T{t} H{h}",
                 "impl": impl, "mode": mode, "ms": None, "reason": None}
          rows.append(row)
          if time.perf_counter() - start_all > budget_s:
            row["reason"] = f"past the {budget_s:.0f} s budget"
            continue
          if impl not in (AUTO, JAX_NN):
            why = _unavailable(impl) or _refusal(impl, case, "bfloat16",
                                                 False)
            if why:
              row["reason"] = why
              continue
          fn = functools.partial(_sdpa_fn(impl), is_causal=case.causal,
                                 **case.extras())

          def run(q, k, v, arrays, fn=fn, static=static):
            return fn(q, k, v, mask=_mask(static, arrays))

          call = jax.jit(run) if mode == "fwd" else jax.jit(jax.grad(
              lambda q, k, v, a, run=run: jnp.sum(
                  run(q, k, v, a).astype(jnp.float32)), (0, 1, 2)))
          try:
            jax.block_until_ready(call(q, k, v, arrays))
            times = []
            for _ in range(repeats):
              t0 = time.perf_counter()
              jax.block_until_ready(call(q, k, v, arrays))
              times.append(time.perf_counter() - t0)
            row["ms"] = 1e3 * statistics.median(times)
          except Exception as err:  # noqa: BLE001 - a row, not a crash
            row["reason"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
  return rows


def patterns_table(rows: list[dict]) -> str:
  """ms per implementation; in brackets the ratio to the flash core."""
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  lines = ["| pattern | shape | mode | " + " | ".join(impls) + " |",
           "|---|---|---|" + "---|" * len(impls)]
  groups = {}
  for r in rows:
    groups.setdefault((r["pattern"], r["shape"], r["mode"]), {})[
        r["impl"]] = r
  notes = {}
  for (pattern, shape, mode), by_impl in groups.items():
    base = (by_impl.get("flash") or {}).get("ms")
    cells = []
    for impl in impls:
      r = by_impl.get(impl)
      if r is None or r["ms"] is None:
        reason = "" if r is None else (r["reason"] or "")
        mark = notes.setdefault(reason, len(notes) + 1) if reason else None
        cells.append("-" if mark is None else f"- [{mark}]")
      elif base:
        cells.append(f"{r['ms']:.3g} ({base / r['ms']:.2f}x)")
      else:
        cells.append(f"{r['ms']:.3g}")
    lines.append(f"| {pattern} | {shape} | {mode} | " + " | ".join(cells)
                 + " |")
  lines.append("")
  lines += [f"[{i}] {reason}" for reason, i in notes.items()]
  return "\n".join(lines)


# --------------------------------------------------------------------------
# Tables and the run.


def _fmt(x):
  return "-" if x is None else f"{x:.2e}"


def checks_table(rows: list[dict]) -> str:
  lines = ["| level | case | dtype | impl | status | out err | lse err | "
           "grad err (worst) | note |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    grad = _fmt(r["grad_err"]) + (f" ({r['grad_worst']})"
                                  if r["grad_worst"] else "")
    lines.append(f"| {r['level']} | {r['case']} | {r['dtype']} | "
                 f"{r['impl']} | {r['status']} | {_fmt(r['out_err'])} | "
                 f"{_fmt(r['lse_err'])} | {grad} | {r['reason'] or ''} |")
  return "\n".join(lines)


def timing_table(rows: list[dict]) -> str:
  lines = ["| shape | dtype | impl | mode | ms | compile (s) |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    if r["ms"] is None:
      lines.append(f"| {r['shape']} | {r['dtype']} | {r['impl']} | "
                   f"{r['mode']} | skipped: {r['reason']} | |")
    else:
      lines.append(f"| {r['shape']} | {r['dtype']} | {r['impl']} | "
                   f"{r['mode']} | {r['ms']:.4g} | {r['compile_s']:.2f} |")
  return "\n".join(lines)


def machine() -> str:
  devices = jax.devices()
  return (f"{platform.node() or 'host'}: {os.cpu_count()} CPUs, jax "
          f"{jax.__version__}, backend {jax.default_backend()}, "
          f"{len(devices)} x {devices[0].device_kind}")


def run_check(quick: bool = False, cases=(), repeats: int = 5,
              timing: bool = True, out: str | None = None,
              dtypes=DTYPES, impls=(), patterns: bool = False,
              budget_s: float = 420.0, interpret=(),
              paged: bool = True) -> dict:
  """Runs the checks (and timings), prints both tables; returns the results.

  ``results["failed"]`` counts FAIL rows; ``main`` exits non-zero on any.
  """
  started = time.perf_counter()
  z = sizes(quick)
  _INTERPRETED.clear()
  _INTERPRETED.update(interpret)
  names = [c for c in CASES if not cases or c in cases]
  unknown = set(cases) - set(CASES)
  if unknown:
    raise ValueError(f"unknown cases {sorted(unknown)}; known: {CASES}")
  known = implementations("sdpa")  # "auto", the registry's names, "ring"
  known += tuple(i for i in implementations("paged") if i not in known)
  unknown = set(impls) - set(known)
  if unknown:
    raise ValueError(f"unknown implementations {sorted(unknown)}; known: "
                     f"{known}")
  sdpa_impls = [i for i in implementations("sdpa") if not impls or i in impls]
  mha_impls = [i for i in implementations("mha") if not impls or i in impls]
  paged_impls = [i for i in implementations("paged")
                 if not impls or i in impls]
  print(f"{machine()}; checks at B,N,T,H = {z.check}", flush=True)
  checks = []
  for name in names:
    case = build_case(name, z)
    for dtype in dtypes:
      checks += check_sdpa(case, dtype, sdpa_impls)
      if name in MHA_CASES:
        checks += check_mha(case, dtype, mha_impls)
  if paged and paged_impls:
    for dtype in dtypes:
      checks += check_paged(dtype, paged_impls, quick)
  print(f"\n{checks_table(checks)}\n", flush=True)
  timings = time_impls(z, repeats, sdpa_impls, dtypes) if timing else []
  if timing and paged and paged_impls:
    timings += time_paged(quick, repeats, paged_impls)
  if timings:
    print(f"{timing_table(timings)}\n", flush=True)
  by_pattern = []
  if patterns:
    left = budget_s - (time.perf_counter() - started)
    by_pattern = time_patterns(quick, repeats, budget_s=left,
                               impls=[i for i in PATTERN_IMPLS
                                      if not impls or i in impls])
    print(f"{patterns_table(by_pattern)}\n", flush=True)
  failed = sum(r["status"] == "FAIL" for r in checks)
  counts = {s: sum(r["status"] == s for r in checks)
            for s in ("PASS", "FAIL", "SKIP")}
  print(f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} "
        "SKIP", flush=True)
  results = {"machine": machine(), "backend": jax.default_backend(),
             "devices": len(jax.devices()), "quick": quick,
             "sizes": dataclasses.asdict(z), "checks": checks,
             "timings": timings, "patterns": by_pattern, "failed": failed}
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(results, f, indent=1, default=str)
  return results


def main(argv):
  del argv
  results = run_check(_QUICK.value, _CASES.value, _REPEATS.value,
                      _TIMING.value, _OUT.value, impls=_IMPLS.value,
                      patterns=_PATTERNS.value, budget_s=_BUDGET.value,
                      interpret=_INTERPRET.value, paged=_PAGED.value)
  if results["failed"]:
    sys.exit(1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
