"""What evicting keys costs: the LM's validation text read through a paged
cache that keeps a budget of each row's tokens (StreamingLLM, H2O, SnapKV).

Shape glossary: R rows, T transitions per row (the LM's trained length), P
prompt tokens (``T * prompt_fraction``), A slots a row keeps (the budget),
L slots a row's page table covers (``T`` rounded up to pages), K key/value
heads, V vocabulary size.

Protocol (teacher forcing: the text itself, never generated tokens). The
validation rows of ``T`` full transitions (``cache_accuracy.
validation_rows``; a document's shorter last row is left out, so every
budget is the same share of every row) are read in two phases:

1. **Prompt**: the first ``P`` inputs are prefilled in one call into an
   empty paged cache (the whole prompt attends to the whole prompt), then
   each policy evicts down to the budget: StreamingLLM keeps the first
   ``sinks`` and the newest tokens; H2O keeps the ``budget // 2`` newest
   and the heaviest accumulated attention of the rest (the prompt's
   queries' importance, every layer and KV head apart); SnapKV keeps its
   observation window (the prompt's last ``window`` tokens) and the top
   pooled window scores (``aj.snapkv_keep``).
2. **Continuation**: the other ``T - P`` inputs one token per call, each at
   its rotary position (the tokens the row has seen, not its slot: kept
   keys keep theirs). Each call attends over the kept slots and its own
   token (at most ``budget + 1``); then StreamingLLM and H2O evict down to
   the budget (H2O adding the call's importance to the accumulated scores
   first, and moving the scores with their slots). SnapKV, as its paper, is
   a compression run at a point, not per token: it accumulates the
   window's importance and compresses again every ``window`` tokens, with
   the ``window`` newest as its observation window, so it holds up to
   ``budget + window`` slots between compressions (``peak_slots``).

Measured over the continuation's predictions only (targets ``P + 1 ..
T``; the prompt's are the full cache's for every policy), per policy and
budget, against the full cache (the same protocol, nothing evicted):

* ``bits_per_char``: mean ``-log2 p(target)``;
* ``greedy_agreement``: the share of predictions whose argmax equals the
  full cache's (what greedy decoding would emit next, given the text);
* ``pages_at_end`` / ``bytes_at_end``: pages (of ``page_size`` tokens) per
  row held after the last token, and their bytes over every layer's pool
  (keys and values); ``peak_slots``: the most slots a row's attention
  read in one call.

Budgets are fractions of ``T`` (``budget_tokens = round(fraction * T)``);
``1.0`` keeps everything and equals the full cache. H2O and SnapKV cost one
backward pass of the paged kernel per layer and call
(``aj.paged_key_importance``); budgets are traced, so each policy compiles
once per shape.
"""

from __future__ import annotations

import functools
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from experiments import cache_accuracy
from experiments import eviction_model
from experiments import lm_model
from experiments import report

POLICIES = ("streaming", "h2o", "snapkv")
BUDGETS = (1 / 2, 1 / 4, 1 / 8)
FULL = "full"


def _bits(logits, targets):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return (-jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
          / math.log(2))


def _kind(policy: str) -> str:
  """The compiled program a policy runs: the full cache is StreamingLLM
  with a budget of every token (it never evicts); H2O and SnapKV share one
  that scores keys, the policy a traced flag (four programs in all)."""
  return "scored" if policy in ("h2o", "snapkv") else "plain"


def _keep_all(lengths, width):
  """A choice that keeps every slot where it is (``evict`` moves nothing)."""
  source = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32),
                            (lengths.shape[0], width))
  return source, lengths


def _evict_scored(model, scores, window_scores, budget, is_h2o, evicting,
                  o):
  """H2O's (``is_h2o``) or SnapKV's eviction of every layer where
  ``evicting`` (traced flags: a choice that keeps every slot otherwise);
  the scores each carries on (H2O's moved with their slots; SnapKV's reset
  after a compression)."""
  lengths = eviction_model.lengths(model)
  width = o["width"]
  choices, carried = [], []
  for s, w in zip(scores, window_scores):
    h2o = aj.h2o_keep(s, lengths, budget, recent=budget // 2, width=width)
    snap = aj.snapkv_keep(w, lengths, budget, window=o["window"],
                          kernel=o["kernel"], pooling=o["pooling"],
                          width=width)
    keep = _keep_all(lengths, width)
    source = jnp.where(is_h2o, h2o[0], snap[0])
    source = jnp.where(evicting, source,
                       jnp.broadcast_to(keep[0][:, None, :], source.shape))
    count = jnp.where(evicting, h2o[1], lengths)  # (h2o's = snapkv's count)
    choices.append((source, count))
    moved = aj.moved_scores(s, source, count)
    carried.append(jnp.where(is_h2o, moved,
                             jnp.where(evicting, 0.0, s)))
  eviction_model.evict(model, choices)
  return carried


def _evict_plain(model, budget, o):
  lengths = eviction_model.lengths(model)
  choice = aj.streaming_keep(lengths, budget, sinks=o["sinks"],
                             width=o["width"])
  eviction_model.evict(model, [choice] * len(model.blocks))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _prompt(graphdef, kind, o, cache, rest, inputs, real, budget, is_h2o):
  """Prefills ``inputs [R, P]`` (``real [R]``) and evicts to ``budget``;
  the scores the continuation starts from (scored: per layer ``[R, K,
  L]``)."""
  model = nnx.merge(graphdef, cache, rest)
  o = dict(o)
  rotary = eviction_model.positions(jnp.zeros_like(real), inputs.shape[1])
  if kind == "plain":
    model.decode(inputs, real, positions=rotary)
    _evict_plain(model, budget, o)
    return nnx.state(model, nnx.Cache), []
  _, queries = eviction_model.decode_with_queries(model, inputs, real,
                                                  rotary)
  every, window = ([eviction_model.layer_importance(b.attention, q, real,
                                                    last=last)
                    for b, q in zip(model.blocks, queries)]
                   for last in (None, o["window"]))
  scores = _evict_scored(model, every, window, budget, is_h2o, True, o)
  return nnx.state(model, nnx.Cache), scores


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _continue(graphdef, kind, o, cache, rest, scores, seen, inputs, targets,
              real, budget, is_h2o):
  """The continuation: ``inputs [R, C]`` one token per call (a scan), each
  at position ``seen + i`` (``real [R]``: 1, or 0 for a padding row), then
  the policy's eviction. ``(cache, bits [C, R], argmax [C, R], slots each
  call attended over [C, R])``."""
  o = dict(o)

  def step(carry, x):
    cache, scores, seen = carry
    i, token, target = x
    model = nnx.merge(graphdef, cache, rest)
    rotary = eviction_model.positions(seen, 1)
    if kind == "plain":
      logits = model.decode(token[:, None], real, positions=rotary)
      held = eviction_model.lengths(model)
      _evict_plain(model, budget, o)
    else:
      logits, new = eviction_model.decode_with_importance(
          model, token[:, None], real, rotary)
      held = eviction_model.lengths(model)
      scores = [s + n for s, n in zip(scores, new)]
      # SnapKV compresses every `window` tokens: its window is then the
      # `window` newest, whose queries' importance it has summed.
      evicting = is_h2o | ((i + 1) % o["window"] == 0)
      scores = _evict_scored(model, scores, scores, budget, is_h2o,
                             evicting, o)
    out = (_bits(logits[:, 0], target),
           jnp.argmax(logits[:, 0], -1).astype(jnp.int32), held)
    return (nnx.state(model, nnx.Cache), scores, seen + real), out

  steps = jnp.arange(inputs.shape[1])
  (cache, _, _), (bits, top, held) = jax.lax.scan(
      step, (cache, scores, seen), (steps, inputs.T, targets.T))
  return cache, bits, top, held


def _pool_bytes_per_slot(model: lm_model.DecoderLM) -> int:
  """Bytes of one slot in every layer's pools (keys, values, scales)."""
  total = 0
  for block in model.blocks:
    a = block.attention
    slots = a.cached_key[...].shape[0] * a.cached_key[...].shape[2]
    for var in (a.cached_key, a.cached_value, a.cache_key_scales,
                a.cache_value_scales):
      if var is not None:
        total += var[...].nbytes // slots
  return total


def budget_tokens(fraction: float, t: int) -> int:
  """Slots a budget of ``fraction`` of ``t`` tokens keeps (at least 1)."""
  return max(1, int(round(fraction * t)))


def full_rows(rows: cache_accuracy.Rows, max_rows: int | None
              ) -> cache_accuracy.Rows:
  """The rows of ``T`` full transitions (at most ``max_rows``).

  Raises:
    ValueError: none is full.
  """
  t = rows.tokens.shape[1] - 1
  keep = np.flatnonzero(rows.lengths == t)[:max_rows]
  if not keep.size:
    raise ValueError(f"no row has the full {t} transitions (lengths "
                     f"{sorted(set(rows.lengths.tolist()))}).")
  return cache_accuracy.Rows(rows.tokens[keep], rows.lengths[keep])


def evaluate(model: lm_model.DecoderLM, rows: cache_accuracy.Rows, *,
             budgets=BUDGETS, policies=POLICIES, page_size: int = 16,
             batch_rows: int = 32, max_rows: int | None = 64,
             prompt_fraction: float = 0.5, sinks: int = 4, window: int = 8,
             kernel: int = 7, pooling: str = "max") -> dict:
  """Reads ``rows`` through an evicting paged cache (the module doc).

  Args:
    model: the LM; its cache is replaced (``init_paged_cache``).
    rows: ``cache_accuracy.validation_rows(...)``: its full rows are read.
    budgets: fractions of ``T`` in ``(0, 1]``.
    policies: of ``POLICIES``.
    page_size: tokens per page.
    batch_rows: rows per call.
    max_rows: the first this many full rows (None: all).
    prompt_fraction: the prompt's share of a row, in ``(0, 1)``.
    sinks: StreamingLLM's attention sinks.
    window: SnapKV's observation window (and its compression period).
    kernel, pooling: SnapKV's pooling (``aj.snapkv_keep``).

  Returns:
    ``{"full": {...}, "streaming": {fraction: {...}}, ...}`` with
    ``bits_per_char``, ``greedy_agreement``, ``pages_at_end``,
    ``bytes_at_end``, ``peak_slots``, ``budget_tokens`` per entry, and
    ``"protocol"``: ``rows``, ``T``, ``prompt``, ``page_size``,
    ``predictions``, ``sinks``, ``window``, ``kernel``, ``pooling``.

  Raises:
    ValueError: a policy not in ``POLICIES``, a budget or prompt fraction
      out of range, no full row.
  """
  bad = [p for p in policies if p not in POLICIES]
  if bad:
    raise ValueError(f"policies must be among {POLICIES}, got {bad}.")
  if not all(0 < f <= 1 for f in budgets):
    raise ValueError(f"budgets must be fractions in (0, 1], got {budgets}.")
  rows = full_rows(rows, max_rows)
  t = rows.tokens.shape[1] - 1
  prompt = int(round(prompt_fraction * t))
  if not 0 < prompt < t:
    raise ValueError(f"prompt_fraction={prompt_fraction} leaves no prompt "
                     f"or no continuation of a {t}-token row.")
  max_pages = -(-t // page_size)
  width = max_pages * page_size
  o = tuple(sorted(dict(width=width, sinks=sinks, window=window,
                        kernel=kernel, pooling=pooling).items()))
  runs = [(FULL, 1.0)] + [(p, f) for p in policies for f in budgets]
  n = rows.tokens.shape[0]
  sums = {run: dict(bits=0.0, agree=0, pages=0, peak=0) for run in runs}
  for start in range(0, n, batch_rows):
    part = rows.tokens[start:start + batch_rows]
    r = part.shape[0]
    tokens = np.zeros((batch_rows, t + 1), np.int32)
    tokens[:r] = part
    real = (np.arange(batch_rows) < r).astype(np.int32)  # padding rows: 0
    reference = None
    for policy, fraction in runs:
      kind = _kind(policy)
      budget = jnp.int32(budget_tokens(fraction, t))
      is_h2o = jnp.bool_(policy == "h2o")
      model.init_paged_cache(batch_rows, batch_rows * max_pages, page_size,
                             max_pages)
      graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)
      cache, scores = _prompt(graphdef, kind, o, cache, rest,
                              tokens[:, :prompt], real * prompt, budget,
                              is_h2o)
      cache, bits, top, held = _continue(
          graphdef, kind, o, cache, rest, scores, jnp.asarray(real * prompt),
          tokens[:, prompt:t], tokens[:, prompt + 1:], jnp.asarray(real),
          budget, is_h2o)
      done = nnx.merge(graphdef, cache, rest)
      done.check_cache()
      top = np.asarray(top)[:, :r]  # [T - P, r]
      reference = top if reference is None else reference
      s = sums[(policy, fraction)]
      s["bits"] += float(np.asarray(bits)[:, :r].sum())
      s["agree"] += int((top == reference).sum())
      s["pages"] += int(done.pages_in_use())
      s["peak"] = max(s["peak"], int(np.asarray(held)[:, :r].max()))
  per_slot = _pool_bytes_per_slot(model)
  predictions = n * (t - prompt)
  results = {"protocol": dict(rows=n, T=t, prompt=prompt,
                              page_size=page_size, predictions=predictions,
                              sinks=sinks, window=window, kernel=kernel,
                              pooling=pooling, bytes_per_slot=per_slot)}
  for (policy, fraction), s in sums.items():
    entry = dict(budget_tokens=budget_tokens(fraction, t),
                 bits_per_char=s["bits"] / predictions,
                 greedy_agreement=s["agree"] / predictions,
                 pages_at_end=s["pages"] / n,
                 bytes_at_end=s["pages"] / n * page_size * per_slot,
                 peak_slots=s["peak"])
    if policy == FULL:
      results[FULL] = entry
    else:
      results.setdefault(policy, {})[fraction] = entry
  return results


_NAMES = {FULL: "full cache", "streaming": "StreamingLLM", "h2o": "H2O",
          "snapkv": "SnapKV"}


def section(results: dict) -> list[str]:
  """The serve report's section: the protocol in a paragraph and one table
  row per policy and budget (the full cache first)."""
  p, full = results["protocol"], results[FULL]
  rows = [[_NAMES[FULL], f"{p['T']} (all)", full["bits_per_char"], "100%",
           f"{full['pages_at_end']:.2f}", f"{full['bytes_at_end'] / 1024:.1f}",
           "1.000", full["peak_slots"]]]
  for policy in POLICIES:
    for fraction, e in results.get(policy, {}).items():
      rows.append([
          _NAMES[policy], f"{e['budget_tokens']} ({float(fraction):g})",
          e["bits_per_char"], f"{100 * e['greedy_agreement']:.2f}%",
          f"{e['pages_at_end']:.2f}", f"{e['bytes_at_end'] / 1024:.1f}",
          f"{e['bytes_at_end'] / full['bytes_at_end']:.3f}",
          e["peak_slots"]])
  return [
      "## Evicting keys\n",
      f"{p['rows']} validation rows of {p['T']} transitions: the first "
      f"{p['prompt']} prefilled as a prompt, then one token per call "
      f"(teacher forcing); bits/char and greedy agreement (argmax equal to "
      f"the full cache's) over the {p['predictions']} continuation "
      f"predictions. After the prompt each policy evicts to its budget "
      f"(a share of the {p['T']} tokens); StreamingLLM ({p['sinks']} sinks "
      f"+ newest) and H2O (half newest, half heaviest accumulated "
      f"attention per layer and KV head) again after every token; SnapKV "
      f"(window {p['window']}, {p['pooling']}-pooled over {p['kernel']}) "
      f"compresses after the prompt and every {p['window']} tokens, so it "
      f"holds up to budget + {p['window']} slots in between. Pages of "
      f"{p['page_size']} tokens held per row after the last token, their "
      f"bytes over every layer; peak slots: the most a call attended "
      "over.\n",
      report.markdown_table(
          ["cache", "budget (tokens, share)", "bits/char",
           "greedy agreement", "pages per row at end", "KiB per row at end",
           "bytes vs full", "peak slots"], rows) + "\n"]


def plot(results: dict, path: str) -> None:
  """Bits/char against the budget, one line per policy, the full cache a
  horizontal line (a PNG at ``path``)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(6, 4))
  for policy in POLICIES:
    entries = results.get(policy)
    if not entries:
      continue
    fractions = sorted(entries, key=float)
    ax.plot([entries[f]["budget_tokens"] for f in fractions],
            [entries[f]["bits_per_char"] for f in fractions], marker="o",
            label=_NAMES[policy])
  full = results[FULL]
  ax.axhline(full["bits_per_char"], color="0.3", linestyle="--",
             linewidth=1.0, label=f"{_NAMES[FULL]} ({full['budget_tokens']})")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("budget (slots kept per row, every layer)")
  ax.set_ylabel("bits per character (continuation)")
  ax.set_title("Evicting keys from a paged cache")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
