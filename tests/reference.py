"""Independent float64 NumPy references, written from the lesson's formulas.

Nothing here imports attention_jax: these are the yardsticks. Shapes follow
the package glossary (B, T, S, N, K, H, D). Fully masked query rows follow
the package's documented policy (weights 0, output 0), which the lesson's
``-1e9`` fill would instead turn into a uniform average.

``masked_attention`` is the one reference every kernel is held to (the
contract suite, ``benchmarks/gpu_check.py``): written with ``jax.numpy`` so
that its gradients come from autodiff of the plain formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def t5_bucket(relative_position, num_buckets: int, max_distance: int):
  """mesh-tensorflow's _relative_position_bucket, bidirectional, in NumPy."""
  half = num_buckets // 2
  bucket = (relative_position > 0) * half
  n = np.abs(relative_position)
  max_exact = half // 2
  with np.errstate(divide="ignore"):
    large = max_exact + (np.log(n / max_exact) / np.log(
        max_distance / max_exact) * (half - max_exact))
  large = np.minimum(np.where(n < max_exact, 0, large).astype(np.int64),
                     half - 1)
  return bucket + np.where(n < max_exact, n, large)


def masked_attention(q, k, v, bias, allowed, softcap=None, sinks=None,
                     slopes=None, t5_table=None, t5_max_distance=None,
                     rows=None, scale=None, positions=None, keep=None):
  """Attention over ``[B, N|K, T|S, H]`` with explicit head repetition;
  ``(out, lse)`` in the inputs' (float64) dtype.

  ``allowed [B, N, T, S]`` says where query t may see key s (written out by
  the caller from its case). Independent of the library: repeated K/V
  heads, ALiBi as a distance penalty, T5's bucketed table, a plain masked
  softmax whose denominator also holds ``exp(sink)``; ``lse = -inf`` and
  output 0 for rows that may see nothing (with a sink: output 0 and ``lse =
  sink``, except ``-inf`` for rows past the query length, ``rows`` False).
  ``positions``: ``(q_offset [B], kv_offset [B])``, where query row ``i``
  and key column ``j`` stand (``q_offset + i``, ``kv_offset + j``) for the
  distances ALiBi and T5 measure; None: ``i`` and ``j``. ``keep [B, N, T,
  S]``: dropout's kept weights already divided by ``1 - rate`` (0 where
  dropped): the weights meet the values through it, the lse is unchanged.
  """
  group = q.shape[1] // k.shape[1]
  k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
  if scale is None:
    scale = 1.0 / np.sqrt(q.shape[-1])
  logits = jnp.einsum("BNTH,BNSH->BNTS", q, k) * scale
  if bias is not None:
    logits = logits + jnp.where(allowed, bias, 0.0)
  i = np.arange(q.shape[2])[None, :, None]  # [1, T, 1]
  j = np.arange(k.shape[2])[None, None, :]  # [1, 1, S]
  if positions is not None:  # [B, T, 1], [B, 1, S]
    i = i + np.asarray(positions[0])[:, None, None]
    j = j + np.asarray(positions[1])[:, None, None]
  if slopes is not None:  # [N] times the distance i - j
    logits = logits - slopes[None, :, None, None] * (i - j)[:, None]
  if t5_table is not None:  # table[bucket(j - i), n] added per head
    buckets = t5_bucket(j - i, t5_table.shape[0], t5_max_distance)
    logits = logits + jnp.moveaxis(t5_table[buckets], -1, 1)  # [B|1, N, ..]
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  top = jnp.max(jnp.where(allowed, logits, -jnp.inf), -1, keepdims=True)
  if sinks is not None:
    top = jnp.maximum(top, sinks[None, :, None, None])
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  e = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits - top, 0.0)), 0.0)
  total = e.sum(-1, keepdims=True)
  if sinks is not None:
    total = total + jnp.exp(sinks[None, :, None, None] - top)
  seen = total > 0
  weights = e / jnp.where(seen, total, 1.0)
  if keep is not None:
    weights = weights * keep
  out = weights @ v
  lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  lse = lse[..., 0]
  if rows is not None:
    lse = jnp.where(rows, lse, -jnp.inf)
  return out, lse


def softmax(scores: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
  scores = np.asarray(scores, np.float64)
  if mask is None:
    mask = np.ones(scores.shape, bool)
  shape = np.broadcast_shapes(scores.shape, np.shape(mask))
  scores = np.broadcast_to(scores, shape)
  allowed = np.broadcast_to(np.asarray(mask) != 0, shape)
  safe = np.where(allowed, scores, -np.inf)
  row_max = safe.max(-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.where(allowed, np.exp(np.where(allowed, safe - row_max, 0.0)), 0.0)
  total = e.sum(-1, keepdims=True)
  return e / np.where(total > 0, total, 1.0)


def causal(t: int, s: int) -> np.ndarray:
  return np.tril(np.ones((t, s), bool), k=s - t)


def sdpa(q, k, v, mask=None, bias=None, scale=None, is_causal=False):
  """The lesson's scaled_dot_product_attention in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  if scale is None:
    scale = 1.0 / np.sqrt(q.shape[-1])
  scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale  # [..., T, S]
  if bias is not None:
    scores = scores + np.asarray(bias, np.float64)
  if is_causal:
    c = causal(q.shape[-2], k.shape[-2])
    mask = c if mask is None else (np.asarray(mask) != 0) & c
  weights = softmax(scores, mask)
  return np.matmul(weights, v), weights


def linear(x, layer):
  y = np.asarray(x, np.float64) @ np.asarray(layer["kernel"], np.float64)
  if "bias" in layer:
    y = y + np.asarray(layer["bias"], np.float64)
  return y


def rms_norm(x, scale, eps=1e-6):
  """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * scale."""
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(
      scale, np.float64)


def qk_norm(x, heads, scale, *, kind="rms", over="head", eps=1e-6,
            offset=0.0):
  """qk-norm in float64 on projected features ``x [B, L, heads * H]``.

  Written from the models' formulas on the flat projection (OLMo 2 norms
  ``q_proj``'s output as it is; the per-head norms split the heads first):
  ``over="all"`` normalises the ``heads * H`` features of a token together,
  ``"head"`` each ``H``; ``kind="layer"`` centres first; ``scale`` is
  ``[H]`` (every head), ``[heads, H]`` or None; it multiplies as
  ``offset + scale``. Returns ``[B, heads, L, H]``.
  """
  x = np.asarray(x, np.float64)
  b, length, width = x.shape
  h = width // heads
  if over == "head":
    x = x.reshape(b, length, heads, h)
  if kind == "layer":
    x = x - x.mean(-1, keepdims=True)
  x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  x = x.reshape(b, length, heads, h)
  if scale is not None:
    x = x * (offset + np.asarray(scale, np.float64))  # [H] or [heads, H]
  return x.transpose(0, 2, 1, 3)


def rope(x, positions, base):
  """Rotary embedding (Su et al. 2021) in float64, half-split pairs.

  Pair ``(x[i], x[i + H/2])`` of the token at position ``p`` is rotated by
  the angle ``p * base**(-2 i / H)``; ``positions`` broadcast against
  ``x.shape[:-1]``.
  """
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  freq = base ** (-2.0 * np.arange(half) / (2 * half))  # [H/2]
  theta = np.asarray(positions, np.float64)[..., None] * freq
  cos, sin = np.cos(theta), np.sin(theta)
  x1, x2 = x[..., :half], x[..., half:2 * half]
  return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos,
                         x[..., 2 * half:]], -1)


def multi_head_attention(params, query, key, value, mask=None, *,
                         num_heads=None, num_kv_heads=None, is_causal=False,
                         scale=None, rope_base=None, query_positions=None,
                         key_positions=None, qk_norm_args=None):
  """The lesson's MultiHeadAttention.forward (view/transpose/concat), + GQA.

  ``params`` hold per-head kernels (``W_q`` ``[D, N, H]``, ``W_k``/``W_v``
  ``[Dkv, K, H]``, ``W_o`` ``[N, H, Dout]``); here they are flattened back to
  the lesson's ``[in, out]`` matrices and the heads split from the projected
  features as the lesson does. ``H`` need not be ``D / N``; keys/values may
  have their own width; ``q_norm``/``k_norm`` RMS-normalise each head; with
  ``rope_base`` queries and keys are then rotated at ``query_positions``
  ``[T]`` and ``key_positions`` ``[S]`` (given explicitly by the caller;
  ``[B, 1, T]`` for per-example positions); with ``W_g`` (``[D, N, G]``)
  each head's output is multiplied by ``sigmoid(query W_g + b)``.
  ``qk_norm_args``: ``qk_norm``'s keywords (and ``after_rope``) for a
  qk-norm other than the default, with or without ``q_norm`` weights.
  """
  _, n, h = np.shape(params["W_q"]["kernel"])
  kv_heads = np.shape(params["W_k"]["kernel"])[1]
  if num_heads not in (None, n) or num_kv_heads not in (None, kv_heads):
    raise ValueError("head counts disagree with the params")
  b, t, _ = np.shape(query)
  s = np.shape(key)[1]

  def flat(layer):  # [in, heads, H] -> [in, heads*H], as a Linear's
    kernel = np.asarray(layer["kernel"])
    out = {"kernel": kernel.reshape(kernel.shape[0], -1)}
    if "bias" in layer:
      out["bias"] = np.asarray(layer["bias"]).reshape(-1)
    return out

  def split(x, heads, length):  # [B, L, heads*H] -> [B, heads, L, H]
    return x.reshape(b, length, heads, h).transpose(0, 2, 1, 3)

  q_flat = linear(query, flat(params["W_q"]))  # [B, T, N*H]
  k_flat = linear(key, flat(params["W_k"]))  # [B, S, K*H]
  q = split(q_flat, n, t)
  k = split(k_flat, kv_heads, s)
  v = split(linear(value, flat(params["W_v"])), kv_heads, s)
  norm = dict(qk_norm_args or {})
  after_rope = norm.pop("after_rope", False)
  if "q_norm" in params and not norm:
    q = rms_norm(q, params["q_norm"]["scale"])
    k = rms_norm(k, params["k_norm"]["scale"])
  elif norm and not after_rope:
    q = qk_norm(q_flat, n, params.get("q_norm", {}).get("scale"), **norm)
    k = qk_norm(k_flat, kv_heads, params.get("k_norm", {}).get("scale"),
                **norm)
  if rope_base is not None:
    q = rope(q, query_positions, rope_base)
    k = rope(k, key_positions, rope_base)
  if norm and after_rope:  # on the rotated heads, flattened back per token
    def unsplit(x):
      return x.transpose(0, 2, 1, 3).reshape(b, x.shape[2], -1)
    q = qk_norm(unsplit(q), n, params.get("q_norm", {}).get("scale"), **norm)
    k = qk_norm(unsplit(k), kv_heads, params.get("k_norm", {}).get("scale"),
                **norm)
  group = n // kv_heads
  k = np.repeat(k, group, axis=1)  # explicit head repetition for GQA
  v = np.repeat(v, group, axis=1)
  out, weights = sdpa(q, k, v, mask, scale=scale, is_causal=is_causal)
  if "W_g" in params:  # output gate: sigmoid(query W_g), per head [.., G]
    g = np.shape(params["W_g"]["kernel"])[-1]
    logit = linear(query, flat(params["W_g"])).reshape(b, t, n, g)
    out = out * (1.0 / (1.0 + np.exp(-logit))).transpose(0, 2, 1, 3)
  out = out.transpose(0, 2, 1, 3).reshape(b, t, n * h)  # concat heads
  w_o = {"kernel": np.reshape(params["W_o"]["kernel"], (n * h, -1))}
  if "bias" in params["W_o"]:
    w_o["bias"] = params["W_o"]["bias"]
  return linear(out, w_o), weights


def _context(scores, values, mask):
  if mask is not None and np.ndim(mask) == 2:
    mask = np.asarray(mask)[:, None, :]
  weights = softmax(scores, mask)
  return weights @ np.asarray(values, np.float64), weights


def additive(params, query, keys, values=None, mask=None):
  """Bahdanau: e_tj = v . tanh(q_t W_q + k_j W_k + b), query [B, T, Dq]."""
  values = keys if values is None else values
  p = {n: np.asarray(x, np.float64) for n, x in params.items()}
  q = np.asarray(query, np.float64) @ p["W_q"]  # [B, T, A]
  k = np.asarray(keys, np.float64) @ p["W_k"]  # [B, S, A]
  hidden = q[:, :, None, :] + k[:, None, :, :] + p.get("b", 0.0)
  return _context(np.tanh(hidden) @ p["v"], values, mask)


def luong(query, keys, values=None, mask=None, *, score="dot", params=None,
          scale=None):
  """Luong dot/general/concat, query [B, T, Dq]."""
  values = keys if values is None else values
  p = {n: np.asarray(x, np.float64) for n, x in (params or {}).items()}
  q = np.asarray(query, np.float64)
  k = np.asarray(keys, np.float64)
  if score == "dot":
    scores = q @ np.swapaxes(k, -1, -2)
  elif score == "general":
    scores = q @ p["W"] @ np.swapaxes(k, -1, -2)
  else:  # concat: v . tanh([q; k] W), built by literal concatenation
    t, s = q.shape[1], k.shape[1]
    pairs = np.concatenate(
        [np.broadcast_to(q[:, :, None, :], q.shape[:2] + (s, q.shape[2])),
         np.broadcast_to(k[:, None, :, :], (k.shape[0], t) + k.shape[1:])],
        axis=-1)  # [B, T, S, Dq + Dk]
    scores = np.tanh(pairs @ p["W"]) @ p["v"]
  if scale is not None:
    scores = scores * scale
  if "scale" in p:
    scores = scores * p["scale"]
  return _context(scores, values, mask)


def _fmix32(x):
  """MurmurHash3's 32-bit finaliser on uint64 arrays holding uint32s."""
  m = np.uint64(0xFFFFFFFF)
  x = x ^ (x >> np.uint64(16))
  x = (x * np.uint64(0x85EBCA6B)) & m
  x = x ^ (x >> np.uint64(13))
  x = (x * np.uint64(0xC2B2AE35)) & m
  return x ^ (x >> np.uint64(16))


def dropout_keep(seed, b, h, q_idx, kv_idx, rate):
  """The library's counter-based dropout draw, rewritten in NumPy from its
  description (attention_jax/core/dropout.py's docstring): True where
  entry ``(b, h, q_idx, kv_idx)`` is kept. ``seed``: two uint32 words."""
  m = np.uint64(0xFFFFFFFF)
  u = lambda x: np.asarray(x).astype(np.int64).astype(np.uint64) & m  # noqa: E731
  s0, s1 = (np.uint64(int(w)) for w in np.asarray(seed))
  x = _fmix32(s0 ^ ((u(b) * np.uint64(0x9E3779B1)) & m))
  x = _fmix32(x ^ s1 ^ ((u(h) * np.uint64(0x7FEB352D)) & m))
  x = _fmix32(x ^ ((u(q_idx) * np.uint64(0x846CA68B)) & m))
  bits = _fmix32(x ^ ((u(kv_idx) * np.uint64(0x9E3779B9)) & m))
  return (bits >> np.uint64(8)).astype(np.int64) >= int(
      np.floor(np.float32(rate) * np.float32(1 << 24)))
