"""The parameter holders of the attention modules, and fitting params to them.

Shape glossary: N heads, H head dim, D model dim, Dout output features.

A module (``MultiHeadAttention``, ``MultiHeadLatentAttention``) keeps its
parameters as ``nnx.Param``s in holders named as its params dict's
entries: ``Projection`` (``kernel [*in, *out]``, optional ``bias``),
``NormScale`` (a norm's ``scale``, optional ``bias``) and ``Lone`` (one
parameter, ``sinks`` or a T5 ``table``). ``check_fit`` compares a params
dict with them (the same entries and shapes, else a message naming the
first that differs and the option it comes from) and ``assign_params``
loads it: the modules' ``load_params``.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from attention_jax.core import checks


def _reshaped(value, shape: tuple[int, ...]):
  """An initialiser's result reshaped, keeping sharding metadata if any."""
  if isinstance(value, nnx.VariableMetadata):  # from nnx.with_partitioning
    value.raw_value = jnp.reshape(value.raw_value, shape)
    return value
  return jnp.reshape(value, shape)


class Projection(nnx.Module):
  """One projection's parameters: ``kernel [*in, *out]``, ``bias [*out]``.

  Only parameters: ``aj.multi_head_attention`` does the maths. Created as
  flax's ``nnx.LinearGeneral`` creates them: the initialisers see the flat
  2-D shape ``[prod(in), prod(out)]`` (so fan-in is ``prod(in)``) and the
  result is reshaped, kernel first, then bias, each from ``rngs.params()``;
  the same seed gives the same numbers as a Linear layer of the flat shape.
  ``kernel_init``/``bias_init`` may carry sharding (``nnx.with_partitioning``)
  for the final shape.
  """

  def __init__(self, in_features: tuple[int, ...],
               out_features: tuple[int, ...], *, use_bias: bool,
               param_dtype, kernel_init, bias_init, rngs: nnx.Rngs):
    flat = (math.prod(in_features), math.prod(out_features))
    self.kernel = nnx.Param(_reshaped(
        kernel_init(rngs.params(), flat, param_dtype),
        (*in_features, *out_features)))
    self.bias = nnx.data(None)
    if use_bias:
      self.bias = nnx.Param(_reshaped(
          bias_init(rngs.params(), flat[1:], param_dtype), out_features))

  def as_dict(self, dtype=None) -> dict[str, jax.Array]:
    """``{"kernel", "bias"}`` arrays, cast to ``dtype`` if given."""
    out = {"kernel": self.kernel[...]}
    if self.bias is not None:
      out["bias"] = self.bias[...]
    if dtype is not None:
      out = {k: v.astype(dtype) for k, v in out.items()}
    return out


class Lone:
  """A lone ``nnx.Param`` of the module (``sinks``, ``t5_table``) seen as a
  holder of one entry, as ``assign_params`` and ``params_dict`` see layers."""

  def __init__(self, entry: str, variable: nnx.Param):
    self.entry = entry
    setattr(self, entry, variable)

  def as_dict(self, dtype=None) -> dict[str, jax.Array]:
    """``{entry: value}`` in the parameter's own dtype: sinks and the T5
    table join the float32 logits, never the projections' ``dtype``."""
    del dtype
    return {self.entry: getattr(self, self.entry)[...]}


class NormScale(nnx.Module):
  """The learned ``scale`` of a norm (qk-norm ``[H]`` or ``[N, H]``), the
  identity to start (ones; zeros for a ``1 + w`` norm), and with ``bias``
  a learned ``bias`` of its shape (zeros).

  Only the parameters: ``aj.multi_head_attention`` normalises.
  """

  def __init__(self, head_dim: int, *, param_dtype, heads: int | None = None,
               zeros: bool = False, bias: bool = False):
    shape = (head_dim,) if heads is None else (heads, head_dim)
    fill = jnp.zeros if zeros else jnp.ones
    self.scale = nnx.Param(fill(shape, param_dtype))  # [H] or [N, H]
    self.bias = nnx.Param(jnp.zeros(shape, param_dtype)) if bias else (
        nnx.data(None))

  def as_dict(self, dtype=None) -> dict[str, jax.Array]:
    """``{"scale"}`` (and ``"bias"``), cast to ``dtype`` if given."""
    out = {"scale": self.scale[...]}
    if self.bias is not None:
      out["bias"] = self.bias[...]
    return out if dtype is None else {k: v.astype(dtype)
                                      for k, v in out.items()}


def _entries_message(name: str, given: set[str], have: dict[str, Any],
                     layout: str) -> str:
  """Why ``params[name]``'s entries do not fit the module's: a bias one
  has and the other lacks is said with its fix."""
  if given ^ set(have) == {"bias"} and "scale" in have:  # a norm's bias
    biased = "bias" in have
    return (f"params['{name}'] has {'no' if biased else 'a'} 'bias', but "
            f"this module's {name} has {'one' if biased else 'none'} (its "
            f"aj.QKNorm has bias={biased}): build the module with a QKNorm "
            f"of bias={not biased}, or give params "
            f"{'with' if biased else 'without'} params['{name}']['bias'].")
  if given ^ set(have) == {"bias"}:
    if "bias" in have:
      # A missing bias is a zero one (Whisper's k_proj and Qwen2's o_proj
      # have none): the function runs such params as they are.
      shape = tuple(have["bias"].shape)
      return (f"params['{name}'] has no 'bias', but this module's {name} has "
              f"one (use_bias=True): a projection without a bias is one with "
              f"a zero bias, so add params['{name}']['bias'] = zeros {shape} "
              f"(as the checkpoint loaders do), or build the module with "
              f"use_bias=False if no projection has a bias.")
    return (f"params['{name}'] has a 'bias', but this module's {name} has "
            f"none (use_bias=False): build it with use_bias=True, with zero "
            f"biases for the projections the params give none.")
  return (f"params['{name}'] has {sorted(given)}, but this module's {name} "
          f"has {sorted(have)} ({layout}).")


def check_fit(layers: Mapping[str, Projection | NormScale | Lone],
              params: Mapping[str, Mapping[str, Any]],
              layout: Mapping[str, str], *, entries: str,
              sizes: str) -> None:
  """The same entries and shapes as the module's, or a ValueError naming
  the first one that differs, its shape, the module's and the options it
  comes from (``entries``, ``sizes``): compared with the module first, so
  that the wrong one is named rather than one the others disagree with."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a dict of {sorted(layers)}, got "
                    f"{type(params).__name__}.")
  if set(params) != set(layers):
    raise ValueError(f"params has entries {sorted(params)}, but this module "
                     f"has {sorted(layers)} ({entries}).")
  for name, layer in layers.items():
    have = {entry: getattr(layer, entry)
            for entry in ("kernel", "bias", "scale", "logits", "table")
            if getattr(layer, entry, None) is not None}
    if not isinstance(params[name], Mapping):
      raise ValueError(f"params['{name}'] must be a dict with "
                       f"{layout[name]}, got {type(params[name]).__name__}.")
    if set(params[name]) != set(have):
      raise ValueError(_entries_message(name, set(params[name]), have,
                                        layout[name]))
    for entry, variable in have.items():
      got, want = checks.shape_of(params[name][entry]), variable.shape
      if got != tuple(want):
        raise ValueError(
            f"params['{name}']['{entry}'] has shape {got}, but this "
            f"module's is {tuple(want)} ({layout[name]}; {sizes}).")


def assign_params(layers: Mapping[str, Projection | NormScale | Lone],
                  params: Mapping[str, Mapping[str, Any]],
                  layout: Mapping[str, str], *, entries: str,
                  sizes: str) -> None:
  """Assigns ``params`` to a module's parameter holders, after every check.

  The same entries (``layers``' names, each's kernel/bias/scale/logits/
  table) and shapes as the module's (``check_fit``); values are cast to
  each variable's dtype. Shared by the modules' ``load_params``.
  """
  check_fit(layers, params, layout, entries=entries, sizes=sizes)
  for name, layer in layers.items():
    for entry, value in params[name].items():
      variable = getattr(layer, entry)
      variable[...] = jnp.asarray(value, variable.dtype)
