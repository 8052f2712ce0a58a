"""Greedy speculative decoding with a model's paged caches.

Shape glossary: B batch, P padded prompt length, G new tokens
(``max_new_tokens``), T nodes of a drafted tree (its root included; ``1 +
width * depth`` for the default draft), A the history buffer's slots
(``P + G + depth``), V vocabulary size, Z tokens per page.

``speculative_generate`` returns what ``aj.generate`` returns at
temperature 0, with fewer target calls when a draft guesses well. After a
ragged prefill (as ``generate``'s), each step of a ``jax.lax.while_loop``:

1. **Draft.** Each row's tree of candidate tokens under its **root** (the
   last token it emitted, not yet cached): ``tokens``/``parents [B, T]``,
   node 0 the root, nodes in topological order (``aj.tree_rule``'s
   convention), ``lengths [B]`` real nodes. The default is prompt lookup
   (``prompt_lookup_draft``, in JAX: no host round trip): the most recent
   earlier occurrences of the row's last ``n`` tokens (``n = max_n ..
   1``) in its prompt and output, each proposing the ``depth`` tokens that
   followed it; the first ``width`` distinct continuations merged into a
   trie under the root. A ``draft_fn`` (a small draft model) can replace
   it.
2. **Verify.** ``verify_fn`` feeds every node in one ``decode=True`` call:
   node ``i`` sees the row's cache and its ancestors (``aj.tree_rule``)
   at position ``prefix + depth(i)`` (``aj.tree_positions``), ``prefix``
   the cache's length before the call (``tree_step_options`` reads both
   off the model).
3. **Accept** (``aj.greedy_accept``): from the root, follow the child whose
   token is the target's argmax after the current node. Every token on
   that path is what plain greedy decoding would produce, so the row emits
   the path's drafted tokens and the target's token after the path's last
   node (the next root).
4. **Keep.** Every paged ``MultiHeadAttention`` layer keeps the path's
   nodes, moved to the slots after the prefix (``aj.move_slots``); the
   other nodes' slots are dropped and pages past the new length return to
   the pool.

Greedy only: acceptance is by equality with the target's argmax, which is
what makes the tokens plain greedy decoding's (sampling would need the
rejection scheme of Leviathan et al., not offered here). The tokens equal
``aj.generate``'s greedy tokens up to float32 near ties (the target sees
the same context through other kernel shapes). Tokens past
``max_new_tokens`` are dropped, and the caches are cut back to what the
plain run leaves: each row's prompt and its first ``G - 1`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from attention_jax.core import checks
from attention_jax.decoding import paged_edit
from attention_jax.decoding import speculative
from attention_jax.layers import generate as generate_lib
from attention_jax.layers import latent_module
from attention_jax.layers import multi_head_module as mha_module
from attention_jax.masking import tree

# verify_fn(model, tokens [B, T], lengths [B], parents [B, T] | None)
#   -> logits [B, T, V]
VerifyFn = Callable[[Any, jax.Array, jax.Array, jax.Array | None],
                    jax.Array]
# draft_fn(history [B, A], history_lengths [B])
#   -> (tokens [B, T], parents [B, T], lengths [B])
DraftFn = Callable[[jax.Array, jax.Array],
                   tuple[jax.Array, jax.Array, jax.Array]]

_PAGED_FIX = ("call init_paged_cache(batch_size=B, num_pages=..., "
              "page_size=..., max_pages=...) on it")


def _where(path) -> str:
  return "/".join(map(str, path)) or "the model"


def _paged_layers(model) -> list[tuple[str, mha_module.MultiHeadAttention]]:
  """``model``'s ``MultiHeadAttention`` layers that hold a paged cache,
  with their paths; any other self-attention cache refused (the accepted
  path is kept with ``aj.move_slots``, an edit of pages)."""
  found = []
  for path, node in nnx.iter_graph(model):
    where = _where(path)
    if isinstance(node, latent_module.MultiHeadLatentAttention) and (
        node.cache_index is not None or node.cache_pages is not None):
      raise ValueError(
          f"{where} (MultiHeadLatentAttention) holds a cache: "
          "speculative_generate keeps a verified tree's accepted path in "
          "MultiHeadAttention layers' paged caches only; use aj.generate "
          "for this model.")
    if (not isinstance(node, mha_module.MultiHeadAttention)
        or node.cache_index is None):
      continue  # no cache, or a cross-attention memory: nothing to edit
    if node.cache_page_table is None:
      kind = ("a ring buffer (init_cache with a window)"
              if node.cache_window is not None else "a linear cache "
              "(init_cache)")
      raise ValueError(
          f"the KV cache of {where} is {kind}: speculative_generate keeps "
          f"each verified tree's accepted path with aj.move_slots, which "
          f"edits a paged cache; {_PAGED_FIX}.")
    found.append((where, node))
  return found


def tree_step_options(model, parents: ArrayLike | None):
  """``(rule, positions)`` for a decoding call that verifies drafted trees.

  The prefix is the cache's length before the call: the ``cache_index`` of
  the first ``MultiHeadAttention`` layer of ``model`` holding a paged cache
  (every layer of a model holds the same tokens). Give the attention
  layers ``mask=aj.Mask(q_lengths=lengths, rule=rule)`` and
  ``positions=positions``; a row's node ``i`` then sees its cache and its
  ancestors, at position ``prefix + depth(i)``.

  Args:
    model: an ``nnx`` module (or graph of them) with a paged cache.
    parents: int ``[B, T]`` (``[T]``: every row's tree alike), or None (no
      tree: a plain ragged call).

  Returns:
    ``(aj.tree_rule(parents, prefix), aj.tree_positions(parents,
    prefix))``, or ``(None, None)`` for ``parents=None``.

  Raises:
    ValueError: ``model`` has no ``MultiHeadAttention`` layer with a paged
      cache.
  """
  if parents is None:
    return None, None
  for _, node in nnx.iter_graph(model):
    if (isinstance(node, mha_module.MultiHeadAttention)
        and node.cache_page_table is not None):
      prefix = node.cache_index[...]  # [B]: before this call's write
      return tree.tree_rule(parents, prefix), tree.tree_positions(
          parents, prefix)
  raise ValueError(
      "tree_step_options reads the tree's prefix off a paged cache, but the "
      "model has no MultiHeadAttention layer holding one: call "
      "init_paged_cache(...) on its attention layers.")


def prompt_lookup_draft(history: ArrayLike, lengths: ArrayLike, *,
                        width: int = 2, depth: int = 4, max_n: int = 4,
                        pad_id: int = 0):
  """Prompt-lookup trees (see the module doc), in JAX.

  Args:
    history: int ``[B, A]``: each row's prompt and output so far (its last
      token the root); entries past ``lengths`` are ignored.
    lengths: int ``[B]``: tokens of each row's history.
    width: most continuations (branches) per tree.
    depth: tokens per continuation (fewer when it reaches the history's
      end).
    max_n: the longest suffix looked up.
    pad_id: the token of padding nodes.

  Returns:
    ``(tokens, parents [B, T], lengths [B])``, ``T = 1 + width * depth``:
    node 0 the root (``history[b, lengths[b] - 1]``, parent -1), the
    continuations merged into a trie (shared prefixes once) in order, most
    recent occurrence of the longest suffix first; padding nodes are
    ``pad_id`` with parent -1.

  Example:
    >>> history = jnp.array([[1, 5, 6, 7, 8, 5, 6, 9, 3, 5, 6]])
    >>> tokens, parents, n = prompt_lookup_draft(
    ...     history, jnp.array([11]), width=2, depth=3, max_n=2)
    >>> tokens[0, :n[0]].tolist(), parents[0, :n[0]].tolist()
    ([6, 9, 3, 5, 7, 8, 5], [-1, 0, 1, 2, 0, 4, 5])
  """
  for name, value in (("width", width), ("depth", depth), ("max_n", max_n)):
    checks.check_positive_int(name, value)
  history, lengths = jnp.asarray(history), jnp.asarray(lengths)
  if history.ndim != 2 or lengths.shape != history.shape[:1]:
    raise ValueError(
        f"prompt_lookup_draft needs history [B, A] and lengths [B], got "
        f"{history.shape} and {lengths.shape}.")
  history, lengths = history.astype(jnp.int32), lengths.astype(jnp.int32)
  b, a = history.shape
  last = lengths[:, None]  # [B, 1]
  end = jnp.arange(a)[None, :]  # [1, A]: just after an occurrence

  def at(i):  # history[b, i] (i clipped into the buffer)
    return jnp.take_along_axis(history, jnp.clip(i, 0, a - 1), 1)

  # best[b, e]: the longest n <= max_n whose suffix history[L - n:L] also
  # ends at e <= L - 1 (an earlier occurrence); 0 for none. A suffix of n
  # matching implies its last n - 1 tokens do: extend one token at a time.
  match = jnp.ones((b, a), bool)
  best = jnp.zeros((b, a), jnp.int32)
  for n in range(1, max_n + 1):
    match = match & (end - n >= 0) & (at(end - n) == at(last - n))
    best = jnp.where(match & (end <= last - 1), n, best)
  # Each end's continuation history[e:e + depth], cut at the history's end.
  j = jnp.arange(depth)[None, None, :]
  span = jnp.minimum(depth, last - end)  # [B, A]
  cont = jnp.take_along_axis(
      history[:, None, :],
      jnp.clip(end[..., None] + j, 0, a - 1), 2)  # [B, A, depth]
  cont = jnp.where(j < span[..., None], cont, 0)
  # The experiment's order: longest suffix first, then most recent; a
  # continuation seen before (the same tokens, the same length) is skipped.
  key = jnp.where(best > 0, best * a + end, -1)  # [B, A]
  rows = jnp.arange(b)
  branches, spans = [], []
  for _ in range(width):
    pick = jnp.argmax(key, 1)  # [B]
    has = key[rows, pick] >= 0
    branch = cont[rows, pick]  # [B, depth]
    n_tokens = jnp.where(has, span[rows, pick], 0)
    branches.append(branch)
    spans.append(n_tokens)
    same = (span == n_tokens[:, None]) & (cont == branch[:, None, :]).all(-1)
    key = jnp.where(same, -1, key)
  root = at(last - 1)[:, 0]
  return _trie(root, branches, spans, pad_id)


def _trie(root, branches, spans, pad_id):
  """Branches ``[B, depth]`` (``spans [B]`` tokens each) merged under
  ``root [B]``, as ``experiments/speculative.trie``: a node per distinct
  prefix, numbered in insertion order."""
  b = root.shape[0]
  depth = branches[0].shape[1] if branches else 0
  t = 1 + len(branches) * depth
  node = jnp.arange(t)[None, :]
  tokens = jnp.full((b, t), pad_id, jnp.int32).at[:, 0].set(root)
  parents = jnp.full((b, t), -1, jnp.int32)
  count = jnp.ones(b, jnp.int32)
  ids = []  # ids[k][j]: branch k's j-th node [B]
  for k, (branch, span) in enumerate(zip(branches, spans)):
    ids.append([])
    for j in range(depth):
      real = j < span
      # The node of an earlier branch with the same first j + 1 tokens.
      shared = jnp.zeros(b, bool)
      same_id = jnp.zeros(b, jnp.int32)
      for k2 in range(k):
        same = (real & (j < spans[k2])
                & (branches[k2][:, :j + 1] == branch[:, :j + 1]).all(1))
        same_id = jnp.where(same & ~shared, ids[k2][j], same_id)
        shared = shared | same
      new = real & ~shared
      parent = ids[k][j - 1] if j else jnp.zeros(b, jnp.int32)
      put = new[:, None] & (node == count[:, None])
      tokens = jnp.where(put, branch[:, j:j + 1], tokens)
      parents = jnp.where(put, parent[:, None], parents)
      ids[k].append(jnp.where(shared, same_id, count))
      count = count + new
  return tokens, parents, count


def _check_draft(shapes, b: int) -> int:
  """``draft_fn``'s output shapes (from ``jax.eval_shape``) -> ``T``."""
  try:
    tokens, parents, lengths = shapes
  except (TypeError, ValueError):
    raise ValueError(
        f"draft_fn must return (tokens [B, T], parents [B, T], lengths "
        f"[B]), got {shapes!r}.") from None
  got = [(tuple(x.shape), x.dtype) for x in (tokens, parents, lengths)]
  t = tokens.shape[1] if len(tokens.shape) == 2 else None
  if (t is None or t < 1 or tuple(tokens.shape) != (b, t)
      or tuple(parents.shape) != (b, t) or tuple(lengths.shape) != (b,)
      or not all(jnp.issubdtype(d, jnp.integer) for _, d in got)):
    raise ValueError(
        f"draft_fn must return integer (tokens [B, T], parents [B, T], "
        f"lengths [B]) with B = {b} and T >= 1 nodes (node 0 the root), got "
        f"shapes and dtypes {[(s, str(d)) for s, d in got]}.")
  return t


def _check_room(layers, b: int, p: int, g: int, t: int) -> None:
  """Each paged cache fits the worst step: a row of a ``P``-token prompt
  with ``G - 1`` tokens emitted holds ``P + G - 2`` tokens and appends
  ``T`` nodes; every row may be there at once."""
  need = p if g == 1 else p + g - 2 + t
  for where, layer in layers:
    rows, max_pages = layer.cache_page_table.shape
    num_pages, _, z = layer.cached_key.shape[:3]
    if rows != b:
      raise ValueError(
          f"the paged cache of {where} has {rows} rows, but prompts has B = "
          f"{b}: call init_paged_cache(batch_size={b}, ...) on it.")
    pages = -(-need // z)
    if max_pages * z < need or num_pages < b * pages:
      raise ValueError(
          f"the paged cache of {where} holds {max_pages} pages of {z} "
          f"tokens per row and {num_pages} in its pool, but a row may hold "
          f"P + G - 2 + T = {p} + {g} - 2 + {t} = {need} tokens (the prompt, "
          f"the tokens emitted but the last, a drafted tree of T nodes): "
          f"call init_paged_cache(batch_size={b}, page_size={z}, "
          f"max_pages={pages}, num_pages={b * pages}) on it.")


def _check_int(name: str, x) -> jax.Array:
  if checks.shape_of(x) != () or isinstance(x, bool) or not jnp.issubdtype(
      jnp.result_type(x), jnp.integer):
    raise TypeError(f"{name} must be an integer scalar, got {x!r}.")
  return jnp.asarray(x, jnp.int32)


def speculative_generate(
    verify_fn: VerifyFn,
    model: Any,
    prompts: ArrayLike,
    prompt_lengths: ArrayLike,
    max_new_tokens: int,
    *,
    draft_fn: DraftFn | None = None,
    width: int = 2,
    depth: int = 4,
    max_n: int = 4,
    pad_id: int | ArrayLike = 0,
    return_stats: bool = False,
) -> tuple[Any, ...]:
  """Greedy generation, drafted trees verified in one call each (module doc).

  Args:
    verify_fn: ``verify_fn(model, tokens, lengths, parents) -> logits``:
      feeds ``tokens`` int32 ``[B, T]`` through ``model`` with
      ``decode=True`` and returns ``[B, T, V]``; each attention layer takes
      ``mask=aj.Mask(q_lengths=lengths)`` (only a row's first ``lengths``
      tokens are real; 0: the row appends nothing). Called once with the
      prompts and ``parents=None`` (a ragged prefill), then once per step
      with the drafted trees, ``parents [B, T]``: the layers then also take
      ``rule`` and ``positions`` from ``tree_step_options(model,
      parents)``. Static under ``jit``.
    model: an ``nnx`` module (or graph of them) whose ``MultiHeadAttention``
      layers hold fresh paged caches (``init_paged_cache``) with room for
      ``P + G - 2 + T`` tokens per row, every row at once; any other
      self-attention cache is refused. Its caches are advanced in place and
      end as ``aj.generate``'s would (the prompt and the first ``G - 1``
      tokens per row); call each layer's ``check_cache()`` afterwards.
    prompts: integer ``[B, P]``, right-padded.
    prompt_lengths: integer ``[B]`` in ``[1, P]`` (checked when concrete; a
      traced length outside it generates nothing, length 0).
    max_new_tokens: ``G >= 1``, static.
    draft_fn: None for prompt lookup (``prompt_lookup_draft`` with
      ``width``, ``depth``, ``max_n``), or ``draft_fn(history,
      history_lengths) -> (tokens, parents, lengths)``: ``history`` int32
      ``[B, A]`` (``A = P + G + depth``) each row's prompt and output so
      far, ``history_lengths [B]`` its tokens; returns each row's tree,
      integer ``[B, T]``, ``[B, T]`` and ``[B]`` for a static ``T >= 1``:
      parents in ``[-1, i)`` (topological order), node 0 the root (its
      token and parent are set here: the row's last token, -1), ``lengths``
      real nodes (clipped to ``[1, T]``). Static under ``jit``.
    width: branches of the default draft.
    depth: tokens per branch of the default draft; the longest path
      accepted per step (a deeper branch of a ``draft_fn`` is accepted up
      to ``depth`` drafted tokens).
    max_n: the longest suffix the default draft looks up.
    pad_id: the token of padding nodes and of a row's entries past its
      length.
    return_stats: also return ``{"verify_calls", "trees",
      "mean_accepted"}``: verification calls (the prefill not counted),
      trees verified (rows that still generated, summed over the calls),
      and the mean drafted tokens accepted per tree (float32).

  Returns:
    ``(tokens, lengths)``: int32 ``[B, G]`` and int32 ``[B]`` (``G``, or 0
    for a traced prompt length out of range), as ``aj.generate`` at
    temperature 0; with ``return_stats`` also the stats dict.

  Raises:
    TypeError, ValueError: bad prompts, lengths or options; a model with no
      paged ``MultiHeadAttention`` cache, another cache (linear, ring
      buffer, a latent layer's), a paged cache of another batch or too
      small; a ``draft_fn`` or ``verify_fn`` output of the wrong shape.

  Example:
    >>> class LM(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.embed = nnx.Embed(11, 8, rngs=rngs)
    ...     self.attn = aj.MultiHeadAttention(8, 2, rope=aj.Rope(base=100.0),
    ...                                    rngs=rngs)
    ...     self.out = nnx.Linear(8, 11, rngs=rngs)
    ...   def __call__(self, tokens, lengths, parents):
    ...     rule, positions = aj.tree_step_options(self, parents)
    ...     x = self.embed(tokens)
    ...     mask = aj.Mask(q_lengths=lengths, rule=rule)
    ...     return self.out(x + self.attn(x, mask=mask, positions=positions,
    ...                                   decode=True))
    >>> lm = LM(nnx.Rngs(0))
    >>> lm.attn.init_paged_cache(2, num_pages=8, page_size=4, max_pages=4)
    >>> prompts = jnp.array([[1, 2, 1, 2], [4, 5, 4, 0]])  # right-padded
    >>> run = nnx.jit(aj.speculative_generate, static_argnums=(0, 4),
    ...               static_argnames=("width", "depth"))
    >>> tokens, lengths = run(lambda m, t, n, p: m(t, n, p), lm, prompts,
    ...                       jnp.array([4, 3]), 4, width=2, depth=2)
    >>> tokens.shape, lengths.tolist()
    ((2, 4), [4, 4])
    >>> lm.attn.cache_index[...].tolist()  # prompt + 3 tokens, as generate's
    [7, 6]
  """
  if isinstance(max_new_tokens, bool) or not isinstance(
      max_new_tokens, (int, np.integer)):
    raise TypeError(f"max_new_tokens must be a Python int (static under "
                    f"jit), got {max_new_tokens!r}.")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  for name, value in (("width", width), ("depth", depth), ("max_n", max_n)):
    checks.check_positive_int(name, value)
  checks.check_static_bool("return_stats", return_stats)
  prompts, plen = generate_lib.check_tokens(prompts, prompt_lengths)
  pad = _check_int("pad_id", pad_id)
  b, p = prompts.shape
  g = int(max_new_tokens)
  a = p + g + depth  # a step starts with < G emitted and emits <= depth + 1
  layers = _paged_layers(model)
  if not layers:
    raise ValueError(
        "speculative_generate needs the model's MultiHeadAttention layers to "
        "hold paged caches (the accepted path is kept with aj.move_slots), "
        f"and found none: {_PAGED_FIX}.")
  if draft_fn is None:
    draft_fn = functools.partial(prompt_lookup_draft, width=width,
                                 depth=depth, max_n=max_n, pad_id=pad)
  t = _check_draft(jax.eval_shape(
      draft_fn, jax.ShapeDtypeStruct((b, a), jnp.int32),
      jax.ShapeDtypeStruct((b,), jnp.int32)), b)
  _check_room(layers, b, p, g, t)

  logits = verify_fn(model, prompts, plen, None)
  if checks.shape_of(logits)[:2] != (b, p) or np.ndim(logits) != 3:
    raise ValueError(
        f"verify_fn returned logits of shape {checks.shape_of(logits)} for "
        f"prompts {prompts.shape}: expected [B, T, V] = [{b}, {p}, V].")
  v = logits.shape[-1]
  rows = jnp.arange(b)
  valid = (plen >= 1) & (plen <= p)  # traced misfits generate nothing
  first = jnp.argmax(logits[rows, jnp.clip(plen - 1, 0, p - 1)], -1).astype(
      jnp.int32)
  slot = jnp.arange(a)[None, :]
  history = jnp.concatenate(
      [prompts, jnp.zeros((b, a - p), jnp.int32)], 1)  # [B, A]
  history = jnp.where(slot < plen[:, None], history, pad)
  history = jnp.where((slot == plen[:, None]) & valid[:, None],
                      first[:, None], history)
  generated = valid.astype(jnp.int32)  # tokens emitted per row
  hist_len = plen + generated
  # The loop carries what decoding changes (caches); parameters are closed
  # over, as in generate.
  graphdef, params, state = nnx.split(model, nnx.Param, ...)

  def cond(carry):
    _, _, _, generated, steps, _, _ = carry
    active = valid & (generated < g)
    return active.any() & (steps < g)  # every step emits >= 1 per row

  def body(carry):
    state, history, hist_len, generated, steps, accepted, trees = carry
    m = nnx.merge(graphdef, params, state)
    active = valid & (generated < g)
    tokens, parents, n_nodes = draft_fn(history, hist_len)
    tokens = tokens.astype(jnp.int32).at[:, 0].set(
        history[rows, jnp.clip(hist_len - 1, 0, a - 1)])  # the root
    parents = parents.astype(jnp.int32).at[:, 0].set(-1)
    n_nodes = jnp.where(active, jnp.clip(n_nodes.astype(jnp.int32), 1, t), 0)
    prefixes = [layer.cache_index[...] for _, layer in _paged_layers(m)]
    out = verify_fn(m, tokens, n_nodes, parents)
    if checks.shape_of(out) != (b, t, v):
      raise ValueError(
          f"verify_fn returned logits of shape {checks.shape_of(out)} for "
          f"drafted trees {tokens.shape}: expected [B, T, V] = [{b}, {t}, "
          f"{v}].")
    nxt = jnp.argmax(out, -1).astype(jnp.int32)  # [B, T]
    path, count = speculative.greedy_accept(tokens, parents, n_nodes, nxt,
                                            depth)
    for (_, layer), prefix in zip(_paged_layers(m), prefixes):
      layer.update_paged_cache(paged_edit.move_slots, prefix,
                               prefix[:, None] + path, count)
    # Emitted: the path's drafted tokens, then the target's after its end.
    j = jnp.arange(depth + 1)[None, :]
    drafted = jnp.take_along_axis(tokens, path, 1)  # [B, depth + 1]
    drafted = jnp.concatenate([drafted[:, 1:], drafted[:, :1]], 1)
    end = jnp.take_along_axis(path, jnp.maximum(count - 1, 0)[:, None], 1)
    bonus = jnp.take_along_axis(nxt, end, 1)  # [B, 1]
    emitted = jnp.where(j == count[:, None] - 1, bonus, drafted)
    where = jnp.where(j < count[:, None], hist_len[:, None] + j, a)
    history = history.at[rows[:, None], where].set(emitted, mode="drop")
    _, _, state = nnx.split(m, nnx.Param, ...)
    return (state, history, hist_len + count, generated + count, steps + 1,
            accepted + jnp.sum(jnp.where(active, count - 1, 0)),
            trees + jnp.sum(active))

  zero = jnp.zeros((), jnp.int32)
  state, history, _, generated, steps, accepted, trees = jax.lax.while_loop(
      cond, body, (state, history, hist_len, generated, zero, zero, zero))
  nnx.update(model, state)
  # A last step may emit past G: cut each cache back to the plain run's
  # (the prompt and the first G - 1 tokens), its pages back to the pool.
  for _, layer in layers:
    held = layer.cache_index[...]
    keep = jnp.where(valid, jnp.minimum(held, plen + g - 1), held)
    layer.update_paged_cache(paged_edit.move_slots, keep,
                             jnp.zeros((b, 1), jnp.int32),
                             jnp.zeros((b,), jnp.int32))
  lengths = jnp.minimum(generated, g)
  new = jnp.take_along_axis(
      history, jnp.clip(plen[:, None] + jnp.arange(g)[None, :], 0, a - 1), 1)
  tokens = jnp.where(jnp.arange(g)[None, :] < lengths[:, None], new, pad)
  if not return_stats:
    return tokens, lengths
  stats = {"verify_calls": steps, "trees": trees,
           "mean_accepted": accepted / jnp.maximum(trees, 1).astype(
               jnp.float32)}
  return tokens, lengths, stats
