"""Applying a ``Rope`` to arrays, and positions for packed rows.

Shape glossary: B batch, T length, N heads, H head dim, R rotated features
(``Rope.rotary_dim(H)``), ``h = R / 2`` rotated pairs, P position axes of
multimodal positions (``len(rope.sections)``); ``...`` leading batch dims.

``apply_rope(x, positions, rope=)`` rotates queries or keys ``[..., T,
H]`` in steps: check ``x``, then the rope against ``R`` and the positions
against ``x``; pick the ``[h]`` frequencies (on device for the scalings
that follow the length ``L``, which may be traced); turn positions and
frequencies into cos and sin ``[..., T, h]``; rotate the pairs (half-split
or interleaved) and pass the features past ``R`` through. ``as_rope``
checks the ``rope=`` option that the layers take. ``segment_positions``
restarts positions at each document of a packed row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.scores import rope_checks
from attention_jax.scores import rope_frequencies
from attention_jax.scores.rope_spec import LENGTH_DEPENDENT
from attention_jax.scores.rope_spec import SCALINGS
from attention_jax.scores.rope_spec import Rope


def as_rope(value) -> Rope | None:
  """A ``rope=`` option checked: None (no rotary embedding) or a ``Rope``.

  Raises:
    TypeError: anything else, with the ``Rope`` to write for a number
      (``rope=10000.0`` is ``Rope(base=10000.0)``) or a scaling's name.

  Example:
    >>> from attention_jax.scores.rope import Rope, as_rope
    >>> as_rope(Rope(base=500.0)) == Rope(base=500.0), as_rope(None)
    (True, None)
  """
  if value is None or isinstance(value, Rope):
    return value
  hint = ("pass None (no rotary embedding) or a Rope, e.g. Rope(base="
          "500000.0, scaling='llama3', factor=8.0, original_max_positions="
          "8192)")
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"rope={value!r} is a bool, not a rotary embedding: "
                    f"{hint}.")
  if isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"rope={value!r} is a number: the rotary base goes in "
                    f"the Rope, rope=aj.Rope(base={float(value)!r}).")
  if isinstance(value, str):
    fix = (f"Rope(scaling={value!r}, ...)" if value in SCALINGS
           else f"Rope(...) (scalings: {', '.join(map(repr, SCALINGS))})")
    raise TypeError(f"rope={value!r} is a string: describe the embedding "
                    f"with {fix}.")
  if isinstance(value, (jax.Array, jax.core.Tracer, np.ndarray)):
    raise TypeError(
        f"rope must be static, got an array of shape "
        f"{checks.shape_of(value)}: {hint}.")
  raise TypeError(f"rope={value!r} ({type(value).__name__}) is not a rotary "
                  f"embedding: {hint}.")


def apply_rope(x: ArrayLike, positions: ArrayLike, *,
               rope: Rope | None = None,
               seq_len: ArrayLike | None = None) -> jax.Array:
  """Rotates the features of ``x`` by angles proportional to ``positions``.

  Convention ("half-split", as in Gemma, flax, HF llama and most
  llama-in-JAX code): with ``R = int(H * rope.fraction)`` (even, or
  refused) and ``h = R / 2``, feature ``i < h`` is paired with feature
  ``i + h`` and the pair is rotated by the angle ``p * theta_i`` for position ``p``
  (``theta_i = rope.base**(-2 i / R)`` without scaling)::

    out[i]     = x[i] * cos - x[i + h] * sin
    out[i + h] = x[i + h] * cos + x[i] * sin

  Features ``R:`` (partial rotary, ``Rope(fraction < 1)``) pass unchanged.
  Checkpoints trained with interleaved pairs ``(x[2i], x[2i + 1])`` (GPT-J,
  ``rotate_every_two``, Meta's original llama) use
  ``rope=Rope(interleaved=True)``: pair ``i`` is then ``(x[2i], x[2i + 1])``
  rotated by ``theta_i``. ``rope=Rope(...)`` also gives the context-extension
  scalings (linear, dynamic NTK, llama3, YaRN, LongRoPE; see ``Rope``);
  the ``magnitude`` of YaRN and LongRoPE multiplies cos and sin, so it
  scales the rotated features only. ``Rope(sections=...)`` (M-RoPE) takes
  one position per section: pair ``i`` turns by the position of the
  section that contains ``i`` (with ``sections_interleaved=True``, Qwen3-VL,
  of the axis its place in the ``THWTHW...`` pattern names); with
  ``section_frequencies="per_section"`` (axial vision RoPE) at its
  section's own frequencies (see ``Rope``). ``Rope(ntk_alpha=...)``
  (Hunyuan) grows the base once, for every length.

  Frequencies are float64 NumPy constants (dynamic NTK's, which depend on
  the positions, are computed on device, and LongRoPE's choice between its
  two sets is made there); angles, cos and sin and the
  rotation are computed in float32 (float64 for float64 ``x``, which needs
  ``jax_enable_x64``); the result is cast back to ``x``'s dtype. float32
  angles lose absolute precision at large positions (about ``p * 1.2e-7``
  radians).

  Args:
    x: float ``[..., T, H]`` (e.g. queries or keys ``[B, N, T, H]``), ``H``
      even.
    positions: integer or float ``[..., T]``, broadcastable to
      ``x.shape[:-1]`` without growing it: ``[T]`` shared by the batch,
      ``[B, 1, T]`` per example for ``[B, N, T, H]``, ``[B, N, T]``, or a
      scalar position for every token. With ``rope.sections``: ``[P, ...,
      T]``, ``P = len(sections)`` (Qwen2-VL: time, height, width), then one
      axis per axis of ``x.shape[:-1]``, each equal or 1 (e.g. ``[3, B, 1,
      T]`` for ``[B, N, T, H]``, ``pos[:, :, None]`` of HF's ``[3, B,
      T]``): all of ``x.ndim`` axes, so that plain ``[B, ..., T]``
      positions with ``B == P`` are refused, never read as sections.
    rope: the embedding (``Rope``: base, fraction, scaling, layout); None:
      ``Rope()``, the paper's (base 10000, every feature rotated).
    seq_len: ``scaling="dynamic"`` or ``"longrope"`` only: the length
      ``L`` their frequencies are chosen for (a number or a scalar array,
      may be traced); None: ``max(positions) + 1`` over the whole array, as
      HF. Give queries and keys rotated in separate calls the same one.

  Returns:
    ``x`` rotated, same shape and dtype.

  Raises:
    TypeError: ``x`` not floating point, ``positions`` not integer or
      float, ``rope`` not a ``Rope``.
    ValueError: odd ``H``, ``x`` of rank < 2, ``positions`` not
      broadcastable (or, with ``sections``, without the leading axis of
      ``len(sections)`` and ``x.ndim`` axes in all), a fraction rotating no
      features or an odd number of them, ``seq_len``
      given without dynamic or longrope scaling, ``short_factor`` /
      ``long_factor`` without ``R / 2`` entries, ``sections`` not summing
      to ``R / 2``.

  Example:
    >>> from attention_jax.scores.rope import Rope, apply_rope
    >>> q = jnp.ones((1, 2, 4, 8))  # [B, N, T, H]
    >>> out = apply_rope(q, jnp.arange(4))  # positions [T]
    >>> out.shape, out.dtype
    ((1, 2, 4, 8), dtype('float32'))
    >>> bool(jnp.all(out[:, :, 0] == q[:, :, 0]))  # position 0: identity
    True
    >>> apply_rope(jnp.array([[1.0, 0.0]]), jnp.array([1]), rope=Rope(base=1.0))
    Array([[0.5403023 , 0.84147096]], dtype=float32)
    >>> long = Rope(base=500000.0, scaling="llama3", factor=8.0,
    ...             original_max_positions=8192, interleaved=True)
    >>> apply_rope(q, jnp.arange(4), rope=long).shape
    (1, 2, 4, 8)
    >>> mrope = Rope(sections=(2, 1, 1))  # R / 2 = 4 frequencies
    >>> thw = jnp.stack([jnp.arange(4)] * 3)[:, None, None, :]  # [3, 1, 1, T]
    >>> bool(jnp.allclose(apply_rope(q, thw, rope=mrope),
    ...                   apply_rope(q, jnp.arange(4))))  # text: plain RoPE
    True
    >>> axial = Rope(sections=(2, 2), section_frequencies="per_section")
    >>> axial.inverse_frequencies(8)  # a ladder over 2 pairs per axis
    array([1.  , 0.01, 1.  , 0.01])
    >>> hw = jnp.array([[0, 0, 1, 1], [0, 1, 0, 1]])[:, None, None, :]
    >>> apply_rope(q, hw, rope=axial).shape  # (h, w) of a 2 x 2 grid
    (1, 2, 4, 8)
  """
  x = _checked_x(x)
  rope = Rope() if rope is None else as_rope(rope)
  rot = rope_frequencies.rotary_dim(x.shape[-1], rope.fraction)
  _check_rope_fits(rope, rot, x.shape[-1], seq_len)
  positions = _checked_positions(positions, rope, x.shape)
  compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  pos = jnp.asarray(positions).astype(compute)
  if rope.scaling in LENGTH_DEPENDENT:
    seq_len = _length(pos, seq_len)
  inv_freq = _inverse_frequencies(rope, rot, seq_len, compute)
  cos, sin = _cos_sin(rope, pos, inv_freq, x.ndim - 1)
  return _rotate(x, cos, sin, rot, rope.interleaved, compute)


def _checked_x(x) -> jax.Array:
  """``x`` as a float array ``[..., T, H]`` whose features pair up."""
  x = checks.as_array_operand("x", x, "[..., T, H]")
  checks.check_float_array("x", x)
  checks.check_min_rank("x", x, 2, "[..., T, H]")
  x = jnp.asarray(x)
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"x must have an even head dim H (features are rotated "
                     f"in pairs), got shape {x.shape} with H={head_dim}.")
  return x


def _check_rope_fits(rope: Rope, rot: int, head_dim: int, seq_len) -> None:
  """The rope's per-pair fields need ``R`` (known only here, from ``H``),
  and ``seq_len`` is refused where the rope's scaling would not read it."""
  rope_checks.check_sections_dim(rope.sections, rope.fraction, rot, head_dim)
  if rope.scaling == "longrope":
    rope_checks.check_longrope_dim(rope.short_factor, rope.long_factor,
                                   rope.fraction, rot, head_dim)
  if seq_len is not None and rope.scaling not in LENGTH_DEPENDENT:
    raise ValueError(
        f"seq_len chooses dynamic NTK frequencies, and this rope has "
        f"scaling={rope.scaling!r}: leave seq_len None or use "
        f"scaling='dynamic' (or 'longrope', whose factor set it picks).")


def _checked_positions(positions, rope: Rope, x_shape) -> ArrayLike:
  """``positions`` as an integer or float array that broadcasts to ``x``'s
  ``[..., T]`` (with sections: ``[P, ..., T]``), refused by name if not."""
  if positions is None:
    raise TypeError("positions is None: pass integer positions [..., T].")
  if isinstance(positions, (list, tuple)):
    positions = np.asarray(positions)
  pos_dtype = jnp.result_type(positions)
  if not (jnp.issubdtype(pos_dtype, jnp.integer)
          or jnp.issubdtype(pos_dtype, jnp.floating)):
    raise TypeError(
        f"positions must be an integer or float array [..., T], got dtype "
        f"{pos_dtype} with shape {checks.shape_of(positions)}.")
  pos_shape = checks.shape_of(positions)
  if rope.sections is not None:
    _check_section_positions(rope.sections, pos_shape, x_shape)
  elif len(pos_shape) >= len(x_shape):
    raise ValueError(
        f"positions with shape {pos_shape} is not broadcastable to "
        f"x.shape[:-1] ([..., T]) = {x_shape[:-1]}: it has more axes. "
        f"Multimodal positions [P, ..., T] need Rope(sections=...).")
  else:
    checks.check_broadcastable_to("positions", pos_shape, x_shape[:-1],
                                  "x.shape[:-1] ([..., T])")
  return positions


def _check_section_positions(sections, pos_shape, x_shape) -> None:
  """M-RoPE positions: ``[P, ...]`` with ``x.ndim`` axes in all."""
  n = len(sections)
  if len(pos_shape) != len(x_shape) or pos_shape[0] != n:
    lead = ", ".join(["1"] * (len(x_shape) - 2) + ["T"])
    raise ValueError(
        f"rope.sections={sections} needs multimodal positions [{n}, ..., T]: "
        f"a leading axis of len(sections)={n} (one position per section, "
        f"e.g. time, height, width), then one axis per axis of x.shape[:-1]"
        f" = {tuple(x_shape[:-1])}, each equal or 1 ({len(x_shape)} axes, "
        f"e.g. [{n}, {lead}]); got positions of shape {pos_shape}. Text "
        f"tokens repeat one position on every axis. "
        f"aj.multi_head_attention needs them passed explicitly, positions "
        f"[{n}, B, T] while decoding too: its default positions (arange, "
        f"segments, a cache's) are plain.")
  checks.check_broadcastable_to("positions", pos_shape[1:], x_shape[:-1],
                                "x.shape[:-1] ([..., T])",
                                full_shape=pos_shape)


def _length(pos: jax.Array, seq_len):
  """The length ``L`` dynamic NTK and LongRoPE choose frequencies for:
  ``seq_len`` checked, or HF's ``max(positions) + 1`` when None."""
  if seq_len is None:
    # An empty call leaves the base as is (dynamic) and takes the short
    # factors (longrope).
    return jnp.max(pos, initial=-1.0) + 1.0
  if not isinstance(seq_len, (jax.Array, jax.core.Tracer)):
    return rope_checks.check_number("seq_len", seq_len)
  rope_checks.check_seq_len_array(seq_len)
  return seq_len


def _inverse_frequencies(rope: Rope, rot: int, seq_len,
                         dtype) -> jax.Array:
  """The ``[h]`` frequencies in ``dtype``: computed on device where they
  follow ``L`` (which may be traced), program constants otherwise."""
  theta = rope_frequencies.plain_theta(rope.base, rot)
  original = rope.original_max_positions
  if rope.scaling == "dynamic":
    rope_checks.check_dynamic_dim(rot)
    return rope_frequencies.dynamic_on_device(theta, rot, rope.factor,
                                              original, seq_len, dtype)
  if rope.scaling == "longrope":
    return rope_frequencies.longrope_on_device(
        theta, rope.short_factor, rope.long_factor, original, seq_len, dtype)
  # float64 NumPy (exact up to one final rounding), a program constant.
  return jnp.asarray(rope.inverse_frequencies(rot), dtype)


def _cos_sin(rope: Rope, pos: jax.Array, inv_freq: jax.Array,
             lead: int) -> tuple[jax.Array, jax.Array]:
  """cos and sin of each pair's angle ``[..., T, h]`` (axes of 1 where
  shared), times the magnitude: it scales the rotated features only."""
  inv_freq = inv_freq.reshape((1,) * lead + inv_freq.shape)  # [1, ..., 1, h]
  if rope.sections is None:
    pos = pos.reshape((1,) * (lead - pos.ndim) + pos.shape)[..., None]
  else:
    # Pair i reads the position axis of its section: [P, ..., T] -> [..., T,
    # h], then the same product as plain RoPE (HF multiplies every axis by
    # every frequency and keeps, per frequency, its section's axis).
    axis_of = rope_frequencies.section_axes(rope.sections,
                                            rope.sections_interleaved)
    pos = jnp.moveaxis(jnp.take(pos, axis_of, axis=0), 0, -1)
  angle = pos * inv_freq  # [..., T, h] (leading dims of 1 where shared)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  magnitude = rope.magnitude
  if magnitude != 1.0:  # YaRN, LongRoPE: on cos and sin, so rotated only
    cos, sin = cos * magnitude, sin * magnitude
  return cos, sin


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, rot: int,
            interleaved: bool, compute) -> jax.Array:
  """The first ``R`` features rotated pair by pair in ``compute`` (cast back
  to ``x``'s dtype); features ``R:`` pass unchanged (partial rotary)."""
  half = rot // 2
  if interleaved:
    pairs = x[..., :rot].astype(compute).reshape(x.shape[:-1] + (half, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]  # [..., T, h] each
    rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                        axis=-1).reshape(x.shape[:-1] + (rot,))
  else:
    x1 = x[..., :half].astype(compute)
    x2 = x[..., half:rot].astype(compute)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                              axis=-1)
  rotated = rotated.astype(x.dtype)
  if rot == x.shape[-1]:
    return rotated
  return jnp.concatenate([rotated, x[..., rot:]], axis=-1)


def segment_positions(segment_ids: ArrayLike) -> jax.Array:
  """Positions that restart at 0 at each new segment along the last axis.

  A segment is a run: a maximal block of equal consecutive ids, so
  ``[0, 0, 1, 1, 0]`` has three segments (positions ``[0, 1, 0, 1, 0]``).
  Padding tokens get positions like any other run; mask them out of the
  attention as usual. Vectorised: the start index of each run is carried
  forward with a cumulative maximum.

  Args:
    segment_ids: integer ``[..., T]`` ids of packed documents (e.g. ``[T]``
      or ``[B, T]``).

  Returns:
    int32 ``[..., T]``: each token's offset from the start of its run.
    Pass ``positions[:, None, :]`` to ``apply_rope`` for ``[B, N, T, H]``.

  Raises:
    TypeError: ``segment_ids`` not an integer array.
    ValueError: ``segment_ids`` a scalar.

  Example:
    >>> from attention_jax.scores.rope import segment_positions
    >>> segment_positions(jnp.array([3, 3, 3, 7, 7, 1]))
    Array([0, 1, 2, 0, 1, 0], dtype=int32)
  """
  if segment_ids is None:
    raise TypeError("segment_ids is None: pass integer ids [..., T].")
  if isinstance(segment_ids, (list, tuple)):
    segment_ids = np.asarray(segment_ids)
  dtype = jnp.result_type(segment_ids)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"segment_ids must be an integer array [..., T], got dtype {dtype} "
        f"with shape {checks.shape_of(segment_ids)}.")
  checks.check_min_rank("segment_ids", segment_ids, 1, "[..., T]")
  ids = jnp.asarray(segment_ids)
  t = ids.shape[-1]
  index = jnp.arange(t, dtype=jnp.int32).reshape((1,) * (ids.ndim - 1) + (t,))
  first = jnp.ones(ids.shape[:-1] + (min(t, 1),), jnp.bool_)
  starts = jnp.concatenate([first, ids[..., 1:] != ids[..., :-1]], axis=-1)
  run_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=ids.ndim - 1)
  return index - run_start
