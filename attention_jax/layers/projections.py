"""The projections of a multi-head layer: into heads, clipped, and back out.

Shape glossary: B batch, T length, N heads, K key/value heads, H head dim,
D input features, F output features, Dout output features.

``project`` is one dense map; ``project_heads`` vmaps it over a kernel's
heads axis (``[D, N, H]``: the per-head layout); ``output_projection`` sums
each head's output through its slice of ``W_o``; ``clip`` and
``project_keys_values`` are the key/value side of ``multi_head``'s
``project_inputs`` (and of ``project_memory``).
"""

from __future__ import annotations

from collections.abc import Mapping
import functools
from typing import Any

import jax
import jax.numpy as jnp

from attention_jax.layers import multi_head_params
from attention_jax.layers import qk_norm as qk_norm_lib
from attention_jax.layers import sharding

# jnp.einsum's precision: None, a jax.lax.Precision, or a pair of them.
Precision = Any
Params = multi_head_params.Params


def project(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, *,
            precision: Precision = None) -> jax.Array:
  """One dense projection ``x @ kernel + bias``: ``[B, T, D] @ [D, F] -> [B, T, F]``.

  Example:
    >>> project(jnp.ones((2, 5, 8)), jnp.ones((8, 4)), jnp.zeros(4)).shape
    (2, 5, 4)
  """
  y = jnp.einsum("BTD,DF->BTF", x, kernel, precision=precision)
  return y if bias is None else y + bias[None, None, :]


def project_heads(x: jax.Array, layer: Mapping[str, jax.Array], *,
                  precision: Precision = None) -> jax.Array:
  """Per-head projection, ``project`` vmapped over the kernel's heads axis.

  Args:
    x: ``[B, T, D]``.
    layer: ``{"kernel": [D, N, H], "bias": [N, H]}`` (bias optional).
    precision: ``jnp.einsum``'s precision for the projection.

  Returns:
    ``[B, N, T, H]``: head ``n`` is ``x @ kernel[:, n] + bias[n]``.

  Example:
    >>> layer = {"kernel": jnp.ones((8, 3, 4))}
    >>> project_heads(jnp.ones((2, 5, 8)), layer).shape
    (2, 3, 5, 4)
  """
  bias = layer.get("bias")
  per_head = functools.partial(project, precision=precision)
  return jax.vmap(per_head, in_axes=(None, 1, 0 if bias is not None else None),
                  out_axes=1)(x, layer["kernel"], bias)  # [B, N, T, H]


def output_projection(heads: jax.Array, layer: Mapping[str, jax.Array], *,
                      precision: Precision = None) -> jax.Array:
  """``W_o`` over per-head outputs: ``[B, N, T, H] x [N, H, Dout] -> [B, T, Dout]``.

  Each head's output meets its own ``[H, Dout]`` slice of the kernel and the
  heads are summed, which equals the lesson's concat (``[B, T, N*H]``)
  followed by one linear layer with the kernel flattened to ``[N*H, Dout]``.

  Args:
    heads: ``[B, N, T, H]``.
    layer: ``{"kernel": [N, H, Dout], "bias": [Dout]}`` (bias optional).
    precision: ``jnp.einsum``'s precision.

  Returns:
    ``[B, T, Dout]``.

  Example:
    >>> heads = jnp.ones((2, 3, 5, 4))                  # [B, N, T, H]
    >>> w_o = {"kernel": jnp.ones((3, 4, 6))}           # [N, H, Dout]
    >>> concat = jnp.swapaxes(heads, 1, 2).reshape(2, 5, 12)
    >>> bool(jnp.allclose(output_projection(heads, w_o),
    ...                   concat @ w_o["kernel"].reshape(12, 6)))
    True
  """
  kernel = layer["kernel"]
  out_sharding = None
  # Explicitly sharded heads (the arrays carry their mesh, also outside a
  # jax.set_mesh block): the sum over devices must name its sharding.
  if not (jax.typeof(heads).sharding.mesh.empty
          and jax.typeof(kernel).sharding.mesh.empty):
    out_sharding = sharding.head_sum_sharding(heads, kernel)
  y = jnp.einsum("BNTH,NHD->BTD", heads, kernel, precision=precision,
                 out_sharding=out_sharding)  # [B, T, Dout]
  bias = layer.get("bias")
  return y if bias is None else y + bias[None, None, :]


def clip(x: jax.Array, clip_qkv: float | None) -> jax.Array:
  """A projection clipped to ``[-clip_qkv, clip_qkv]`` (None: as it is)."""
  return x if clip_qkv is None else jnp.clip(x, -clip_qkv, clip_qkv)


def project_keys_values(params: Params, key: jax.Array, value: jax.Array, *,
                        precision: Precision, clip_qkv: float | None,
                        value_norm: qk_norm_lib.QKNorm | None):
  """``k``, ``v [B, K, S, H]``: ``W_k``, ``W_v``, clipped; the values
  normalised (the keys' qk-norm is the caller's: before or after rotary)."""
  k = clip(project_heads(key, params["W_k"], precision=precision), clip_qkv)
  v = clip(project_heads(value, params["W_v"], precision=precision),
           clip_qkv)
  if value_norm is not None:
    v = qk_norm_lib.normalize(v, params, "v_norm", value_norm)
  return k, v
