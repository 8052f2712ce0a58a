"""``dot_product_attention``: ``jax.nn.dot_product_attention``'s interface over
this library's kernels (flax's ``attention_fn`` is ``flax_fn``).

Shape glossary: B batch, T query length, S key/value length, N query heads,
K key/value heads (``K`` divides ``N``), H head dim.

``dot_product_attention`` takes exactly the arguments of
``jax.nn.dot_product_attention`` (jax 0.10) in its ``[B, T, N, H]`` layout
(or the unbatched ``[T, N, H]``), so switching is one import. Inside, it
swaps to this library's ``[B, N, T, H]`` layout and calls
``scaled_dot_product_attention``. Wherever jax.nn's answer is defined the
same way, the numbers (and gradients) match jax.nn's
``implementation='xla'`` within float32 rounding (tested). What stays
jax.nn's and what becomes this library's:

* Alignment stays jax.nn's, also when ``T != S``: ``is_causal`` lets query
  ``i`` see keys ``j <= i`` and ``local_window_size=(left, right)`` keys
  ``i - left <= j <= i + right`` (top-left aligned: query ``i`` stands at
  key position ``i``). The rest of the library aligns bottom-right
  (``j <= i + S - T``, the last query at the last key). The two agree when
  ``T == S``, and then the causal flag and window are handed on as they
  are. When ``T != S`` the mask gives positions instead (``q_offset=0,
  kv_offset=0``: query ``i`` and key ``i`` at position ``i``), so the band
  stays structure: no ``[T, S]`` mask is built, the blockwise kernels skip
  blocks outside it and cuDNN gets jax.nn's own flags where it can.
* A query that may see no key (a fully masked row, a key/value length of
  0, a window that misses every key, a row of ``-inf`` bias) gets output 0
  and zero gradients here. jax.nn fills blocked logits with a large finite
  negative, so its output there is the mean of the values (NaN for a row of
  ``-inf`` bias). Rows past ``query_seq_lengths`` are 0 in both. The
  residual (``return_residual=True``) of such rows is ``-inf`` here, a
  large finite negative in jax.nn.
* ``implementation``: ``None`` is this library's automatic choice (dense,
  blockwise or cuDNN by size and constraints; see
  ``scaled_dot_product_attention``), where jax.nn's ``None`` is always xla;
  ``'xla'`` runs the dense kernel (jax.nn's xla path also forms the
  ``[T, S]`` scores); ``'cudnn'`` the cuDNN kernel, which raises where it
  cannot give these numbers (e.g. with ``return_residual``).
* The checks are the library's, a little wider than jax.nn's: query, key
  and value dtypes promote instead of having to be equal, ``value`` may
  have its own head dim, ``mask`` may be an integer array (0 = blocked),
  and lengths may have any integer dtype. Concrete lengths must lie in
  ``[0, T]`` (queries) and ``[0, S]`` (keys/values).

Example:
  >>> q = jnp.ones((2, 5, 4, 8))   # [B, T, N, H]
  >>> kv = jnp.ones((2, 7, 2, 8))  # [B, S, K, H]: 2 key/value heads
  >>> dot_product_attention(q, kv, kv, is_causal=True).shape
  (2, 5, 4, 8)
  >>> ours = jnp.ones((2, 4, 5, 8))  # [B, N, T, H], this library's layout
  >>> dot_product_attention(jnp.swapaxes(ours, 1, 2), kv, kv).shape
  (2, 5, 4, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from attention_jax.attention import dot_product
from attention_jax.core import checks
from attention_jax.masking import intervals
from attention_jax.masking.mask import Mask

# jax.nn's implementation names -> scaled_dot_product_attention's.
IMPLEMENTATIONS = {None: None, "xla": "dense", "cudnn": "cudnn"}

# Each operand's batched and unbatched layouts.
_LAYOUTS = {"query": ("[B, T, N, H]", "[T, N, H]"),
            "key": ("[B, S, K, H]", "[S, K, H]"),
            "value": ("[B, S, K, Hv]", "[S, K, Hv]")}
_SWAP_HINT = ("jax.nn's layout, with heads on axis -2; jnp.swapaxes(x, 1, 2) "
              "converts from this library's [B, N, T, H]")


def _operand(name: str, x) -> jax.Array:
  """``x`` checked as a float 3-D or 4-D operand, returned as 4-D."""
  batched, unbatched = _LAYOUTS[name]
  x = checks.as_array_operand(name, x, batched)
  checks.check_float_array(name, x)
  if jnp.ndim(x) not in (3, 4):
    raise ValueError(
        f"{name} must have rank 4 ({batched}) or 3 ({unbatched}), got shape "
        f"{checks.shape_of(x)}: {_SWAP_HINT}.")
  x = jnp.asarray(x)
  return x[None] if x.ndim == 3 else x


def _pair_operand(name: str, x, target: tuple[int, ...]) -> jax.Array | None:
  """``bias``/``mask`` as 4-D ``[B|1, N|1, T|1, S|1]`` (leading 1s added)."""
  if x is None:
    return None
  x = jnp.asarray(checks.as_array_operand(name, x, "[B, N, T, S]"))
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank <= 4 (broadcastable to "
                     f"[B, N, T, S] = {target}), got shape {x.shape}.")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  checks.check_broadcastable_to(name, x.shape, target, "[B, N, T, S]")
  return x


def _lengths(name: str, lengths, batch: int,
             upper: int) -> jax.Array | None:
  """jax.nn's ``[B]`` lengths as ``[B, 1]`` (one per example, all heads),
  within ``[0, upper]`` (checked here: ``[:, None]`` stages a constant)."""
  if lengths is None:
    return None
  checks.check_range(name, checks.integer_array(name, lengths), upper)
  lengths = checks.check_lengths(name, lengths)
  if lengths.shape != (batch,):
    raise ValueError(
        f"{name} must have shape [B] = ({batch},) (one length per example, "
        f"as in jax.nn; B = 1 for [T, N, H] inputs), got {lengths.shape}.")
  return lengths[:, None]


def top_left(t: int, s: int, *, causal: bool = False, window=None,
             **fields) -> Mask:
  """A ``Mask`` with jax.nn's and flax's top-left causal/window band.

  Their band is top-left aligned (offset 0), the library's bottom-right
  (offset ``S - T``). They agree when ``T == S``, and then the mask gives no
  positions (every kernel takes it); otherwise it gives ``q_offset=0,
  kv_offset=0``, which aligns its band top-left and keeps it analytic.
  ``fields`` are the mask's other fields (lengths, ``dense``), which count
  rows and columns either way.
  """
  banded = causal or window is not None
  positions = dict(q_offset=0, kv_offset=0) if t != s and banded else {}
  return Mask(causal=causal, window=window, **fields, **positions)


def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """``jax.nn.dot_product_attention`` with this library's semantics.

  The same signature, layout and causal/window alignment as jax.nn; the
  options it shares with ``aj.scaled_dot_product_attention`` mean what they
  mean there (docs/options.md), and rows that see no key are 0 (the module
  docstring says what differs from jax.nn).

  Args:
    query: float ``[B, T, N, H]`` (or ``[T, N, H]``).
    key: float ``[B, S, K, H]`` (or ``[S, K, H]``); ``K`` dividing ``N`` is
      grouped-query attention (``K == 1``: multi-query).
    value: float ``[B, S, K, Hv]`` (jax.nn needs ``Hv == H``).
    bias: as sdpa's, of rank <= 4 and broadcastable to ``[B, N, T, S]``
      (leading axes added, as in jax.nn).
    mask: bool (or integer, 0 = blocked), rank <= 4 and broadcastable to
      ``[B, N, T, S]``; True = may attend.
    scale: as sdpa's; defaults to ``1 / sqrt(H)``.
    is_causal: query ``i`` sees keys ``j <= i`` (jax.nn's top-left
      alignment, also when ``T != S``).
    query_seq_lengths: integer ``[B]``: queries at positions ``>=`` the
      length get output 0.
    key_value_seq_lengths: integer ``[B]``: keys at positions ``>=`` the
      length are padding.
    local_window_size: ``w`` (meaning ``(w, w)``) or ``(left, right)``:
      query ``i`` sees keys ``i - left <= j <= i + right`` (top-left, as
      jax.nn). Combined with ``is_causal`` by AND.
    implementation: ``None`` (this library's automatic choice), ``'xla'``
      (the dense kernel) or ``'cudnn'`` (jax.nn's fused GPU kernel, with
      this library's semantics; raises where that is not possible).
    return_residual: also return the log-sum-exp of each row's logits,
      ``[B, T, N]`` (or ``[T, N]``) in key's dtype, without gradient.

  Returns:
    ``[B, T, N, Hv]`` (the query's shape when ``Hv == H``) in the promoted
    dtype of the inputs; with ``return_residual=True`` the pair
    ``(output, residual)``.

  Raises:
    TypeError: non-float query/key/value/bias, a float mask, non-integer
      lengths, a non-bool ``is_causal``.
    ValueError: ranks other than 3/4 (the message shows the expected
      layout), mismatched B/S/K/H, ``K`` not dividing ``N``, masks/biases
      that do not broadcast to ``[B, N, T, S]``, lengths not ``[B]`` or out
      of range, an unknown implementation.

  Example:
    >>> q = jnp.ones((2, 3, 4, 8))   # [B, T, N, H]
    >>> kv = jnp.ones((2, 5, 4, 8))  # [B, S, K, H]
    >>> out = dot_product_attention(q, kv, kv, is_causal=True)
    >>> out.shape  # query 0 sees key 0 only (top-left), as in jax.nn
    (2, 3, 4, 8)
  """
  if not isinstance(implementation, (str, type(None))) or (
      implementation not in IMPLEMENTATIONS):
    raise ValueError(f"implementation must be None, 'xla' or 'cudnn' (as "
                     f"in jax.nn), got {implementation!r}.")
  checks.check_static_bool("is_causal", is_causal)
  checks.check_static_bool("return_residual", return_residual)
  out_rank = jnp.ndim(checks.as_array_operand("query", query,
                                              _LAYOUTS["query"][0]))
  q, k, v = (_operand(name, x) for name, x in
             (("query", query), ("key", key), ("value", value)))
  (b, t, n, h), (bk, s, kh, hk) = q.shape, k.shape
  if hk != h or v.shape[:3] != k.shape[:3] or b != bk:
    raise ValueError(
        f"expected query [B, T, N, H] = {q.shape} with key [B, S, K, H] = "
        f"{k.shape} and value [B, S, K, Hv] = {v.shape} sharing B, S, K and "
        f"(query/key) H ({_SWAP_HINT}; unbatched [T, N, H] inputs are read "
        "as B = 1).")
  if n % kh:
    raise ValueError(
        f"the number of query heads N = {n} must be a multiple of the "
        f"key/value heads K = {kh} (query [B, T, N, H] = {q.shape}, key "
        f"[B, S, K, H] = {k.shape}; {_SWAP_HINT}).")
  target = (b, n, t, s)
  bias, mask = (_pair_operand(name, x, target)
                for name, x in (("bias", bias), ("mask", mask)))
  if mask is not None:
    checks.check_mask_dtype("mask", mask)
  q_lengths = _lengths("query_seq_lengths", query_seq_lengths, b, t)
  kv_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths, b,
                        s)
  window = intervals.check_window(local_window_size, "local_window_size")
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, N, H] <-> [B, N, T, H]
  result = dot_product.scaled_dot_product_attention(
      swap(q), swap(k), swap(v),
      top_left(t, s, causal=is_causal, window=window, q_lengths=q_lengths,
               kv_lengths=kv_lengths, dense=mask),
      bias=bias, scale=scale, implementation=IMPLEMENTATIONS[implementation],
      return_lse=return_residual)
  out, lse = result if return_residual else (result, None)
  out = swap(out)
  if out_rank == 3:
    out = out[0]
  if not return_residual:
    return out
  # [B, N, T] -> jax.nn's [B, T, N], in key's dtype and without gradient.
  residual = jax.lax.stop_gradient(swap(lse)).astype(k.dtype)
  return out, residual[0] if out_rank == 3 else residual
