"""A paged key/value cache: one pool of pages shared by every sequence.

Shape glossary: B sequences (the batch's rows), K key/value heads, Z tokens
per page (``page_size``), P pages in the pool, M pages a sequence may hold
(``max_pages``), T new tokens in this call, H (Hv) key (value) head dim.

A linear cache gives every sequence ``[K, L, H]`` for the longest one; a
paged cache gives each sequence the pages it fills. ``PagedKVCache`` holds
the pool (``key_pages [P, K, Z, H]``, ``value_pages [P, K, Z, Hv]``), a page
table per sequence (``page_table [B, M]``: position ``p`` of sequence ``b``
lives in page ``page_table[b, p // Z]``, slot ``p % Z``; ``P`` where no page
is held), each sequence's length, each page's reference count (how many
sequences hold it; ``0`` is free) and a sticky per-sequence overflow flag.
A cache made with ``values_in_keys`` stores one pool: the values are the
keys themselves (MLA's latent cache, where each token's key is ``[c_kv,
k_pe]`` and its value ``c_kv``, the key's first columns; attention then
returns the weighted keys, whose first columns are the weighted values).

Everything here is a pure function of arrays, usable inside ``jit`` with
traced lengths and counts:

- ``append`` writes each sequence's new tokens after its length, taking the
  pages it starts from the free ones (the reference counts are the free
  list: a free page is one nobody holds) and copying a page that another
  sequence also holds before writing into it (copy on write).
- ``release`` gives a finished sequence's pages back; a page returns to the
  pool when its last holder lets go.
- ``share_prefix`` gives an empty sequence the pages of another's first
  tokens (a common prompt written once).
- ``take_rows`` / ``put_rows``: the cache as a few of its sequences see it
  (the same pool), for a call that computes only those, and back.

Each of them (and ``paged_attention``) first checks the cache's fields
against each other (``check_cache``: shapes and dtypes, a hand-built cache
included); a row, length or prefix argument known while tracing is checked
then, a traced one under ``aj.checked``. ``storage_dtype`` is the one check
of a cache's ``dtype=`` (float, or quantised ``int8`` / ``float8_e4m3fn``)
that every ``init_*cache`` makes.

Pages are handed out in batch order. A sequence whose new pages do not all
fit in the free ones, or that would pass ``M`` pages, writes nothing, keeps
its length, and raises its ``overflow`` flag (a value: no host callback in
a decoding step); ``check_overflow`` raises a ``ValueError`` naming the
sequences when the flags are concrete.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.core import traced_checks
from attention_jax.decoding import kv_cache
from attention_jax.decoding import quantize


class PagedKVCache(NamedTuple):
  """The pool, the page tables and the bookkeeping (a pytree of arrays).

  Attributes:
    key_pages: ``[P, K, Z, H]`` keys, page by page.
    value_pages: ``[P, K, Z, Hv]`` values; None when the values are the
      keys (``values_in_keys``).
    page_table: int32 ``[B, M]``: sequence ``b``'s ``j``-th page, ``P``
      where it holds none.
    lengths: int32 ``[B]``: tokens each sequence holds.
    refcount: int32 ``[P]``: sequences holding each page; ``0`` is free.
    overflow: bool ``[B]``: a write of this sequence found no room and was
      dropped (sticky until ``release``).
    key_scales: float32 ``[P, K, Z]``, one per token and key/value head,
      when the pages are quantised (int8 or float8_e4m3fn:
      ``quantize.quantize``; attention dequantises each page as it loads
      it), else None.
    value_scales: the values' scales ``[P, K, Z]``, or None.
    nonfinite: bool ``[P]``: a NaN or inf was written to the page since it
      last left the free list. Attention skips its search for such values
      in every loaded block while no held page has one (the check would
      cost a decoding step as much as the attention itself on a CPU).
      None: unknown, every block is searched.
  """
  key_pages: jax.Array
  value_pages: jax.Array | None
  page_table: jax.Array
  lengths: jax.Array
  refcount: jax.Array
  overflow: jax.Array
  key_scales: jax.Array | None = None
  value_scales: jax.Array | None = None
  nonfinite: jax.Array | None = None

  @property
  def quantized(self) -> str | None:
    """The storage format (``"int8"``, ``"float8_e4m3fn"``) or None."""
    if self.key_scales is None:
      return None
    return jnp.dtype(self.key_pages.dtype).name

  @property
  def num_pages(self) -> int:
    return self.key_pages.shape[0]

  @property
  def page_size(self) -> int:
    return self.key_pages.shape[2]

  @property
  def max_pages(self) -> int:
    return self.page_table.shape[1]


def init_paged_cache(num_pages: int, page_size: int, num_kv_heads: int,
                     head_dim: int, batch_size: int, max_pages: int, *,
                     value_head_dim: int | None = None,
                     dtype=jnp.float32,
                     values_in_keys: bool = False) -> PagedKVCache:
  """An empty cache: every page free, every sequence empty.

  Args:
    num_pages: ``P``, the pool's pages (shared by every sequence).
    page_size: ``Z``, tokens per page.
    num_kv_heads: ``K``.
    head_dim: ``H`` of the keys.
    batch_size: ``B``, sequences (rows) served at once.
    max_pages: ``M``, pages one sequence may hold (its longest length is
      ``M * Z``).
    value_head_dim: ``Hv`` of the values; default ``head_dim``.
    values_in_keys: store no values: they are the keys (``value_pages``
      None; ``append`` takes ``value=None``; ``paged_attention`` uses the
      key pages as values, so its output has ``H`` columns). MLA's latent
      cache (``aj.latent_decode``) keeps ``[c_kv, k_pe]`` so, once.
    dtype: of the pages: a float dtype, or ``"int8"`` /
      ``"float8_e4m3fn"`` for quantised pages with a float32 scale per
      token and key/value head (``quantize``; about half the bytes of
      bfloat16 at ``H = 64``).

  Example:
    >>> c = init_paged_cache(8, 4, 2, 16, batch_size=3, max_pages=5)
    >>> c.key_pages.shape, c.page_table.shape
    ((8, 2, 4, 16), (3, 5))
  """
  for name, v in (("num_pages", num_pages), ("page_size", page_size),
                  ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                  ("batch_size", batch_size), ("max_pages", max_pages)):
    checks.check_positive_int(name, v)
  checks.check_static_bool("values_in_keys", values_in_keys)
  if values_in_keys and value_head_dim is not None:
    raise ValueError(f"value_head_dim={value_head_dim} is given, but with "
                     "values_in_keys the values are the keys: leave it out.")
  hv = head_dim if value_head_dim is None else value_head_dim
  checks.check_positive_int("value_head_dim", hv)
  dtype, quantized = storage_dtype(dtype)
  scales = None if quantized is None else jnp.zeros(
      (num_pages, num_kv_heads, page_size), jnp.float32)
  return PagedKVCache(
      key_pages=jnp.zeros((num_pages, num_kv_heads, page_size, head_dim),
                          dtype),
      value_pages=None if values_in_keys else jnp.zeros(
          (num_pages, num_kv_heads, page_size, hv), dtype),
      page_table=jnp.full((batch_size, max_pages), num_pages, jnp.int32),
      lengths=jnp.zeros((batch_size,), jnp.int32),
      refcount=jnp.zeros((num_pages,), jnp.int32),
      overflow=jnp.zeros((batch_size,), bool),
      key_scales=scales, value_scales=None if values_in_keys else scales,
      nonfinite=jnp.zeros((num_pages,), bool))


def storage_dtype(dtype) -> tuple[jnp.dtype, str | None]:
  """A cache's ``dtype=`` as ``(the dtype it is stored in, the quantised
  format or None)``: the one check of every ``init_*cache``'s dtype.

  A float dtype is stored as it is; ``"int8"`` / ``"float8_e4m3fn"`` (or
  those dtypes themselves) mean quantised storage with a scale per token
  (``quantize``). Anything else (``"int4"``, ``jnp.int32``, a misspelt
  name) raises a ``TypeError`` now, not at the first decoding step.

  Example:
    >>> storage_dtype("int8"), storage_dtype(jnp.bfloat16)
    ((dtype('int8'), 'int8'), (dtype(bfloat16), None))
  """
  try:
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    floating = name not in quantize.FORMATS and jnp.issubdtype(
        jnp.dtype(dtype), jnp.floating)
  except TypeError:  # not a dtype at all
    name, floating = None, False
  if name in quantize.FORMATS:
    return jnp.dtype(quantize.FORMATS[name][0]), name
  if not floating:
    raise TypeError(f"dtype must be a float dtype or one of "
                    f"{sorted(quantize.FORMATS)}, got {dtype!r}.")
  return jnp.dtype(dtype), None


def linear_pages(dtype, batch_size: int, length: int, *,
                 window: int | None = None,
                 left_padding=None) -> dict[str, int]:
  """``init_paged_cache``'s sizes for a quantised linear cache of ``length``
  tokens kept in pages (a module's ``init_cache(dtype="int8")``): pages of
  ``Z = min(L, 128)`` tokens, each of the ``B`` rows room for ``L`` (the
  bytes of a linear cache).

  Raises:
    ValueError: a ring buffer (``window``) or ``left_padding``: pages hold
      each row's tokens from its first.

  Example:
    >>> linear_pages("int8", 2, 300)
    {'num_pages': 6, 'page_size': 128, 'max_pages': 3}
  """
  given = [name for name, x in (("a ring buffer (window)", window),
                                ("left_padding", left_padding))
           if x is not None]
  if given:
    raise ValueError(
        f"a quantised cache (dtype={dtype!r}) is kept in pages, which hold "
        f"each row's tokens from its first: {' and '.join(given)} is not "
        "supported with it; give max_length and right-pad prompts "
        "(mask=aj.Mask(q_lengths=...)).")
  z = min(length, 128)
  m = -(-length // z)
  return dict(num_pages=batch_size * m, page_size=z, max_pages=m)


def bytes_per_slot(cache: PagedKVCache) -> int:
  """Bytes of the pool (pages and scales, keys and values) per slot: its
  bytes over ``P * Z``.

  Example:
    >>> bytes_per_slot(init_paged_cache(8, 4, 2, 16, 1, 2))  # 2 * 2 * 16 * 4
    256
  """
  arrays = (cache.key_pages, cache.value_pages, cache.key_scales,
            cache.value_scales)
  total = sum(x.size * jnp.dtype(x.dtype).itemsize for x in arrays
              if x is not None)
  return int(total) // (cache.num_pages * cache.page_size)


def all_finite(cache: PagedKVCache) -> jax.Array | None:
  """bool scalar: no page a sequence holds was written a NaN or inf (slots
  below each sequence's length are finite); None when the cache does not
  track it (``nonfinite`` None)."""
  if cache.nonfinite is None:
    return None
  return ~jnp.any(cache.nonfinite & (cache.refcount > 0))


def check_cache(cache) -> None:
  """Raises unless ``cache`` is a ``PagedKVCache`` whose arrays agree.

  Every entry (``append``, ``release``, ``share_prefix``, ``take_rows``,
  ``put_rows``, ``paged_attention``, a layer's decoding step) checks the
  cache's shapes and dtypes here, so a hand-built or edited one is refused
  by field, before any arithmetic reads it: the pool ``key_pages [P, K, Z,
  H]`` and ``page_table [B, M]`` give the sizes the others must have.
  Values are not read (that would cost a step a host sync).
  """
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be an aj PagedKVCache (from "
                    f"init_paged_cache), got {type(cache).__name__}.")
  kp, pt = checks.shape_of(cache.key_pages), checks.shape_of(cache.page_table)
  if len(kp) != 4 or len(pt) != 2:
    raise ValueError(
        f"cache.key_pages must be [P, K, Z, H] and cache.page_table [B, M], "
        f"got shapes {kp} and {pt}. {_BUILD}")
  (p, k, z, _), (b, _) = kp, pt
  scaled = cache.key_scales is not None
  fields = (  # name, what it must be, layout, shape (None: any size)
      ("page_table", "integer", "[B, M]", pt),
      ("lengths", "integer", "[B]", (b,)),
      ("refcount", "integer", "[P]", (p,)),
      ("overflow", "bool", "[B]", (b,)),
      ("nonfinite", "bool", "[P]", (p,)),
      ("key_pages", "quantised" if scaled else "float", "[P, K, Z, H]", kp),
      ("value_pages", "quantised" if scaled else "float", "[P, K, Z, Hv]",
       (p, k, z, None)),
      ("key_scales", "float", "[P, K, Z]", (p, k, z)),
      ("value_scales", "float", "[P, K, Z]", (p, k, z)))
  for name, kind, layout, want in fields:
    _check_field(name, getattr(cache, name), kind, layout, want, kp, pt)
  if (cache.value_scales is not None) != (
      scaled and cache.value_pages is not None):
    raise ValueError(
        "cache.value_scales must be given exactly when there are value "
        "pages and they are quantised (key_scales given); got key_scales "
        f"{'given' if scaled else None}, value_pages "
        f"{'given' if cache.value_pages is not None else None}, "
        f"value_scales {'given' if cache.value_scales is not None else None}"
        f". {_BUILD}")


_BUILD = ("Make the cache with aj.init_paged_cache and change it with "
          "aj.paged_cache's updates.")
_KINDS = {"integer": lambda d: jnp.issubdtype(d, jnp.integer),
          "bool": lambda d: d == jnp.bool_,
          "float": lambda d: jnp.issubdtype(d, jnp.floating),
          "quantised": lambda d: d.name in quantize.FORMATS}


def _check_field(name, x, kind, layout, want, kp, pt) -> None:
  """One field of ``check_cache``: None where allowed, else its dtype and
  shape (``want``; None: any size)."""
  if x is None:
    if name in ("key_pages", "page_table", "lengths", "refcount",
                "overflow"):
      raise TypeError(f"cache.{name} must be an array, got None. {_BUILD}")
    return
  shape, dtype = checks.shape_of(x), jnp.dtype(jnp.result_type(x))
  if not _KINDS[kind](dtype) or len(shape) != len(want) or any(
      w is not None and s != w for s, w in zip(shape, want)):
    sizes = ", ".join("_" if w is None else str(w) for w in want)
    why = ""
    if kind == "quantised":
      kind, why = "int8 or float8_e4m3fn", " (key_scales are given)"
    elif name.endswith("pages") and dtype.name in quantize.FORMATS:
      why = " (quantised pages come with key_scales)"
    raise ValueError(
        f"cache.{name} must be {kind} {layout} = [{sizes}] (P, K, Z from "
        f"key_pages {kp}, B from page_table {pt}), got {dtype} "
        f"{shape}{why}. {_BUILD}")


def _serve_in_order(demand: jax.Array, free: jax.Array) -> jax.Array:
  """bool ``[B]``: whose whole demand fits, handing pages out in batch order.

  A sequence that does not fit takes nothing, so a later, smaller demand
  may still fit.
  """
  def step(used, d):
    ok = used + d <= free
    return used + jnp.where(ok, d, 0), ok
  _, ok = jax.lax.scan(step, jnp.int32(0), demand)
  return ok


def append(cache: PagedKVCache, key: jax.Array, value: jax.Array | None, *,
           new_lengths: ArrayLike | None = None) -> PagedKVCache:
  """Writes each sequence's new tokens after its length.

  A page a sequence starts is taken from the free ones; a partly filled
  page that another sequence also holds (a shared prefix) is copied to a
  free page first, and only the copy is written. The whole write of a
  sequence fits or none of it happens (see the module docstring).

  Args:
    cache: from ``init_paged_cache`` (or a previous update).
    key: float ``[B, K, T, H]``, cast to the pages' dtype.
    value: float ``[B, K, T, Hv]``; None for a cache whose values are its
      keys (``values_in_keys``).
    new_lengths: int ``[B]`` (or a scalar): how many of the ``T`` tokens
      are real per sequence (right-padded prompts; ``0`` for a sequence
      with nothing to add this call). Default: all ``T``.

  Returns:
    The updated cache; ``lengths`` grows by ``new_lengths`` where the write
    fitted.

  Example:
    >>> c = init_paged_cache(4, 2, 1, 1, batch_size=2, max_pages=3)
    >>> x = jnp.arange(1.0, 4.0)[None, None, :, None].repeat(2, 0)
    >>> c = append(c, x, x, new_lengths=jnp.array([3, 1]))
    >>> c.lengths.tolist(), c.page_table.tolist(), c.refcount.tolist()
    ([3, 1], [[0, 1, 4], [2, 4, 4]], [1, 1, 1, 0])
  """
  check_cache(cache)
  _check_append(cache, key, value)
  b, t = cache.page_table.shape[0], key.shape[2]
  n = kv_cache.check_new_lengths(new_lengths, b, t)  # [B] or None
  n = jnp.broadcast_to(jnp.clip(t if n is None else n, 0, t), (b,))
  start, end = cache.lengths, cache.lengths + n  # [B]
  claim = _claim(cache, start, end, n, t)
  cache = _take_pages(cache, claim)
  page, slot = _token_slots(cache, claim.ok, start, n, t)  # [B, T]
  key_pages, key_scales = _written(cache.key_pages, cache.key_scales, key,
                                   page, slot, cache.quantized)
  value_pages, value_scales = cache.value_pages, cache.value_scales
  if value is not None:
    value_pages, value_scales = _written(value_pages, value_scales, value,
                                         page, slot, cache.quantized)
  nonfinite = cache.nonfinite
  if nonfinite is not None:  # the pages a NaN or inf is written to
    bad = ~jnp.isfinite(key).all((1, 3))  # [B, T]
    if value is not None:
      bad |= ~jnp.isfinite(value).all((1, 3))
    nonfinite = nonfinite.at[jnp.where(bad, page, cache.num_pages)].set(
        True, mode="drop")
  return PagedKVCache(
      key_pages, value_pages, cache.page_table,
      jnp.where(claim.ok, end, start), cache.refcount,
      cache.overflow | (~claim.ok & (n > 0)), key_scales, value_scales,
      nonfinite)


def _check_append(cache: PagedKVCache, key, value) -> None:
  """Raises unless key (value) are float ``[B, K, T, H|Hv]`` that fit the pages."""
  b, k = cache.page_table.shape[0], cache.key_pages.shape[1]
  if (value is None) != (cache.value_pages is None):
    raise ValueError(
        "value must be None for a cache whose values are its keys "
        "(values_in_keys), and only then; got value="
        f"{None if value is None else np.shape(value)} for a cache "
        f"{'with' if cache.value_pages is None else 'without'} "
        "values_in_keys.")
  for name, x, pages in (("key", key, cache.key_pages),
                         ("value", value, cache.value_pages)):
    if pages is None:
      continue
    checks.check_float_array(name, x)
    if np.ndim(x) != 4 or np.shape(x)[:2] != (b, k) or (
        np.shape(x)[3] != pages.shape[3]):
      raise ValueError(
          f"{name} must be [B, K, T, {'H' if name == 'key' else 'Hv'}] = "
          f"[{b}, {k}, T, {pages.shape[3]}] to fit the cache's pages "
          f"{pages.shape}, got {np.shape(x)}.")
  if value is not None and value.shape[2] != key.shape[2]:
    raise ValueError(f"key and value must bring the same T tokens, got "
                     f"{key.shape} and {value.shape}.")


class _Claim(NamedTuple):
  """The pages one ``append`` takes; R: the logical pages it may touch."""
  j: jax.Array  # [B, R]: each sequence's logical pages start // Z + r
  need: jax.Array  # [B, R]: which of them get a new page (only where ok)
  new_page: jax.Array  # [B, R]: the page each gets (P: none)
  src: jax.Array  # [B]: a shared page copied on write (P: none)
  dst: jax.Array  # [B]: its copy, new_page[:, 0] (P: none)
  ok: jax.Array  # [B]: whose whole write fits


def _claim(cache: PagedKVCache, start, end, n, t: int) -> _Claim:
  """The pages each sequence starts or copies on write: all it needs or none."""
  b, m = cache.page_table.shape
  p, z = cache.num_pages, cache.page_size
  # Logical pages this call may touch: start // Z + r, r < R.
  r_max = -(-t // z) + 1
  j = start[:, None] // z + jnp.arange(r_max)[None, :]  # [B, R]
  touched = (j * z < end[:, None]) & (j >= start[:, None] // z) & (
      n[:, None] > 0)
  fresh = touched & (j * z >= start[:, None])  # a page not yet started
  # Only the first touched page can be started already (r = 0, a partly
  # filled page), so only it can be shared: copy on write looks at it alone.
  held = cache.page_table[jnp.arange(b), jnp.clip(j[:, 0], 0, m - 1)]  # [B]
  shared = jnp.where(held < p, cache.refcount[jnp.clip(held, 0, p - 1)], 0)
  copied = touched[:, 0] & ~fresh[:, 0] & (shared > 1)  # [B]
  need = fresh.at[:, 0].set(fresh[:, 0] | copied)  # [B, R]
  fits_table = ~(touched & (j >= m)).any(1)  # [B]
  free = cache.refcount == 0
  # A sequence past max_pages asks for nothing and is refused.
  ok = _serve_in_order(jnp.where(fits_table, need.sum(1), 0),
                       free.sum()) & fits_table  # [B]
  need = need & ok[:, None]
  rank = jnp.cumsum(need.reshape(-1)).reshape(b, r_max) - 1  # [B, R]
  free_ids = jnp.nonzero(free, size=b * r_max, fill_value=p)[0]
  new_page = jnp.where(need, free_ids[jnp.clip(rank, 0, b * r_max - 1)], p)
  copy = copied & ok
  return _Claim(j, need, new_page, jnp.where(copy, held, p),
                jnp.where(copy, new_page[:, 0], p), ok)


def _take_pages(cache: PagedKVCache, claim: _Claim) -> PagedKVCache:
  """``cache`` holding the claimed pages: copies made, counts and tables set."""
  b, m = cache.page_table.shape
  src, dst = claim.src, claim.dst  # [B]

  def copied_page(pages):
    if pages is None:
      return None
    return pages.at[dst].set(pages.at[src].get(mode="fill", fill_value=0),
                             mode="drop")

  key_pages, value_pages, key_scales, value_scales = map(
      copied_page, (cache.key_pages, cache.value_pages, cache.key_scales,
                    cache.value_scales))
  nonfinite = cache.nonfinite
  if nonfinite is not None:  # a new page starts clean, a copy as its source
    nonfinite = copied_page(nonfinite.at[claim.new_page.reshape(-1)].set(
        False, mode="drop"))
  # the copied page loses a holder (and is free when that was its last)
  refcount = cache.refcount.at[src].add(-1, mode="drop")
  refcount = refcount.at[claim.new_page.reshape(-1)].add(1, mode="drop")
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], claim.j.shape)
  cols = jnp.where(claim.need, claim.j, m)
  page_table = cache.page_table.at[rows, cols].set(claim.new_page, mode="drop")
  return cache._replace(
      key_pages=key_pages, value_pages=value_pages, page_table=page_table,
      refcount=refcount, key_scales=key_scales, value_scales=value_scales,
      nonfinite=nonfinite)


def _token_slots(cache: PagedKVCache, ok, start, n, t: int):
  """``(page, slot) [B, T]`` of each new token; page P (dropped): not written."""
  m, p, z = cache.max_pages, cache.num_pages, cache.page_size
  pos = start[:, None] + jnp.arange(t)[None, :]  # [B, T]
  real = (jnp.arange(t)[None, :] < n[:, None]) & ok[:, None]
  page = jnp.take_along_axis(cache.page_table, jnp.clip(pos // z, 0, m - 1),
                             1)
  return jnp.where(real, page, p), pos % z


def _written(pages, scales, x, page, slot, quantized):
  """``pages`` (``scales``) with ``x [B, K, T, H]`` written, quantised if kept so."""
  if scales is not None:
    x, scale = quantize.quantize(x, quantized)  # scale [B, K, T]
    scales = scales.at[page, :, slot].set(jnp.swapaxes(scale, 1, 2),
                                          mode="drop")
  pages = pages.at[page, :, slot].set(
      jnp.swapaxes(x, 1, 2).astype(pages.dtype), mode="drop")
  return pages, scales


def release(cache: PagedKVCache, done: ArrayLike) -> PagedKVCache:
  """Gives the pages of the sequences where ``done`` (bool ``[B]``) back.

  A page returns to the pool when no other sequence holds it; the
  sequence's row is empty again (length 0, no pages, overflow cleared),
  ready for a new request.

  Example:
    >>> c = init_paged_cache(4, 2, 1, 1, batch_size=2, max_pages=2)
    >>> x = jnp.ones((2, 1, 3, 1))
    >>> c = release(append(c, x, x), jnp.array([True, False]))
    >>> c.lengths.tolist(), c.refcount.tolist()
    ([0, 3], [0, 0, 1, 1])
  """
  check_cache(cache)
  b, m = cache.page_table.shape
  done = jnp.asarray(done)
  if done.dtype != bool or done.shape != (b,):
    raise ValueError(f"done must be bool [B] = [{b}], got {done.dtype} "
                     f"{done.shape}.")
  drop = jnp.where(done[:, None], cache.page_table, cache.num_pages)
  refcount = cache.refcount.at[drop.reshape(-1)].add(-1, mode="drop")
  return cache._replace(
      page_table=jnp.where(done[:, None], cache.num_pages, cache.page_table),
      lengths=jnp.where(done, 0, cache.lengths), refcount=refcount,
      overflow=cache.overflow & ~done)


def share_prefix(cache: PagedKVCache, source: ArrayLike, target: ArrayLike,
                 length: ArrayLike) -> PagedKVCache:
  """Sequence ``target`` starts with ``source``'s first ``length`` tokens.

  No key or value is copied: ``target``'s page table takes the pages that
  hold those tokens (their reference counts grow), so the prompt is stored
  once. The last of them may be partly ``source``'s later tokens; whichever
  sequence writes into a shared page first copies it (``append``).

  Args:
    cache: the cache.
    source: int scalar, the sequence whose tokens are shared.
    target: int scalar, an empty sequence (length 0, no pages).
    length: int scalar, tokens shared.

  Raises:
    ValueError: at trace time, when the values are known (concrete, under
      ``jit`` too): ``source`` or ``target`` outside ``[0, B)`` or equal, a
      ``target`` that is not empty, or a ``length`` outside ``[0,
      source's length]``. Traced, such a call changes nothing but raise
      ``target``'s overflow flag (when ``target`` is a row), and
      ``aj.checked`` raises the same message.

  Example:
    >>> c = init_paged_cache(4, 2, 1, 1, batch_size=2, max_pages=2)
    >>> x = jnp.ones((2, 1, 3, 1))
    >>> c = append(c, x, x, new_lengths=jnp.array([3, 0]))
    >>> c = share_prefix(c, 0, 1, 3)
    >>> c.page_table.tolist(), c.refcount.tolist()
    ([[0, 1], [0, 1]], [2, 2, 0, 0])
  """
  check_cache(cache)
  b, m = cache.page_table.shape
  z, p = cache.page_size, cache.num_pages
  _check_share(cache, source, target, length)
  source, target, length = (jnp.asarray(x, jnp.int32)
                            for x in (source, target, length))
  src_ok, tgt_ok = ((x >= 0) & (x < b) for x in (source, target))
  # A traced row out of range changes nothing: clipped reads, dropped writes
  # (a negative row would otherwise wrap round to the last ones).
  src, tgt = (jnp.clip(x, 0, b - 1) for x in (source, target))
  ok = (src_ok & tgt_ok & (source != target) & (cache.lengths[tgt] == 0)
        & (length >= 0) & (length <= cache.lengths[src]))
  j = jnp.arange(m)
  pages = jnp.where((j * z < length) & ok, cache.page_table[src], p)
  refcount = cache.refcount.at[pages].add(1, mode="drop")
  row = jnp.where(ok, pages, cache.page_table[tgt])
  at = jnp.where(tgt_ok, target, b)  # b: dropped
  return cache._replace(
      page_table=cache.page_table.at[at].set(row, mode="drop"),
      lengths=cache.lengths.at[at].set(
          jnp.where(ok, length, cache.lengths[tgt]), mode="drop"),
      refcount=refcount,
      overflow=cache.overflow.at[at].set(cache.overflow[tgt] | ~ok,
                                         mode="drop"))


def _known(x) -> np.ndarray | None:
  """``x``'s value if known while tracing (a concrete array under ``jit``
  included), else None."""
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def _check_share(cache: PagedKVCache, source, target, length) -> None:
  """``share_prefix``'s arguments: raised now where their values are known,
  else conditions ``aj.checked`` enforces (``traced_check``)."""
  b = cache.page_table.shape[0]
  for name, x in (("source", source), ("target", target),
                  ("length", length)):
    checks.integer_array(name, x)
    if np.ndim(x) != 0:
      raise ValueError(f"{name} must be an integer scalar, got shape "
                       f"{np.shape(x)}.")
  s, tg, n, have = map(_known, (source, target, length, cache.lengths))
  pair = (f"source and target must be two different sequences in [0, B) = "
          f"[0, {b})")
  if s is not None and tg is not None:
    if not (0 <= s < b and 0 <= tg < b and s != tg):
      raise ValueError(f"{pair}, got {s} and {tg}.")
  else:
    source, target = jnp.asarray(source), jnp.asarray(target)
    traced_checks.traced_check(
        (source >= 0) & (source < b) & (target >= 0) & (target < b)
        & (source != target), pair + ", got {source} and {target}.",
        source=source, target=target)
  if all(x is not None for x in (s, tg, n, have)):
    if not 0 <= n <= have[s]:
      raise ValueError(f"length must be in [0, {have[s]}] (source {s} holds "
                       f"{have[s]} tokens), got {n}.")
    if have[tg] != 0:
      raise ValueError(f"target {tg} must be empty (release it first); it "
                       f"holds {have[tg]} tokens.")
    return
  held = cache.lengths[jnp.clip(jnp.asarray(source), 0, b - 1)]
  traced_checks.traced_check(
      (jnp.asarray(length) >= 0) & (jnp.asarray(length) <= held),
      "length must be in [0, {held}] (source {source} holds {held} tokens), "
      "got {length}.", held=held, source=jnp.asarray(source),
      length=jnp.asarray(length))
  held = cache.lengths[jnp.clip(jnp.asarray(target), 0, b - 1)]
  traced_checks.traced_check(
      held == 0, "target {target} must be empty (release it first); it "
      "holds {held} tokens.", target=jnp.asarray(target), held=held)


def _first_of(rows: jax.Array, b: int) -> jax.Array:
  """bool ``[R]``: ``rows[i]`` is in ``[0, B)`` and not named before ``i``."""
  r = rows.shape[0]
  earlier = jnp.tril(rows[:, None] == rows[None, :], -1).any(1)  # [R]
  return (rows >= 0) & (rows < b) & ~earlier & (r > 0)


def take_rows(cache: PagedKVCache, rows: ArrayLike) -> PagedKVCache:
  """The cache as ``R`` of its sequences see it: the same pool and counts,
  their page tables, lengths and flags (``rows`` int ``[R]``).

  A call may then append to and attend over a few sequences (those that
  prefill a prompt) without computing every row; ``put_rows`` writes them
  back. ``rows`` must be distinct sequences in ``[0, B)``: concrete ones
  (under ``jit`` too) that are not raise, traced ones under ``aj.checked``.
  Traced and unchecked, a row named again after its first mention sees a
  full table, so nothing is written for it (its output is garbage), and
  ``put_rows`` raises its overflow flag; an entry out of range is treated
  alike but has no flag to raise.

  Example:
    >>> c = init_paged_cache(6, 2, 1, 1, batch_size=3, max_pages=2)
    >>> part = take_rows(c, jnp.array([2]))
    >>> part = append(part, jnp.ones((1, 1, 3, 1)), jnp.ones((1, 1, 3, 1)))
    >>> c = put_rows(c, part, jnp.array([2]))
    >>> c.lengths.tolist(), c.page_table.tolist()
    ([0, 0, 3], [[6, 6], [6, 6], [0, 1]])
  """
  check_cache(cache)
  rows = _check_rows(rows, cache.page_table.shape[0])
  b, m = cache.page_table.shape
  first = _first_of(rows, b)
  at = jnp.clip(rows, 0, b - 1)
  # A repeated row: a full table (lengths M * Z, no pages), so append finds
  # no room and writes nothing.
  return cache._replace(
      page_table=jnp.where(first[:, None], cache.page_table[at],
                           cache.num_pages),
      lengths=jnp.where(first, cache.lengths[at], m * cache.page_size),
      overflow=jnp.where(first, cache.overflow[at], False))


def put_rows(cache: PagedKVCache, part: PagedKVCache,
             rows: ArrayLike) -> PagedKVCache:
  """``cache`` with ``take_rows(cache, rows)``, since updated, written back:
  the pool and counts of ``part``, its rows' tables, lengths and flags.

  A row of ``rows`` named twice keeps its first mention's and has its
  overflow flag raised (``take_rows``).
  """
  check_cache(cache)
  b = cache.page_table.shape[0]
  rows = _check_rows(rows, b)
  if part.page_table.shape != (rows.shape[0],) + cache.page_table.shape[1:]:
    raise ValueError(
        f"part must be take_rows(cache, rows) for these {rows.shape[0]} rows "
        f"(page_table [{rows.shape[0]}, {cache.max_pages}]), got page_table "
        f"{part.page_table.shape}.")
  first = _first_of(rows, b)
  at = jnp.where(first, rows, b)  # b: dropped
  again = jnp.where(~first & (rows >= 0) & (rows < b), rows, b)
  return part._replace(
      page_table=cache.page_table.at[at].set(part.page_table, mode="drop"),
      lengths=cache.lengths.at[at].set(part.lengths, mode="drop"),
      overflow=cache.overflow.at[at].set(part.overflow, mode="drop").at[
          again].set(True, mode="drop"))


def _check_rows(rows, b: int) -> jax.Array:
  checks.integer_array("rows", rows)
  if np.ndim(rows) != 1:
    raise ValueError(f"rows must be int [R], got shape {np.shape(rows)}.")
  message = f"rows must be distinct sequences in [0, B) = [0, {b}), got "
  known = _known(rows)
  if known is not None:
    named = known.tolist()
    if any(not 0 <= r < b for r in named) or len(set(named)) != len(named):
      raise ValueError(f"{message}{named}.")
    return jnp.asarray(rows, jnp.int32)
  rows = jnp.asarray(rows, jnp.int32)
  traced_checks.traced_check(jnp.all(_first_of(rows, b)), message + "{rows}.",
                             rows=rows)
  return rows


def check_overflow(cache: PagedKVCache) -> None:
  """ValueError naming the sequences whose writes found no room (concrete)."""
  check_cache(cache)
  flags = np.asarray(cache.overflow)
  if flags.any():
    raise ValueError(
        f"paged KV cache overflow in sequences {np.flatnonzero(flags).tolist()}"
        f": a write needed more free pages than the pool had, or more than "
        f"max_pages={cache.max_pages} pages of {cache.page_size} tokens; it "
        "was dropped. Release finished sequences, or build the cache with "
        "more pages (init_paged_cache). (A move_slots that would have written "
        "into a page another sequence holds is dropped the same way: keep "
        "shared prefixes where they are.)")
