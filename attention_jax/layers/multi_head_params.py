"""Multi-head attention parameters: their layout, initialisation and checks.

Shape glossary: N query heads, K key/value heads (K divides N), H head dim,
D model (query) dim, Dkv key/value input features, Dout output features, R
T5 relative-position buckets.

Parameters follow the lesson's names, ``{"W_q", "W_k", "W_v", "W_o"}``, laid
out per head as flax's ``LinearGeneral`` (and ``nnx.MultiHeadAttention``)
lays them out:

- ``W_q``: ``{"kernel": [D, N, H], "bias": [N, H]}``
- ``W_k``, ``W_v``: ``{"kernel": [Dkv, K, H], "bias": [K, H]}``
- ``W_o``: ``{"kernel": [N, H, Dout], "bias": [Dout]}``
- each ``bias`` optional, per projection: one without is one with a zero
  bias (Whisper's ``k_proj`` has none, Qwen2's ``o_proj`` none: a ``W_k``
  bias adds the same ``q . b_k`` to every logit of a row, which the
  softmax cancels unless rope, qk-norm or a nonlinear score modifier
  makes it vary by key; lse and max logits keep it)
- optional ``q_norm``, ``k_norm``: ``{"scale": [H]}`` shared by the heads,
  or one per head: ``[N, H]`` (``q_norm``) and ``[K, H]`` (``k_norm``), with
  a ``"bias"`` of the scale's shape for a biased norm; how they normalise
  is an ``aj.QKNorm`` (RMS or layer norm, per head or over the whole width,
  epsilon, ``1 + w``, a bias, before or after rotary), which the call gives
  (``qk_norm=``)
- optional ``v_norm``: ``{"scale": [H] or [K, H]}`` (and ``"bias"``), the
  weight of the value norm (``value_norm=``, an ``aj.QKNorm``); optional
  ``o_norm``: ``{"scale": [H] or [N, H]}`` (and ``"bias"``), of the norm on
  the attention output before the gate and ``W_o`` (``output_norm=``)
- optional ``W_g``: ``{"kernel": [D, N, G], "bias": [N, G]}``, the output
  gate (``G = H``: one gate per feature, "elementwise"; ``G = 1``: one per
  head, "headwise"): ``sigmoid(query @ W_g)`` multiplies each head's
  attention output before ``W_o``
- optional ``sinks``: ``{"logits": [N]}``, learned per-head sink logits
  (gpt-oss) joining every row's softmax denominator
- optional ``t5_bias``: ``{"table": [R, N]}``, T5's learned relative position
  bias (``table[bucket(kv_idx - q_idx), h]`` added to the logits); how
  distances fall into its ``R`` buckets is an ``aj.T5Bias``, a setting the
  call gives (``t5_bias=``), as it gives ``rope``

The head structure lives in the parameters, so everything (N, K, H, D, Dkv,
Dout, the norms, the gate) is read from their shapes (``param_dims``); ``multi_head``
computes with them. Everything a layer learns is in its params, so
``aj.multi_head_attention(mha.params_dict(), ...)`` is ``mha(...)``.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.core import checks
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.scores import score_mods

Params = dict[str, dict[str, jax.Array]]

# The per-head layout of each parameter, for messages.
LAYOUT = {
    "W_q": "kernel [D, N, H], bias [N, H]",
    "W_k": "kernel [Dkv, K, H], bias [K, H]",
    "W_v": "kernel [Dkv, K, H], bias [K, H]",
    "W_o": "kernel [N, H, Dout], bias [Dout]",
    "q_norm": "scale [H] (shared) or [N, H] (per head), bias as scale",
    "k_norm": "scale [H] (shared) or [K, H] (per head), bias as scale",
    "v_norm": "scale [H] (shared) or [K, H] (per head), bias as scale",
    "o_norm": "scale [H] (shared) or [N, H] (per head), bias as scale",
    "W_g": "kernel [D, N, G], bias [N, G] with G = H (elementwise) or 1 "
           "(headwise)",
    "sinks": "logits [N]",
    "t5_bias": "table [num_buckets, N]",
}
# The entries of each parameter: (required, allowed); the rest are a
# kernel and an optional bias.
_ENTRIES = {"sinks": ("logits", {"logits"}), "t5_bias": ("table", {"table"}),
            **{name: ("scale", {"scale", "bias"})
               for name in ("q_norm", "k_norm", "v_norm", "o_norm")}}

# The output gate's kinds: the gate's width G per head.
OUTPUT_GATES = ("elementwise", "headwise")


class HeadDims(NamedTuple):
  """The sizes a multi-head parameter dict implies."""
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  d_model: int  # D, query features
  kv_features: int  # Dkv, key/value features
  out_features: int  # Dout
  normalize_qk: bool  # q_norm/k_norm present (weights: see qk_norm_weight)
  output_gate: str | None = None  # W_g present: "elementwise" or "headwise"


def check_dims(d_model: int, num_heads: int, *,
               num_kv_heads: int | None = None, head_dim: int | None = None,
               kv_features: int | None = None,
               out_features: int | None = None) -> HeadDims:
  """Validates the sizes of a layer to build; fills the defaults.

  ``num_kv_heads`` defaults to ``num_heads``, ``head_dim`` to
  ``d_model // num_heads`` (then ``num_heads`` must divide ``d_model``),
  ``kv_features`` and ``out_features`` to ``d_model``.

  Example:
    >>> check_dims(16, 4, num_kv_heads=2).head_dim
    4
  """
  checks.check_positive_int("d_model", d_model)
  checks.check_positive_int("num_heads", num_heads)
  if head_dim is None:
    if d_model % num_heads:
      raise ValueError(
          f"d_model={d_model} must be divisible by num_heads={num_heads}: "
          f"head_dim defaults to d_model // num_heads; pass head_dim= to "
          f"choose it.")
    head_dim = d_model // num_heads
  checks.check_positive_int("head_dim", head_dim)
  num_kv_heads = checks.check_head_counts(num_heads * head_dim, num_heads,
                                          num_kv_heads)
  kv_features = d_model if kv_features is None else kv_features
  out_features = d_model if out_features is None else out_features
  checks.check_positive_int("kv_features", kv_features)
  checks.check_positive_int("out_features", out_features)
  return HeadDims(num_heads, num_kv_heads, head_dim, d_model, kv_features,
                  out_features, False)


def init_multi_head_params(
    rng: jax.Array,
    d_model: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    kv_features: int | None = None,
    out_features: int | None = None,
    use_bias: bool = True,
    normalize_qk: bool | qk_norm_lib.QKNorm = False,
    output_gate: str | None = None,
    attention_sinks: bool = False,
    t5_bias: score_mods.T5Bias | None = None,
    dtype: jnp.dtype = jnp.float32,
    value_norm: qk_norm_lib.QKNorm | None = None,
    output_norm: qk_norm_lib.QKNorm | None = None,
) -> Params:
  """Initialises ``W_q``, ``W_k``, ``W_v``, ``W_o`` for ``multi_head_attention``.

  Kernels are LeCun-normal, drawn as flax's ``LinearGeneral`` draws them: on
  the flat 2-D shape (``[D, N*H]``, ``[N*H, Dout]``, so fan-in is ``D`` and
  ``N*H``), then reshaped per head. Biases are zero, qk-norm scales one.

  Args:
    rng: ``jax.random.key``.
    d_model: ``D``, query features.
    num_heads: ``N``.
    num_kv_heads: ``K``; must divide ``num_heads``. ``None`` means ``N``.
    head_dim: ``H``; ``None`` means ``D // N`` (then ``N`` must divide ``D``).
    kv_features: ``Dkv``, key/value input features; ``None`` means ``D``.
    out_features: ``Dout``, output features; ``None`` means ``D``.
    use_bias: whether each projection has a bias.
    normalize_qk: True (``aj.QKNorm()``) or an ``aj.QKNorm``: add its
      weights ``q_norm`` and ``k_norm`` (``{"scale": [H]}`` shared, or
      ``[N, H]`` / ``[K, H]`` per head; none for a weightless norm), the
      identity to start (ones, or zeros under ``weight_offset=1``; a
      ``bias=True`` norm's biases zeros).
    output_gate: add ``W_g``, a sigmoid gate on each head's output computed
      from the query input: ``"elementwise"`` (``[D, N, H]``, one gate per
      feature, Qwen3-Next) or ``"headwise"`` (``[D, N, 1]``, one per
      head); its kernel is drawn like ``W_q``'s, its bias is zero.
    attention_sinks: add ``sinks``, ``{"logits": [N]}``, zero (as
      ``aj.MultiHeadAttention(attention_sinks=True)`` starts them).
    t5_bias: an ``aj.T5Bias``: add ``t5_bias``, ``{"table": [num_buckets,
      N]}``, drawn normal with std ``d_model ** -0.5`` (as the module draws
      it); pass the same ``t5_bias=`` to the call.
    dtype: parameter dtype.
    value_norm: an ``aj.QKNorm`` normalising the values: add its weight
      ``v_norm`` (``{"scale": [H]}`` or ``[K, H]``, ``"bias"`` with
      ``bias=True``; none for a weightless norm), the identity to start.
    output_norm: an ``aj.QKNorm`` normalising the attention output before
      ``W_o``: add ``o_norm`` (``[H]`` or ``[N, H]``), as ``v_norm``.

  Returns:
    ``{"W_q": {"kernel": [D, N, H], "bias": [N, H]}, "W_k": {"kernel":
    [Dkv, K, H], "bias": [K, H]}, "W_v": (as W_k), "W_o": {"kernel":
    [N, H, Dout], "bias": [Dout]}}`` (no ``"bias"`` entries when
    ``use_bias=False``), plus ``"q_norm"``/``"k_norm"``: ``{"scale": [H]}``
    with ``normalize_qk``, ``"v_norm"``/``"o_norm"`` with ``value_norm``/
    ``output_norm``, ``"W_g"`` with ``output_gate``, ``"sinks"``:
    ``{"logits": [N]}`` with ``attention_sinks``, ``"t5_bias"``:
    ``{"table": [num_buckets, N]}`` with ``t5_bias``.

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 8, 4, num_kv_heads=2)
    >>> p["W_q"]["kernel"].shape, p["W_k"]["kernel"].shape
    ((8, 4, 2), (8, 2, 2))
    >>> p["W_o"]["kernel"].shape
    (4, 2, 8)
  """
  n, k, h, d, dkv, dout, _, _ = check_dims(
      d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
      kv_features=kv_features, out_features=out_features)
  check_output_gate(output_gate)
  checks.check_static_bool("attention_sinks", attention_sinks)
  check_t5_bias(t5_bias)
  init = jax.nn.initializers.lecun_normal()
  shapes = {  # name: (kernel shape, bias shape)
      "W_q": ((d, n, h), (n, h)),
      "W_k": ((dkv, k, h), (k, h)),
      "W_v": ((dkv, k, h), (k, h)),
      "W_o": ((n, h, dout), (dout,)),
  }
  if output_gate is not None:
    g = gate_width(output_gate, h)
    shapes["W_g"] = ((d, n, g), (n, g))
  params = {}
  # The four projections draw from the first four keys as before, so adding
  # a gate does not change them.
  rngs = list(jax.random.split(rng, 4)) + [jax.random.fold_in(rng, 4)]
  for rng_i, (name, (shape, bias_shape)) in zip(rngs, shapes.items()):
    fan_in = shape[0] if name != "W_o" else n * h
    flat = (fan_in, math.prod(shape) // fan_in)  # LinearGeneral's 2-D draw
    params[name] = {"kernel": init(rng_i, flat, dtype).reshape(shape)}
    if use_bias:
      params[name]["bias"] = jnp.zeros(bias_shape, dtype)
  norms = (("qk_norm", "q_norm", n, normalize_qk),
           ("qk_norm", "k_norm", k, normalize_qk),
           ("value_norm", "v_norm", k, value_norm),
           ("output_norm", "o_norm", n, output_norm))
  for option, name, heads, value in norms:
    norm = qk_norm_lib.as_norm(option, value)
    if norm is not None and norm.weight is not None:
      params[name] = {"scale": norm.init_scale(heads, h, dtype)}
      if norm.bias:
        params[name]["bias"] = norm.init_bias(heads, h, dtype)
  if attention_sinks:
    params["sinks"] = {"logits": jnp.zeros((n,), dtype)}
  if t5_bias is not None:  # its own key: the projections' draws stay
    params["t5_bias"] = {"table": jax.random.normal(
        jax.random.fold_in(rng, 5), (t5_bias.num_buckets, n), dtype)
                         * d ** -0.5}
  return params


def check_t5_bias(t5_bias) -> None:
  """TypeError unless ``t5_bias`` is None or an ``aj.T5Bias``."""
  if t5_bias is not None and not isinstance(t5_bias, score_mods.T5Bias):
    raise TypeError(f"t5_bias must be an aj.T5Bias(num_buckets, "
                    f"max_distance, bidirectional), got {t5_bias!r}.")


def _has_t5(mod) -> bool:
  """Whether a score modifier is (or chains) a T5 relative bias."""
  if not isinstance(mod, score_mods.ScoreMod):
    return False
  if isinstance(mod.fn, score_mods.T5Bias):
    return True
  inner = mod.params if isinstance(mod.params, tuple) else ()
  return any(_has_t5(m) for m in inner)  # a chain holds its modifiers


def check_t5(table_shape: tuple[int, ...] | None,
             t5_bias: score_mods.T5Bias | None, score_mod: Any) -> None:
  """A learned T5 table ``[R, N]`` (its shape, or None without one), its
  settings ``t5_bias`` and the layer's ``score_mod`` agree.

  A table needs ``t5_bias`` (how distances fall into its buckets) and
  ``t5_bias`` needs a table; a T5 bias inside ``score_mod`` beside the
  table is refused rather than one of them silently winning.

  Example:
    >>> check_t5(None, None, None)  # no table, no settings: nothing to check
  """
  check_t5_bias(t5_bias)
  if table_shape is None:
    if t5_bias is not None:
      raise ValueError(
          f"t5_bias={t5_bias!r} describes a learned table that params does "
          f"not hold: add params['t5_bias'] = {{'table': "
          f"[{t5_bias.num_buckets}, N]}} (init_multi_head_params(..., "
          "t5_bias=...) or a module's params_dict()), or leave t5_bias out.")
    return
  if t5_bias is None:
    raise ValueError(
        f"params['t5_bias']['table'] {list(table_shape)} is a learned T5 "
        f"relative position bias: pass t5_bias=aj.T5Bias(num_buckets="
        f"{table_shape[0]}, max_distance=..., bidirectional=...) (the "
        "layer's t5_bias) to say how distances fall into its buckets.")
  if t5_bias.num_buckets != table_shape[0]:
    raise ValueError(
        f"t5_bias={t5_bias!r} has num_buckets={t5_bias.num_buckets}, but "
        f"params['t5_bias']['table'] has shape {table_shape}: [num_buckets, "
        f"N] with {table_shape[0]} buckets. Pass the settings the table was "
        "learned with.")
  if _has_t5(score_mod):
    raise ValueError(
        "score_mod holds a T5 relative bias, and params['t5_bias']['table'] "
        f"{list(table_shape)} is the layer's own, which the call applies: "
        "give the table in one place (drop it from score_mod, or the params "
        "entry and t5_bias).")


def check_output_gate(output_gate) -> None:
  if output_gate is not None and not isinstance(output_gate, str):
    raise TypeError(
        f"output_gate must be None or a string, 'elementwise' or 'headwise', "
        f"got {output_gate!r} ({type(output_gate).__name__}).")
  if output_gate is not None and output_gate not in OUTPUT_GATES:
    raise ValueError(
        f"output_gate must be None, 'elementwise' (one sigmoid gate per "
        f"feature of each head) or 'headwise' (one per head), got "
        f"{output_gate!r}.")


def gate_width(output_gate: str, head_dim: int) -> int:
  """``G``, the gates per head: ``H`` elementwise, 1 headwise."""
  return head_dim if output_gate == "elementwise" else 1


def _layer(params, name: str) -> Mapping[str, Any]:
  layer = params.get(name)
  need, allowed = _ENTRIES.get(name, ("kernel", {"kernel", "bias"}))
  if not isinstance(layer, Mapping) or need not in layer:
    got = (f"keys {sorted(layer)}" if isinstance(layer, Mapping)
           else type(layer).__name__)
    raise ValueError(f"params['{name}'] must be a dict with {LAYOUT[name]}; "
                     f"got {got}.")
  extra = set(layer) - allowed
  if extra:
    raise ValueError(f"params['{name}'] has unexpected entries "
                     f"{sorted(extra)}; its layout is {LAYOUT[name]}.")
  return layer


def param_shape(params, name: str, entry: str) -> tuple[int, ...]:
  """The shape of ``params[name][entry]`` (for messages)."""
  return checks.shape_of(params[name][entry])


def _wrong(params, name: str, entry: str, expected: str, why: str = ""):
  got = param_shape(params, name, entry)
  flat = ""
  if entry == "kernel" and len(got) == 2:
    flat = (" Flat [in, out] kernels reshape per head: W_q/W_k/W_v "
            "kernel.reshape(D, heads, H) and bias.reshape(heads, H), W_o "
            "kernel.reshape(N, H, Dout).")
  return ValueError(f"params['{name}']['{entry}'] has shape {got}, expected "
                    f"{expected}{why} ({name}: {LAYOUT[name]}).{flat}")


# The axes of each projection array, by the size each holds; a size held
# by several arrays (H by all four kernels) is what the majority of them
# says, so that a mis-sized one is named rather than one it disagrees with.
_AXES = {("W_q", "kernel"): ("D", "N", "H"),
         ("W_k", "kernel"): ("Dkv", "K", "H"),
         ("W_v", "kernel"): ("Dkv", "K", "H"),
         ("W_o", "kernel"): ("N", "H", "Dout"),
         ("W_q", "bias"): ("N", "H"), ("W_k", "bias"): ("K", "H"),
         ("W_v", "bias"): ("K", "H"), ("W_o", "bias"): ("Dout",)}
_MEANING = {"N": "query heads", "K": "key/value heads", "H": "head dim",
            "Dkv": "key/value input features", "Dout": "output features"}


def _projection_shapes(params) -> dict[tuple[str, str], tuple[int, ...]]:
  """The shapes of ``W_q``, ``W_k``, ``W_v``, ``W_o`` and their biases;
  each kernel of its layout's rank."""
  for name in ("W_q", "W_k", "W_v", "W_o"):
    if name not in params:
      raise ValueError(f"params must have {name} ({LAYOUT[name]}), got keys "
                       f"{sorted(params)}.")
    _layer(params, name)
  shapes = {}
  for (name, entry), axes in _AXES.items():
    if entry not in params[name]:
      continue  # a projection without a bias (Whisper's W_k, Qwen2's W_o)
    if params[name][entry] is None:
      raise ValueError(
          f"params['{name}']['{entry}'] is None: leave the entry out for a "
          f"projection without a bias, or give [{', '.join(axes)}] "
          f"({name}: {LAYOUT[name]}).")
    shapes[(name, entry)] = param_shape(params, name, entry)
    if entry == "kernel" and len(shapes[(name, entry)]) != 3:
      raise _wrong(params, name, entry, f"[{', '.join(axes)}]")
  return shapes


def _holders(keys: list[tuple[str, str]]) -> str:
  """``[("W_k", "kernel"), ("W_v", "kernel"), ("W_k", "bias")]`` as "the
  W_k/W_v kernels and the W_k bias"."""
  parts = []
  for entry in ("kernel", "bias"):
    names = [name for name, e in keys if e == entry]
    if names:
      plural = {"kernel": "kernels", "bias": "biases"}[entry]
      parts.append(f"the {'/'.join(names)} "
                   f"{plural if len(names) > 1 else entry}")
  return " and ".join(parts)


def _agreed_sizes(params, shapes) -> dict[str, int]:
  """Each size the projections hold, as the strict majority of the arrays
  holding it says; an array against it is named (with the size the
  others agree on), a tie names every array holding that size."""
  votes: dict[str, list[tuple[tuple[str, str], int]]] = {}
  for key, shape in shapes.items():
    if len(shape) == len(_AXES[key]):  # a bias of another rank: checked after
      for size, value in zip(_AXES[key], shape):
        votes.setdefault(size, []).append((key, value))
  agreed = {}
  for size, held in votes.items():
    values = [value for _, value in held]
    top = max(values, key=values.count)
    agreed[size] = top if 2 * values.count(top) > len(values) else None
  for key, shape in shapes.items():
    axes = _AXES[key]
    if len(shape) != len(axes):
      continue
    off = [a for a, v in zip(axes, shape) if agreed[a] not in (None, v)]
    if off:
      known = ", ".join(f"{a}={agreed[a]}" for a in axes
                        if agreed[a] is not None)
      others = _holders([k for k, v in votes[off[0]] if v == agreed[off[0]]])
      raise _wrong(params, *key, f"[{', '.join(axes)}] with {known}",
                   f" ({off[0]}={agreed[off[0]]}: the {_MEANING[off[0]]} "
                   f"{others} agree on)")
  for size, held in votes.items():
    if agreed[size] is None:
      listed = " and ".join(
          f"params['{n}']['{e}'] {shapes[(n, e)]} ({size}={v})"
          for (n, e), v in held)
      layouts = "; ".join(f"{n}: {LAYOUT[n]}"
                          for n in dict.fromkeys(n for (n, _), _ in held))
      raise ValueError(
          f"{listed} disagree on {size}, the {_MEANING[size]} ({layouts}), "
          f"and nothing else in params says which is right: fix the "
          f"mis-sized one.")
  return agreed


def _projection_dims(params) -> tuple[int, ...]:
  """``(N, K, H, D, Dkv, Dout)`` from ``W_q``, ``W_k``, ``W_v``, ``W_o`` and
  their biases, each checked against the others (a bias may be missing
  from any of them: such a projection has none)."""
  shapes = _projection_shapes(params)
  sizes = _agreed_sizes(params, shapes)
  n, k, h = sizes["N"], sizes["K"], sizes["H"]
  if n % k:
    raise _wrong(params, "W_k", "kernel", "[Dkv, K, H]",
                 f": its K={k} heads must divide W_q's N={n} heads")
  for (name, entry), shape in shapes.items():
    want = tuple(sizes[a] for a in _AXES[(name, entry)])
    if shape != want:  # a bias of another rank
      raise _wrong(params, name, entry, str(want))
  return n, k, h, sizes["D"], sizes["Dkv"], sizes["Dout"]


def _check_norm(params, name: str, heads: int, h: int) -> int:
  """``params[name]``'s ``scale`` ``[H]`` or ``[heads, H]`` and its bias
  (if any) of the same shape; the scale's rank."""
  _layer(params, name)
  shape = param_shape(params, name, "scale")
  if shape not in ((h,), (heads, h)):
    flat = (f"; a whole-width weight [{heads * h}] reshapes to "
            f"({heads}, {h})" if shape == (heads * h,) else "")
    raise _wrong(params, name, "scale",
                 f"({h},) = [H] (shared) or ({heads}, {h}) (per head)"
                 f"{flat}")
  if "bias" in params[name] and param_shape(params, name, "bias") != shape:
    raise _wrong(params, name, "bias", f"{shape}, the shape of its scale")
  return len(shape)


def _check_norms(params, n: int, k: int, h: int) -> bool:
  """Whether ``q_norm``/``k_norm`` are present: both or neither, each
  ``[H]`` or per head, the two alike (biases too); ``v_norm`` ``[H]`` or
  ``[K, H]`` and ``o_norm`` ``[H]`` or ``[N, H]``, each alone."""
  for name, heads in (("v_norm", k), ("o_norm", n)):
    if name in params:
      _check_norm(params, name, heads, h)
  norms = [name for name in ("q_norm", "k_norm") if name in params]
  if len(norms) == 1:
    raise ValueError(f"params has {norms[0]} but not "
                     f"{({'q_norm', 'k_norm'} - set(norms)).pop()}: qk-norm "
                     "needs both (each {'scale': [H]}).")
  ranks = {_check_norm(params, name, heads, h)
           for name, heads in zip(norms, (n, k))}
  if len(ranks) > 1:
    raise ValueError(
        f"params['q_norm']['scale'] has shape "
        f"{param_shape(params, 'q_norm', 'scale')} and params['k_norm']"
        f"['scale'] {param_shape(params, 'k_norm', 'scale')}: both shared "
        "[H] or both per head ([N, H] and [K, H]), as one aj.QKNorm's "
        "weight says.")
  biased = [name for name in norms if "bias" in params[name]]
  if len(biased) == 1:
    raise ValueError(
        f"params['{biased[0]}'] has a 'bias' and the other of q_norm/k_norm "
        "none: one aj.QKNorm(bias=True) adds a bias to both (give both, or "
        "neither).")
  return bool(norms)


def _output_gate(params, d: int, n: int, h: int) -> str | None:
  """``W_g``'s kind (None without one): ``[D, N, H]`` elementwise, ``[D,
  N, 1]`` headwise."""
  if "W_g" not in params:
    return None
  _layer(params, "W_g")
  g_kernel = param_shape(params, "W_g", "kernel")
  if len(g_kernel) != 3 or g_kernel[:2] != (d, n) or g_kernel[2] not in (h, 1):
    raise _wrong(params, "W_g", "kernel", f"[D, N, G] with D={d}, N={n} "
                 f"and G={h} (elementwise) or 1 (headwise)")
  if "bias" in params["W_g"] and param_shape(params, "W_g",
                                             "bias") != g_kernel[1:]:
    raise _wrong(params, "W_g", "bias", str(g_kernel[1:]))
  # H == 1 reads as elementwise: the same gate either way.
  return "elementwise" if g_kernel[2] == h else "headwise"


def _check_per_head(params, n: int) -> None:
  """``sinks`` ``[N]`` and a T5 ``table [R, N]``: float, one per query head."""
  if "sinks" in params:
    _layer(params, "sinks")
    if param_shape(params, "sinks", "logits") != (n,):
      raise _wrong(params, "sinks", "logits", f"({n},) = [N], one per query "
                   "head of W_q")
    checks.check_float_array("params['sinks']['logits']",
                             params["sinks"]["logits"])
  if "t5_bias" in params:
    _layer(params, "t5_bias")
    table = param_shape(params, "t5_bias", "table")
    if len(table) != 2 or table[1] != n:
      raise _wrong(params, "t5_bias", "table", f"[num_buckets, N] with "
                   f"N={n}, one column per query head of W_q")
    checks.check_float_array("params['t5_bias']['table']",
                             params["t5_bias"]["table"])


def param_dims(params: Mapping[str, Any], *, num_heads: int | None = None,
               num_kv_heads: int | None = None) -> HeadDims:
  """Validates a multi-head parameter dict and reads its sizes.

  Args:
    params: ``{"W_q", "W_k", "W_v", "W_o"}`` (and optionally ``"q_norm"``,
      ``"k_norm"``, ``"v_norm"``, ``"o_norm"``, ``"W_g"``, ``"sinks"``,
      ``"t5_bias"``) in the layout of ``init_multi_head_params``.
    num_heads: when given, must equal the ``N`` of ``W_q``.
    num_kv_heads: when given, must equal the ``K`` of ``W_k``/``W_v``.

  Returns:
    ``HeadDims(N, K, H, D, Dkv, Dout, normalize_qk, output_gate)``.

  Raises:
    ValueError: naming the parameter, its shape and the expected layout; a
      size the projections disagree on (``H`` in four kernels) names the
      one against the majority, with the size the others agree on, or
      every one holding it on a tie (``N`` in ``W_q`` and ``W_o`` alone).

  Example:
    >>> p = init_multi_head_params(jax.random.key(0), 8, 4, num_kv_heads=2)
    >>> param_dims(p)[:3]  # N, K, H
    (4, 2, 2)
  """
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a dict of W_q, W_k, W_v, W_o (see "
                    f"init_multi_head_params), got {type(params).__name__}.")
  unknown = set(params) - set(LAYOUT)
  if unknown:
    raise ValueError(f"params has unexpected entries {sorted(unknown)}; "
                     f"multi-head params are {list(LAYOUT)}.")
  n, k, h, d, dkv, dout = _projection_dims(params)
  normalize_qk = _check_norms(params, n, k, h)
  output_gate = _output_gate(params, d, n, h)
  _check_per_head(params, n)
  for arg, value, got, what, layer in (
      ("num_heads", num_heads, n, "heads", "W_q"),
      ("num_kv_heads", num_kv_heads, k, "key/value heads", "W_k")):
    if value is not None:
      checks.check_positive_int(arg, value)
      if value != got:
        raise ValueError(
            f"{arg}={value} but params['{layer}']['kernel'] has shape "
            f"{param_shape(params, layer, 'kernel')}: {got} {what}. The head "
            f"counts are read from the params; pass params built for {arg}="
            f"{value} or leave {arg} out.")
  return HeadDims(n, k, h, d, dkv, dout, normalize_qk, output_gate)
