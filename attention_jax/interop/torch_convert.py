"""Weights of ``torch.nn.MultiheadAttention`` to and from the params dict.

Shape glossary: N heads, H head dim, E torch's ``embed_dim`` (= D = N * H),
Dkv key/value features (torch's ``kdim``/``vdim``).

torch keeps one ``[out, in]`` matrix per projection (``in_proj_weight
[3E, E]``, rows q, k, v; or ``q_proj_weight``, ``k_proj_weight``,
``v_proj_weight`` when ``kdim``/``vdim`` differ from E) and splits its output
features into heads of H consecutive features, as the lesson does. The
params dict holds the same numbers transposed and split per head (``W_q``
kernel ``[D, N, H]``, ``W_o`` kernel ``[N, H, D]``, see
``init_multi_head_params``). Both scale queries by ``1/sqrt(H)``, so
``multi_head_attention`` on converted weights computes what the torch module
computes. torch is optional: nothing here imports it unless
``to_torch_multihead_attention`` is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from attention_jax.core import checks
from attention_jax.layers import multi_head
from attention_jax.layers import multi_head_params

_KNOWN = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
          "v_proj_weight", "out_proj.weight", "out_proj.bias", "bias_k",
          "bias_v")


def _numpy(x) -> np.ndarray:
  """A torch tensor (any device, bfloat16 included) or array as NumPy."""
  if hasattr(x, "detach"):  # a torch tensor, without importing torch
    x = x.detach().cpu()
    if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
      x = x.float()
    return x.numpy()
  return np.asarray(x)


def _shape_error(name: str, got, expected: str) -> ValueError:
  return ValueError(f"state_dict['{name}'] has shape {tuple(got)}, expected "
                    f"{expected}.")


def from_torch_multihead_attention(
    module_or_state_dict: Any,
    *,
    num_heads: int | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> multi_head.Params:
  """Converts ``torch.nn.MultiheadAttention`` weights to the params dict.

  Args:
    module_or_state_dict: a ``torch.nn.MultiheadAttention`` or its
      ``state_dict()`` (values torch tensors or NumPy arrays): keys
      ``in_proj_weight [3E, E]`` (or ``q_proj_weight [E, E]``,
      ``k_proj_weight [E, Dkv]``, ``v_proj_weight [E, Dkv]``), optional
      ``in_proj_bias [3E]``, ``out_proj.weight [E, E]``, optional
      ``out_proj.bias [E]``. ``kdim == vdim`` (possibly ``!= E``) is
      supported, as ``kv_features``.
    num_heads: ``N``; read from a module, required with a state_dict.
    dtype: dtype of the returned arrays.

  Returns:
    The params dict of ``multi_head_attention`` (``W_q``, ``W_k``, ``W_v``,
    ``W_o``; biases when torch has them), as ``jnp`` arrays.

  Raises:
    ValueError: missing ``num_heads``; ``add_bias_kv`` (``bias_k``/
      ``bias_v``) or ``add_zero_attn``, which have no counterpart here;
      ``kdim != vdim`` (keys and values share one width here); shapes that
      do not fit.

  Example:
    >>> E, N = 8, 2
    >>> sd = {"in_proj_weight": np.ones((3 * E, E), np.float32),
    ...       "out_proj.weight": np.ones((E, E), np.float32)}
    >>> p = from_torch_multihead_attention(sd, num_heads=N)
    >>> p["W_q"]["kernel"].shape, p["W_o"]["kernel"].shape   # [D, N, H], [N, H, D]
    ((8, 2, 4), (2, 4, 8))
  """
  state, num_heads = _state_and_heads(module_or_state_dict, num_heads)
  _check_entries(state)
  sd = {name: _numpy(x) for name, x in state.items()}
  e = _embed_dim(sd, num_heads)
  h = e // num_heads
  wq, wk, wv = _input_weights(sd, e)

  def as_jnp(x):
    return jnp.asarray(x, dtype)

  def heads_kernel(w):  # torch [N*H, in] -> [in, N, H]
    return as_jnp(w.T.reshape(w.shape[1], num_heads, h))

  params = {"W_q": {"kernel": heads_kernel(wq)},
            "W_k": {"kernel": heads_kernel(wk)},
            "W_v": {"kernel": heads_kernel(wv)},
            "W_o": {"kernel": as_jnp(sd["out_proj.weight"].T.reshape(
                num_heads, h, e))}}  # [N*H, E] -> [N, H, E]
  if "in_proj_bias" in sd:
    b = sd["in_proj_bias"]
    if b.shape != (3 * e,):
      raise _shape_error("in_proj_bias", b.shape, f"[3E] = {(3 * e,)}")
    for i, name in enumerate(("W_q", "W_k", "W_v")):
      params[name]["bias"] = as_jnp(b[i * e:(i + 1) * e].reshape(num_heads, h))
  if "out_proj.bias" in sd:
    if sd["out_proj.bias"].shape != (e,):
      raise _shape_error("out_proj.bias", sd["out_proj.bias"].shape,
                         f"[E] = {(e,)}")
    params["W_o"]["bias"] = as_jnp(sd["out_proj.bias"])
  return params


def _state_and_heads(state: Any,
                     num_heads: int | None) -> tuple[Mapping, int]:
  """The state_dict and N: a module carries N and flags we cannot model."""
  if hasattr(state, "state_dict") and callable(state.state_dict):
    module = state
    if getattr(module, "add_zero_attn", False):
      raise ValueError(
          "the torch module has add_zero_attn=True (a zero key/value appended "
          "to every sequence), which multi_head_attention does not model.")
    if num_heads is not None and num_heads != module.num_heads:
      raise ValueError(f"num_heads={num_heads} but the torch module has "
                       f"num_heads={module.num_heads}.")
    num_heads = module.num_heads
    state = module.state_dict()
  if not isinstance(state, Mapping):
    raise TypeError(f"expected a torch.nn.MultiheadAttention or its "
                    f"state_dict(), got {type(state).__name__}.")
  if num_heads is None:
    raise ValueError("num_heads is required with a state_dict (a module "
                     "carries it): from_torch_multihead_attention(sd, "
                     "num_heads=N).")
  checks.check_positive_int("num_heads", num_heads)
  return state, num_heads


def _check_entries(state: Mapping) -> None:
  """Refuses entries we would otherwise drop silently (bias_k, a prefix)."""
  if "bias_k" in state or "bias_v" in state:
    raise ValueError(
        "the state_dict has bias_k/bias_v (add_bias_kv=True: a learned key "
        "and value appended to every sequence), which multi_head_attention "
        "does not model; build the torch module without add_bias_kv.")
  unknown = sorted(set(state) - set(_KNOWN))
  if unknown:
    raise ValueError(
        f"unexpected state_dict entries {unknown}; a MultiheadAttention's "
        f"are {list(_KNOWN[:7])} (strip a parent module's prefix first).")


def _embed_dim(sd: Mapping[str, np.ndarray], num_heads: int) -> int:
  """E, from out_proj.weight: the one matrix torch always has."""
  if "out_proj.weight" not in sd:
    raise ValueError(f"the state_dict lacks out_proj.weight; got keys "
                     f"{sorted(sd)}.")
  e = sd["out_proj.weight"].shape[0]
  if sd["out_proj.weight"].shape != (e, e):
    raise _shape_error("out_proj.weight", sd["out_proj.weight"].shape,
                       "[E, E]")
  if e % num_heads:
    raise ValueError(f"embed_dim E={e} (out_proj.weight "
                     f"{sd['out_proj.weight'].shape}) is not divisible by "
                     f"num_heads={num_heads}.")
  return e


def _input_weights(sd: Mapping[str, np.ndarray],
                   e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """torch's q, k, v ``[E, in]``: fused in_proj_weight or three (kdim/vdim)."""
  separate = [n for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight")
              if n in sd]
  if "in_proj_weight" in sd:
    if separate:
      raise ValueError(f"the state_dict has both in_proj_weight and "
                       f"{separate}; torch has one or the other.")
    w = sd["in_proj_weight"]
    if w.shape != (3 * e, e):
      raise _shape_error("in_proj_weight", w.shape, f"[3E, E] = {(3 * e, e)}")
    return w[:e], w[e:2 * e], w[2 * e:]  # rows q, k, v
  if len(separate) != 3:
    raise ValueError(f"the state_dict needs in_proj_weight or all of "
                     f"q_proj_weight, k_proj_weight, v_proj_weight; got "
                     f"keys {sorted(sd)}.")
  wq, wk, wv = (sd[n] for n in separate)
  if wq.shape != (e, e):
    raise _shape_error("q_proj_weight", wq.shape, f"[E, E] = {(e, e)}")
  for name, w in (("k_proj_weight", wk), ("v_proj_weight", wv)):
    if w.ndim != 2 or w.shape[0] != e:
      raise _shape_error(name, w.shape, f"[E, kdim] with E = {e}")
  if wk.shape != wv.shape:
    raise ValueError(
        f"kdim={wk.shape[1]} != vdim={wv.shape[1]} (k_proj_weight "
        f"{wk.shape}, v_proj_weight {wv.shape}): multi_head_attention's "
        f"keys and values share one input width (kv_features), so it "
        f"cannot take keys and values of different widths.")
  return wq, wk, wv


def to_torch_multihead_attention(
    params: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """Converts the params dict to a ``torch.nn.MultiheadAttention`` state_dict.

  The result loads (``load_state_dict``) into
  ``torch.nn.MultiheadAttention(E, N, bias=..., batch_first=True)`` with
  ``E = D`` (plus ``kdim=vdim=Dkv`` when the params have ``kv_features !=
  D``: then the state_dict has separate ``q/k/v_proj_weight``). ``bias`` is
  one flag for all four projections in torch: with any bias in ``params`` it
  is True, and a projection without one gets zeros. Needs PyTorch (an
  optional dependency, imported here).

  Args:
    params: ``multi_head_attention``'s params dict.

  Returns:
    ``{name: torch.Tensor}`` (float32, or float64 for float64 params).

  Raises:
    ImportError: PyTorch is not installed.
    ValueError: what torch's module cannot express: grouped-query heads
      (``K < N``), ``N * H != D``, ``out_features != D``, qk-norm, an
      output gate, attention sinks, a T5 table.

  Example:
    >>> import attention_jax as aj
    >>> gqa = aj.init_multi_head_params(jax.random.key(0), 8, 2,
    ...                                 num_kv_heads=1)
    >>> to_torch_multihead_attention(gqa)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: torch.nn.MultiheadAttention cannot express grouped-query ...

    With torch installed::

      sd = aj.to_torch_multihead_attention(params)
      torch.nn.MultiheadAttention(E, N, batch_first=True).load_state_dict(sd)
  """
  n, k, h, d, dkv, dout, qk_norm, gate = multi_head_params.param_dims(params)
  cannot = []
  if k != n:
    cannot.append(f"grouped-query heads (K={k} key/value heads for N={n})")
  if n * h != d:
    cannot.append(f"N * H = {n} * {h} != D = {d} (torch's head dim is "
                  f"embed_dim // num_heads)")
  if dout != d:
    cannot.append(f"out_features={dout} != D={d}")
  if qk_norm:
    cannot.append("qk-norm (q_norm/k_norm)")
  if gate:
    cannot.append(f"an output gate (W_g, {gate})")
  for name, what in (("sinks", "attention sinks"),
                     ("t5_bias", "a T5 relative-position table"),
                     ("v_norm", "a value norm"),
                     ("o_norm", "an output sub-norm")):
    if name in params:  # a layer's own parameters: never dropped silently
      cannot.append(f"{what} (params[{name!r}])")
  if cannot:
    raise ValueError("torch.nn.MultiheadAttention cannot express "
                     + "; ".join(cannot) + ".")
  try:
    import torch  # an optional dependency: imported only here
  except ImportError as e:
    raise ImportError(
        "to_torch_multihead_attention needs PyTorch, which is optional for "
        "attention_jax (not in requirements.txt): pip install torch.") from e

  def tensor(x):  # a writable, contiguous float32 (or float64) copy
    x = np.asarray(x)
    return torch.from_numpy(np.array(
        x, np.float64 if x.dtype == np.float64 else np.float32, order="C"))

  def weight(name):  # [in, N, H] -> torch [N*H, in]
    kernel = np.asarray(params[name]["kernel"])
    return kernel.reshape(kernel.shape[0], n * h).T

  def bias(name, size):
    b = params[name].get("bias")
    return np.zeros(size, np.float32) if b is None else np.asarray(b).reshape(
        size)

  sd = {}
  if dkv == d:
    sd["in_proj_weight"] = tensor(np.concatenate(
        [weight("W_q"), weight("W_k"), weight("W_v")]))  # [3E, E]
  else:
    for name in ("q", "k", "v"):
      sd[f"{name}_proj_weight"] = tensor(weight(f"W_{name}"))
  has_bias = any("bias" in params[name] for name in ("W_q", "W_k", "W_v",
                                                      "W_o"))
  if has_bias:
    sd["in_proj_bias"] = tensor(np.concatenate(
        [bias(name, n * h) for name in ("W_q", "W_k", "W_v")]))  # [3E]
  sd["out_proj.weight"] = tensor(np.asarray(params["W_o"]["kernel"]).reshape(
      n * h, d).T)  # [E, E]
  if has_bias:
    sd["out_proj.bias"] = tensor(bias("W_o", d))
  return sd
