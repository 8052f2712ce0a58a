"""What the library does with its inputs: checked once while tracing, and
the numerics policies every kernel shares while running.

Shape glossary: T query length, S key/value length, N query heads, K
key/value heads, H head dim, Hv value head dim, F features; ``...``
leading batch dims.

Checks: every check raises ``ValueError`` (shapes, values) or ``TypeError``
(dtypes) with a message that names the argument and the shapes it got.
Nothing here uses ``assert``: validation must survive ``python -O``. All
checks look only at static information (shapes, dtypes, Python numbers),
so they run once at trace time and cost nothing inside ``jax.jit``.

Numerics (what no check can see: values are traced). Policies written
once here: 16-bit and float32 inputs compute in float32,
float64 inputs in float64; masks are bool with True = may attend (integer
masks: non-zero).

Garbage (NaN or inf in a padded or masked slot: an uninitialised cache page,
a stale ring-buffer slot, another document's NaN) reaches only the rows that
may see it. Masking the logits is not enough, since a blocked entry still
meets its key and value in ``q @ k^T``, ``p @ v`` and every gradient, and
``0 * NaN`` is NaN. So every kernel computes on ``sanitize``'d operands
(non-finite entries replaced by 0: all products are finite) and records per
query row and per key column a *code* (``CLEAN``, ``BAD_VALUE``,
``BAD_KEY``); a row's code is the largest code of its own query (if it sees
any key) and of the keys it may see (``seen_codes``, or a kernel's block
walk), and ``poison`` then writes NaN into that row's output (and, for a
bad key or query, its lse, row maximum and weights). A poisoned row is a
constant: it passes no gradient back, so every other row's outputs and
gradients are those of the clean inputs, and a non-finite entry's own
gradient is 0. (The dense kernel's one-row case, a decoding step, keeps
its keys and values as given, zeroed where the row does not look, and
reads the row's code off its logits and output: the same answers, but
the gradients of entries only a poisoned row sees are NaN, not 0.)
A row that sees a bad key or value is never made finite:
that would be a silent wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.core import elementwise
from attention_jax.core import traced_checks


def shape_of(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def check_float_array(name: str, x) -> None:
  """Requires a real floating-point array (float16/bfloat16/float32/float64)."""
  if isinstance(x, (str, bytes)) or x is None:  # result_type reads 'q' as int
    raise TypeError(f"{name} must be a real floating-point array, got "
                    f"{x!r} ({type(x).__name__}).")
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"{name} must be a real floating-point array, got dtype {dtype} "
        f"with shape {shape_of(x)}.")


def check_min_rank(name: str, x, min_rank: int, layout: str) -> None:
  if np.ndim(x) < min_rank:
    raise ValueError(
        f"{name} must have rank >= {min_rank} ({layout}), got shape "
        f"{shape_of(x)}.")


def check_rank(name: str, x, ranks: Sequence[int], layout: str) -> None:
  if np.ndim(x) not in ranks:
    allowed = " or ".join(str(r) for r in ranks)
    raise ValueError(
        f"{name} must have rank {allowed} ({layout}), got shape "
        f"{shape_of(x)}.")


def check_module_input(name: str, x, width: int, option: str,
                       layout: str = "[B, T, features]") -> None:
  """A module call's input: rank 3 with the ``width`` features the module
  was built with (``option`` names the constructor argument)."""
  check_rank(name, x, (3,), layout)
  if shape_of(x)[-1] != width:
    raise ValueError(
        f"{name} has {shape_of(x)[-1]} features (shape {shape_of(x)}), but "
        f"the module was built with {option}={width}.")


def layer_input(name: str, x, width: int, source: str) -> jax.Array:
  """A layer function's float input ``[B, T, D]`` whose ``D`` its params
  fix (``source`` says which: "MLA params have d_model D = 64 (W_dkv
  kernel [D, R + Hr])"), as an array."""
  x = as_array_operand(name, x, "[B, T, D]")
  check_float_array(name, x)
  check_rank(name, x, (3,), "[B, T, D]")
  if shape_of(x)[-1] != width:
    raise ValueError(f"{name} has {shape_of(x)[-1]} features (shape "
                     f"{shape_of(x)}), but the {source}.")
  return jnp.asarray(x)


def check_mask_dtype(name: str, mask) -> None:
  """Masks are bool (True = may attend) or integer (0 = blocked)."""
  dtype = jnp.result_type(mask)
  if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(
        f"{name} must be a bool or integer array (True/non-zero = may "
        f"attend), got dtype {dtype} with shape {shape_of(mask)}. A float "
        "mask is ambiguous: pass additive values through `bias` instead.")


def broadcast_shapes(what: str, **shapes: tuple[int, ...]) -> tuple[int, ...]:
  """``jnp.broadcast_shapes`` with an error that names every operand."""
  try:
    return tuple(jnp.broadcast_shapes(*shapes.values()))
  except ValueError:
    listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
    raise ValueError(f"{what} do not broadcast: {listed}.") from None


def check_broadcastable_to(name: str, shape: tuple[int, ...],
                           target: tuple[int, ...], layout: str,
                           full_shape: tuple[int, ...] | None = None) -> None:
  """Requires ``shape`` to broadcast to ``target`` without growing it.

  ``full_shape`` is the operand's whole shape when ``shape`` is a part of
  it (the message shows what the caller passed).
  """
  shape = tuple(shape)
  ok = len(shape) <= len(target) and all(
      s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
  if not ok:
    whole = shape if full_shape is None else tuple(full_shape)
    part = "" if whole == shape else f" (its last axes {shape})"
    raise ValueError(
        f"{name} with shape {whole}{part} is not broadcastable to {layout} = "
        f"{target}.")


def check_static_bool(name: str, value) -> None:
  """A flag that changes the program must be a Python bool, not traced."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} must be a Python bool, got a traced value: pass it as a "
        f"static argument (jax.jit(..., static_argnames=['{name}'])) or "
        "close over it.")
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {value!r} "
                    f"({type(value).__name__}).")


def as_array_operand(name: str, x, layout: str):
  """``x`` as an array: None is refused by name, lists become arrays."""
  if x is None:
    raise TypeError(f"{name} is None: pass a float array {layout}.")
  if isinstance(x, (list, tuple)):
    return np.asarray(x)
  return x


def check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {value!r} "
                    f"({type(value).__name__}).")
  if value <= 0:
    raise ValueError(f"{name} must be positive, got {value}.")


def check_dropout_rate(dropout_rate) -> None:
  """A rate lies in [0, 1): a number or a concrete array now, a traced
  array under ``aj.checked`` (off, a traced rate >= 1 drops everything).
  """
  if not isinstance(dropout_rate, (int, float, np.number)):
    if not hasattr(dropout_rate, "dtype") or np.shape(dropout_rate) or not (
        jnp.issubdtype(dropout_rate.dtype, jnp.floating)):
      raise TypeError(
          f"dropout_rate must be a Python float or a float scalar array, got "
          f"{_described(dropout_rate)}.")
    try:
      dropout_rate = float(np.asarray(dropout_rate))
    except jax.errors.TracerArrayConversionError:
      traced_checks.traced_check(
          (dropout_rate >= 0) & (dropout_rate < 1),
          "dropout_rate must be in [0, 1), got {rate}.", rate=dropout_rate)
      return
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}.")


def _described(x) -> str:
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"an array of dtype {x.dtype} with shape {tuple(x.shape)}"
  return f"{x!r} ({type(x).__name__})"


def check_dropout_rng(dropout_rng) -> None:
  """One PRNG key: ``jax.random.key(seed)`` (or a legacy uint32
  ``jax.random.PRNGKey``); every head and entry draws from it."""
  dtype = getattr(dropout_rng, "dtype", None)
  shape = tuple(np.shape(dropout_rng)) if dtype is not None else None
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    legacy = False
  elif dtype == np.uint32 and shape and shape[-1] == 2:
    legacy, shape = True, shape[:-1]
  else:
    raise TypeError(
        f"dropout_rng must be one PRNG key, jax.random.key(seed), got "
        f"{_described(dropout_rng)}; write dropout_rng=jax.random.key(0) "
        "(an int seed is not a key).")
  if shape:
    raise ValueError(
        f"dropout_rng must be one PRNG key, got a batch of keys with shape "
        f"{shape}{' (+ 2 words)' if legacy else ''}: every example and head "
        "already draws its own mask from one key; pass one (keys[0], or "
        "jax.random.split's parent).")


def check_dropout(dropout_rate, dropout_rng) -> None:
  """Rate in [0, 1); a positive rate needs a key and a key needs a rate
  that may be positive (no silent no-op either way); the key is one key.

  A rate given as an array (traced, so it may be positive) needs a key too:
  without one it would be ignored.
  """
  check_dropout_rate(dropout_rate)
  python_number = isinstance(dropout_rate, (int, float, np.number))
  if dropout_rng is None and (not python_number or dropout_rate > 0.0):
    what = (f"dropout_rate={dropout_rate}" if python_number else
            f"a dropout_rate given as an array (shape "
            f"{shape_of(dropout_rate)})")
    raise ValueError(
        f"{what} needs a dropout_rng (a jax.random.key); pass the Python "
        "float dropout_rate=0.0 for deterministic use.")
  if dropout_rng is None:
    return
  check_dropout_rng(dropout_rng)
  if python_number and dropout_rate == 0.0:
    raise ValueError(
        "dropout_rng is given but dropout_rate is 0, so nothing would drop: "
        "pass dropout_rate > 0 for attention dropout, or dropout_rng=None "
        "(e.g. dropout_rng=key if training else None).")


def check_lengths(name: str, lengths) -> jax.Array | None:
  """Integer per-example lengths as int32 (``None`` stays None)."""
  if lengths is None:
    return None
  return jnp.asarray(integer_array(name, lengths), jnp.int32)


def _logits_layout(rank: int) -> str:
  return {2: "[T, S]", 3: "[B, T, S]", 4: "[B, N, T, S]"}.get(
      rank, "[" + ", ".join(["..."] * (rank - 2)) + ", T, S]")


def _rank_fix(name: str, shape: tuple[int, ...],
              logits: tuple[int, ...]) -> str:
  """How to give ``shape`` the rank of ``logits``, said for the likely intent."""
  rank, gap = len(logits), len(logits) - len(shape)
  lead = ", ".join(["None"] * gap)
  hints = []
  if len(shape) == 2 and rank >= 3 and shape[-1] in (1, logits[-1]):
    if shape[0] in (1, logits[0]):  # a [B, S] key-padding mask
      middle = ", ".join(["None"] * (rank - 2))
      hints.append(f"a [B, S] padding {name} becomes {name}[:, {middle}, :]")
    if shape[0] in (1, logits[-2]):  # a [T, S] mask shared by the batch
      hints.append(f"a [T, S] {name} becomes {name}[{lead}]")
  elif gap > 0:
    hints.append(f"leading size-1 axes: {name}[{lead}]")
  return "; ".join(hints)


def check_logits_rank(name: str, shape: tuple[int, ...],
                      logits: tuple[int, ...],
                      layout: str | None = None) -> None:
  """Masks and biases carry the logits' full rank (size-1 axes broadcast).

  NumPy would align a lower-rank operand to the right, so a ``[B, S]``
  padding mask against ``[B, N, T, S]`` logits would be read as ``[T, S]``
  whenever ``T == B``: a silent wrong answer. jax.nn requires 4-D masks for
  the same reason; here the rank must be at least the logits' (more
  leading axes broadcast the batch, as they do for the operands).
  """
  shape = tuple(shape)
  if len(shape) >= len(logits):  # more leading axes extend the batch
    return
  layout = layout or _logits_layout(len(logits))
  fix = _rank_fix(name, shape, logits)
  fix = f" ({fix})" if fix else ""
  other = (", or build it with aj.make_attention_mask(query_valid, "
           "key_valid); for key padding alone pass aj.Mask(kv_lengths=...) "
           "instead of a dense mask") if name == "mask" else ""
  raise ValueError(
      f"{name} with shape {shape} has rank {len(shape)}, but the logits are "
      f"{layout} = {logits} (rank {len(logits)}): a {name} must have the "
      f"logits' full rank, with size-1 axes where it is shared, so its axes "
      f"cannot be read two ways. Add the missing axes{fix}{other}.")


def check_range(name, lengths, upper: int, fix: str = "") -> None:
  """Lengths must lie in ``[0, upper]``: checked now when concrete (a
  concrete array under ``jax.jit`` included), under ``aj.checked`` when
  traced (off, a traced length clips)."""
  try:
    values = np.asarray(lengths)
  except jax.errors.TracerArrayConversionError:
    x = jnp.asarray(lengths)
    if not x.size:
      return
    traced_checks.traced_check(
        jnp.all((x >= 0) & (x <= upper)),
        f"{name} must lie in [0, {upper}], got values from {{lo}} to {{hi}} "
        f"(shape {x.shape}){fix}.", lo=jnp.min(x), hi=jnp.max(x))
    return
  if values.size and (values.min() < 0 or values.max() > upper):
    raise ValueError(
        f"{name} must lie in [0, {upper}], got values from {values.min()} "
        f"to {values.max()} (shape {values.shape}){fix}.")



_ELEMENTWISE_MEANS = (
    "a score modifier must be elementwise: its output at (i, j) may read "
    "score[i, j], b, h, q_idx[i], kv_idx[j] and arrays indexed by them, "
    "never other scores (each kernel calls it on the scores it holds: the "
    "dense kernel on a head's whole [T, S], the blockwise ones on each "
    "block, so anything else would change with the kernel)")


def check_arity(name: str, fn, arguments: str) -> None:
  """``fn`` can be called with the positional ``arguments`` (names, comma
  separated), read off its signature where Python has one, so a wrong
  count is named here rather than as a bare TypeError from deep inside a
  kernel."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin or C callable: no signature
    return
  names = [a.strip() for a in arguments.split(",")]
  try:
    signature.bind(*names)
  except TypeError as e:
    raise TypeError(
        f"{name} is called with {len(names)} positional arguments "
        f"({arguments}), but {getattr(fn, '__name__', type(fn).__name__)}"
        f"{signature} cannot take them ({e}): give it exactly these "
        "parameters (others need defaults).") from None


def check_score_mod(score_mod, t: int | None = None, s: int | None = None,
                    dtype: Any = jnp.float32) -> None:
  """A score modifier is callable as ``(score, b, h, q_idx, kv_idx)`` and,
  given the lengths, elementwise: float scores of the score's shape for a
  head's ``[T, S]`` and for a ``[1, 1]`` block, computed from each entry
  alone (``elementwise``). Abstract: nothing is computed."""
  if score_mod is None:
    return
  if not callable(score_mod):
    raise TypeError(
        f"score_mod must be callable as score_mod(score, b, h, q_idx, "
        f"kv_idx) (e.g. aj.alibi(slopes), or aj.ScoreMod(fn, params)), got "
        f"{type(score_mod).__name__}.")
  check_arity("score_mod", score_mod, "score, b, h, q_idx, kv_idx")
  if t is None:
    return
  i32 = jnp.int32
  for rows, cols in dict.fromkeys(((t, s), (1, 1))):
    shapes = f"score [{rows}, {cols}], q_idx [{rows}, 1], kv_idx [1, {cols}]"
    args = (jax.ShapeDtypeStruct((rows, cols), dtype),
            jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((rows, 1), i32),
            jax.ShapeDtypeStruct((1, cols), i32))
    try:
      closed = jax.make_jaxpr(score_mod)(*args)
    except Exception as e:  # noqa: BLE001 - only the block probe is ours
      if (rows, cols) == (t, s):
        raise
      raise TypeError(
          f"score_mod failed on one block of scores ({shapes}; b, h int32 "
          f"scalars) with {type(e).__name__}: {e}. The blockwise kernels "
          f"call it on blocks: {_ELEMENTWISE_MEANS}.") from e
    outs = closed.out_avals
    if len(outs) != 1:
      raise TypeError(
          f"score_mod must return one array of modified scores, got "
          f"{len(outs)} outputs for {shapes}.")
    out = outs[0]
    if not jnp.issubdtype(out.dtype, jnp.floating):
      raise TypeError(
          f"score_mod must return float scores, got dtype {out.dtype} (shape "
          f"{tuple(out.shape)}) for {shapes}: return a float array (-inf "
          "blocks an entry).")
    if tuple(out.shape) != (rows, cols):
      raise ValueError(
          f"score_mod returned shape {tuple(out.shape)} for {shapes}; it "
          f"must return the score's shape [{rows}, {cols}]: "
          f"{_ELEMENTWISE_MEANS}.")
    culprit = elementwise.mixing_primitive(closed)
    if culprit is not None:
      raise ValueError(
          f"score_mod is not elementwise: it applies {culprit!r} to the "
          f"scores ({shapes}); {_ELEMENTWISE_MEANS}. Row-wise statistics "
          "(a sum or standard deviation over keys) cannot be a score "
          "modifier.")


def check_soft_cap(value, name: str = "logits_soft_cap",
                   optional: bool = True) -> None:
  """A soft cap is a positive Python number (static), or None if optional."""
  if value is None and optional:
    return
  if isinstance(value, bool) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a positive Python number, got "
                    f"{value!r} ({type(value).__name__}).")
  if not value > 0 or not np.isfinite(value):
    raise ValueError(f"{name} must be positive and finite, got {value}.")


def check_scale(scale) -> None:
  """A layer's ``scale`` is a positive, finite Python number or None."""
  if scale is None:
    return
  if isinstance(scale, bool) or not isinstance(
      scale, (int, float, np.integer, np.floating)):
    raise TypeError(f"scale must be a positive Python number (the multiplier "
                    f"of q . k) or None, got {scale!r} "
                    f"({type(scale).__name__}).")
  if not scale > 0 or not np.isfinite(scale):
    raise ValueError(f"scale must be positive and finite, got {scale}; None "
                     "means 1 / sqrt(head_dim).")


def check_call_scale(scale) -> None:
  """An attention call's ``scale``: None, a positive finite number, or a
  float scalar array (positive and finite: now when concrete, under
  ``aj.checked`` when traced, a learned scale; off, a NaN gives NaN)."""
  if scale is None:
    return
  if isinstance(scale, (int, float, np.integer, np.floating, bool,
                        np.bool_)):
    check_scale(scale)
    return
  if not hasattr(scale, "dtype") or not hasattr(scale, "shape"):
    raise TypeError(
        f"scale must be a positive number (the multiplier of q . k), a float "
        f"scalar array or None (1 / sqrt(H)), got {scale!r} "
        f"({type(scale).__name__}).")
  if not jnp.issubdtype(scale.dtype, jnp.floating) or np.shape(scale):
    raise TypeError(
        f"scale must be a positive number or a float scalar array (shape "
        f"()), got dtype {scale.dtype} with shape {np.shape(scale)}.")
  try:
    value = float(np.asarray(scale))
  except jax.errors.TracerArrayConversionError:
    traced_checks.traced_check(
        (scale > 0) & jnp.isfinite(scale),
        "scale must be positive and finite, got {scale}.", scale=scale)
    return
  if not value > 0 or not np.isfinite(value):
    raise ValueError(f"scale must be positive and finite, got an array "
                     f"holding {value}; None means 1 / sqrt(head_dim).")


def check_no_nan_or_inf(name: str, x, neg_inf: str = "") -> None:
  """No NaN or +inf in ``x`` (``-inf`` too unless ``neg_inf`` says what it
  means there): checked now when concrete (an array closed over by
  ``jax.jit`` included), under ``aj.checked`` when traced (off, such an
  entry gives NaN rows)."""
  allowed = f" (-inf {neg_inf})" if neg_inf else ""
  message = (f"{name} must be finite{allowed}, got NaN or "
             f"{'+inf' if neg_inf else 'inf'} entries (shape "
             f"{shape_of(x)})")
  if isinstance(x, jax.core.Tracer):
    bad = jnp.isnan(x) | (x == jnp.inf if neg_inf else jnp.isinf(x))
    traced_checks.traced_check(~jnp.any(bad), message + ".")
    return
  bad = _bad_entries(x, bool(neg_inf))
  if bad is not None:
    where = np.argwhere(bad)
    raise ValueError(f"{message}: {len(where)} of them, the first at index "
                     f"{tuple(int(i) for i in where[0])}.")


def _on_host(x) -> bool:
  devices = getattr(x, "devices", None)
  return devices is None or all(d.platform == "cpu" for d in devices())


@jax.jit
def _any_bad(x, neg_inf_ok):
  return jnp.any(jnp.isnan(x) | jnp.where(neg_inf_ok, x == jnp.inf,
                                          jnp.isinf(x)))


def _bad_entries(x, neg_inf_ok: bool) -> np.ndarray | None:
  """The bool mask of NaN / +inf (/ -inf) entries of a concrete ``x``, or
  None when there are none. Read in NumPy where ``x`` is in host memory
  (no copy, nothing to compile per shape); elsewhere one device reduction
  first, so only a bad array comes to the host."""
  if not _on_host(x):
    with jax.ensure_compile_time_eval():  # a constant under jit
      if not bool(_any_bad(x, neg_inf_ok)):
        return None
  values = np.asarray(x)
  if not np.issubdtype(values.dtype, np.floating):  # bfloat16 and the like
    values = values.astype(np.float32)
  bad = np.isnan(values) | (values == np.inf if neg_inf_ok
                            else np.isinf(values))
  return bad if bad.any() else None


def check_head_counts(d_model: int, num_heads: int,
                      num_kv_heads: int | None) -> int:
  """Validates ``D``, ``N`` and ``K``; returns ``K`` (``N`` when None)."""
  check_positive_int("d_model", d_model)
  check_positive_int("num_heads", num_heads)
  if num_kv_heads is None:
    num_kv_heads = num_heads
  check_positive_int("num_kv_heads", num_kv_heads)
  if d_model % num_heads:
    raise ValueError(f"d_model={d_model} must be divisible by num_heads="
                     f"{num_heads}.")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} must be divisible by "
                     f"num_kv_heads={num_kv_heads}.")
  return num_kv_heads


# Numerics: compute dtypes, bool masks, and garbage (NaN or inf) codes.
def integer_array(name: str, x, layout: str = ""):
  """``x`` (a list read as an array) if its dtype is integer, else a
  ``TypeError`` naming ``name``, the dtype and the shape."""
  if isinstance(x, (list, tuple)):
    x = np.asarray(x)
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array{layout}, got dtype "
                    f"{dtype} with shape {np.shape(x)}.")
  return x


def compute_dtype(*xs) -> jnp.dtype:
  """float32 for float16/bfloat16/float32 inputs, float64 for float64 ones."""
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def as_bool_mask(mask) -> jax.Array:
  """A bool mask from a bool or integer one (0 = blocked)."""
  mask = jnp.asarray(mask)
  return mask if mask.dtype == jnp.bool_ else mask != 0


CLEAN, BAD_VALUE, BAD_KEY = 0.0, 1.0, 2.0  # codes; a bad query is BAD_KEY


def sanitize(query, key, value):
  """Non-finite entries replaced by 0, and the codes of rows and columns.

  ``query [..., T, H]``, ``key [..., S, H]``, ``value [..., S, Hv]``.
  Returns ``(query, key, value, q_code [..., T], kv_code [..., S])``,
  float32 codes: ``BAD_KEY`` for a query row or key row holding a NaN or
  inf, else ``BAD_VALUE`` for a value row holding one, else ``CLEAN``. The
  replacement has gradient 1 at finite entries, 0 at the others. O((T + S)
  * H): one elementwise pass each.
  """
  q_code, kv_code = codes(query, key, value)
  return (*finite_values(query, key, value), q_code, kv_code)


def finite_values(*arrays):
  """The arrays with NaN and inf replaced by 0 (gradient 1 at finite
  entries, 0 at the others): one elementwise pass each, which XLA fuses
  with a kernel's other selects on the same operand (``zero_unseen``)."""
  return tuple(jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))
               for x in arrays)


def codes(query, key, value):
  """``(q_code [..., T], kv_code [..., S])``, float32: ``BAD_KEY`` for a
  query or key row holding a NaN or inf, else ``BAD_VALUE`` for a value row
  holding one, else ``CLEAN``. A row reduction each.

  A row is bad exactly when the sum of ``x * 0`` over it is NaN (``0`` for
  a finite entry, NaN for NaN or inf): a float sum, which XLA:CPU
  vectorises, where ``all(isfinite(x), -1)`` (a boolean reduction over a
  short minor axis) runs about 4x slower."""
  bad = []  # [..., T], [..., S], [..., S]
  for x in (query, key, value):
    bad.append(jnp.isnan(jnp.sum(x * jnp.zeros((), x.dtype), axis=-1)))
  q_code = jnp.where(bad[0], BAD_KEY, CLEAN).astype(jnp.float32)
  kv_code = jnp.where(bad[1], BAD_KEY, jnp.where(bad[2], BAD_VALUE, CLEAN))
  return q_code, kv_code.astype(jnp.float32)


def any_nonfinite(*arrays):
  """A bool scalar, True if any entry of the arrays may be NaN or inf: the
  predicate of a ``lax.cond`` that skips the search for the rows that see
  one when there is none.

  The sum of all entries is finite when every entry is (one read of each
  array, a reduction every backend vectorises; a per-entry test would need
  a pass writing its result, or a broadcast of zeros, on XLA:CPU). Finite
  entries whose float32 sum overflows also answer True: the search then
  runs and finds nothing, a cost and never a wrong answer.
  """
  total = jnp.zeros((), jnp.float32)
  for x in arrays:
    total = total + jnp.sum(x, dtype=jnp.float32)
  return ~jnp.isfinite(total)


def seen_codes(allowed, q_code, kv_code):
  """Each row's code: the largest of the keys it may see, and of its own
  query if it sees any key.

  ``allowed`` is bool ``[..., T, S]`` or None (every entry allowed);
  ``q_code [..., T]``, ``kv_code [..., S]`` from ``sanitize``. Returns
  float32 ``[..., T]``. One select and reduction over ``[T, S]``.
  """
  parts = [q_code[..., :, None], kv_code[..., None, :]]
  if allowed is not None:
    parts.append(allowed)
  rank = max(x.ndim for x in parts)  # leading dims broadcast from the left
  parts = [x.reshape((1,) * (rank - x.ndim) + x.shape) for x in parts]
  both = jnp.maximum(parts[0], parts[1])
  if allowed is not None:
    both = jnp.where(parts[2], both, CLEAN)
  return jnp.max(both, axis=-1, initial=CLEAN)


def seen_codes_by_rows(visible, q_code, kv_code, t: int, chunk: int = 256):
  """``seen_codes`` without a ``[T, S]`` array: ``chunk`` rows at a time.

  ``visible(start, size)`` gives rows ``[start, start + size)``'s bool
  ``[..., size, S]`` (or None: all allowed); ``q_code [..., T]``,
  ``kv_code [..., S]``. For kernels that cannot carry codes through their
  own block walk (splash, cuDNN): O(T * S) work, O(chunk * S) memory.
  """
  if t == 0:
    return jnp.zeros(q_code.shape, jnp.float32)
  size = min(chunk, t)
  count = -(-t // size)
  # The last chunk ends at row T (it may overlap the one before).
  starts = jnp.minimum(jnp.arange(count) * size, t - size)

  def part(start):
    q = jax.lax.dynamic_slice_in_dim(q_code, start, size, axis=-1)
    return seen_codes(visible(start, size), q, kv_code)  # [..., size]

  parts = jnp.moveaxis(jax.lax.map(part, starts), 0, -2)  # [..., n, size]
  rows = jnp.arange(t)
  which = jnp.minimum(rows // size, count - 1)
  return parts[..., which, rows - starts[which]]  # [..., T]


def poison(code, out, *key_stats):
  """NaN in the rows whose ``code`` (``[..., T]``) is not ``CLEAN``.

  ``out [..., T, Hv]`` becomes NaN where a row saw a bad key, value or
  query; each of ``key_stats`` (``[..., T]`` like lse and row maxima, or
  ``[..., T, S]`` like weights; None passes) only where it saw a bad key or
  query (they do not depend on the values). The NaN is a constant: those
  rows' cotangents stop here. Returns ``(out, *key_stats)``.
  """
  poisoned = []
  for i, x in enumerate((out, *key_stats)):
    bad = code >= (BAD_VALUE if i == 0 else BAD_KEY)
    if x is not None:
      bad = bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim))
      x = jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)
    poisoned.append(x)
  return tuple(poisoned)


def zero_unseen(seen, *arrays):
  """Zeroes the rows of ``[..., S, F]`` arrays whose key no query may see.

  ``seen`` is ``[..., S]`` bool (True where some query may attend to key j),
  broadcastable against the arrays' leading dims. Masking the logits is not
  enough: a NaN or inf stored in a padded key or value still meets a zero
  weight in ``p @ v`` or in a gradient, and ``0 * NaN`` is NaN.
  """
  return tuple(None if x is None else
               jnp.where(seen[..., None], x, jnp.zeros((), x.dtype))
               for x in arrays)


def with_sink(out, lse, sink, q_lengths=None):
  """Adds ``exp(sink)`` to each row's softmax denominator (an attention sink).

  ``out [T, Hv]`` and ``lse [T]`` are one head's attention over its keys;
  with the sink the weights become ``exp(logit - lse')`` with
  ``lse' = logaddexp(lse, sink)``, so ``out`` scales by ``exp(lse - lse')``
  (rows then sum to less than 1; a row with no visible key keeps output 0
  and gets ``lse' = sink``). Rows past ``q_lengths`` are not queries: their
  ``lse'`` stays ``-inf``. Differentiable in every argument (the gradient
  reaches the kernel through ``lse``). Returns ``(out, keep [T], lse')``,
  ``keep`` the factor applied to each row's weights.
  """
  sink = jnp.asarray(sink, lse.dtype)
  total = jnp.logaddexp(lse, sink)  # [T]
  keep = jnp.exp(lse - total)  # 0 where lse = -inf
  out = out * keep[:, None].astype(out.dtype)
  if q_lengths is not None:
    total = jnp.where(jnp.arange(lse.shape[0]) < q_lengths, total, -jnp.inf)
  return out, keep, total
