"""Continuous batching over a paged KV cache, against static padded batches.

``python run.py --experiment=serve`` serves one workload of text requests
with the LM experiment's ``lm_model.DecoderLM`` in two systems, greedy
decoding in both:

* ``paged`` (continuous batching): ``slots`` rows share one pool of
  ``num_pages`` pages of ``page_size`` tokens per layer
  (``DecoderLM.init_paged_cache``). A host-side scheduler runs a step of
  at most two jitted model calls: it releases the rows that finished in
  the step before (their pages return to the pool), admits waiting
  requests into free rows while the pool's unreserved pages cover the
  request's prompt and its output (so no write can overflow and nothing is
  preempted), then the rows still in their prompt prefill their next
  ``prefill_chunk`` tokens in one call over those rows alone (``rows``:
  the cache's other rows are not computed; their count bucketed to a
  power of two), and the rows with a token decode one more in one call
  over all rows (``lengths`` 0 for the others). Each row's next token is
  the argmax at its last real position.
* ``static`` (the baseline, today's padded linear cache): batches of up to
  ``slots`` waiting requests in arrival order, each batch's cache
  ``init_cache(slots, L)`` for its longest prompt plus its longest output,
  one ragged prefill, then one decode call per token until the batch's
  longest output is done; nothing joins a batch once it started.

Requests arrive at model steps drawn from a Poisson process of
``arrival_rate`` requests per step (seeded); each system counts its own
steps (a static call is a step; an idle system skips to the next
arrival), so the schedules are deterministic and a request's arrival time
is the wall time at which its system reached that step. Prompts are
``[BOS]`` and a random stretch of a validation document (``lm_data``), of
a random length; each request asks for a random number of tokens (no stop
token). Both lengths are drawn ``log_uniform`` by default (as many
requests of 16-64 tokens as of 256-1024: most short, a few long, as in
chat traffic) or ``uniform`` (``lengths``).

Every request's tokens are checked against generating it alone (greedy,
``init_cache(1, L)``, a ragged prefill, then one ``decode`` per token). Each
system first runs the workload once to compile every shape it meets (prompt
lengths bucketed to powers of two, static cache lengths to multiples of
``STATIC_LENGTH_MULTIPLE``, so there are few); then ``timed_passes``
rounds time one pass of each system in turns, and each system's median
pass is reported (with the ratio round by round); every pass must give the
same tokens.

The model is the LM experiment's ``segments`` checkpoint
(``serve_lm_checkpoint``) when it was written with the same settings
(``--lm_*`` model flags, ``--seed``, the LM's default budget) and finished
training; otherwise one is trained here for ``serve_steps`` steps of the
LM's batches and loss (checkpointed in the workdir: a rerun restores it).

With ``drafts`` (``--serve_drafts``, default ``ngram,model``), each draft
is one more system: continuous batching whose decoding step drafts a tree
per row (``speculative``: prompt lookup, or a small draft model trained
here for ``draft_steps``) and verifies every row's tree in one call
(``_verify_step``: tree mask, greedy acceptance, the accepted path kept in
the cache and the rest dropped), timed in the same rounds as the others;
its tokens are checked against the alone generation like theirs.

Then the validation text is read through a float32, bfloat16, int8 and
float8_e4m3fn paged cache (``cache_accuracy``): bits per character, greedy
agreement with the float32 cache, each layer's attention error and the
cache bytes per token; and through a paged cache that evicts down to a
budget (``eviction_accuracy``: StreamingLLM, H2O, SnapKV at 1/2, 1/4 and
1/8 of each row) against the full cache.

Writes ``results.json`` (every number, every request), ``report.md`` (also
printed), ``pages_in_use.png`` and ``eviction.png`` to the workdir (default
``runs/serve``).
Raises ``RuntimeError`` after writing them if a request's tokens differ
from its alone generation beyond a near tie (``lm_generate.LOGIT_TOL``).

Shape glossary: B rows (``slots``), T new tokens per row in one call, P
prompt tokens (BOS included), G generated tokens, L linear cache length, Z
page size, M pages one row may hold, V vocabulary size.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from experiments import cache_accuracy
from experiments import checkpoints
from experiments import config_flags
from experiments import eviction_accuracy
from experiments import lm
from experiments import lm_data
from experiments import lm_generate
from experiments import lm_model
from experiments import report
from experiments import serve_plots
from experiments import speculative
from experiments import training

# Static (and alone) cache lengths are rounded up to a multiple of this, so
# batches of similar lengths reuse one compiled program.
STATIC_LENGTH_MULTIPLE = 64

# How a request's prompt and output lengths are drawn in [low, high].
LENGTH_DISTRIBUTIONS = ("log_uniform", "uniform")

_TRAIN_FLAGS = {k: v for k, v in config_flags.training_flags(
    "serve", "training steps when no LM checkpoint is loaded.",
    "rows per training batch.").items() if k != "mesh"}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """What ``python run.py --experiment=serve`` runs; flagged fields are
  flags (the model's are the LM experiment's ``--lm_*``)."""
  workdir: str = config_flags.field("runs/serve", config_flags.WORKDIR)
  requests: int = config_flags.field(
      32, "serve: requests in the workload.", name="serve_requests",
      lower_bound=1)
  min_prompt: int = config_flags.field(
      16, "serve: shortest prompt, in tokens (BOS included).",
      name="serve_min_prompt", lower_bound=1, not_above="max_prompt")
  max_prompt: int = config_flags.field(
      1024, "serve: longest prompt, in tokens (BOS included).",
      name="serve_max_prompt", lower_bound=1)
  min_output: int = config_flags.field(
      16, "serve: fewest tokens a request generates.",
      name="serve_min_output", lower_bound=1, not_above="max_output")
  max_output: int = config_flags.field(
      256, "serve: most tokens a request generates.",
      name="serve_max_output", lower_bound=1)
  lengths: str = config_flags.field(
      "log_uniform", "serve: how prompt and output lengths are drawn "
      "between their bounds: log_uniform (most requests short, a few long: "
      "the heavy tail of chat traffic) or uniform.", name="serve_lengths",
      choices=LENGTH_DISTRIBUTIONS)
  arrival_rate: float = config_flags.field(
      0.25, "serve: mean requests arriving per model step (Poisson "
      "arrivals, seeded by --seed).", name="serve_arrival_rate",
      lower_bound=1e-3)
  slots: int = config_flags.field(
      8, "serve: rows served at once (the paged cache's rows, the static "
      "baseline's batch).", name="serve_slots", lower_bound=1)
  page_size: int = config_flags.field(
      64, "serve: tokens per page of the paged cache.",
      name="serve_page_size", lower_bound=1)
  num_pages: int = config_flags.field(
      48, "serve: pages in the paged cache's pool (each layer has one).",
      name="serve_num_pages", lower_bound=1)
  prefill_chunk: int = config_flags.field(
      256, "serve: most prompt tokens a row prefills in one step (0: its "
      "whole prompt at once).", name="serve_prefill_chunk", lower_bound=0)
  drafts: str = config_flags.field(
      "ngram,model", "serve: speculative decoding's drafts, each served as "
      "one more system (continuous batching that verifies a drafted tree per "
      "row in one call): ngram (prompt lookup), model (a small DecoderLM "
      "trained here); empty: none.", name="serve_drafts")
  draft_width: int = config_flags.field(
      2, "serve: branches of a drafted tree (the draft's top-k at the "
      "root, or distinct prompt-lookup continuations).",
      name="serve_draft_width", lower_bound=1)
  draft_depth: int = config_flags.field(
      4, "serve: drafted tokens per branch.", name="serve_draft_depth",
      lower_bound=1)
  draft_steps: int = config_flags.field(
      1000, "serve: training steps of the draft model (the LM's batches; "
      "checkpointed in the workdir).", name="serve_draft_steps",
      lower_bound=1)
  timed_passes: int = config_flags.field(
      3, "serve: timed passes of the workload per system, paged and static "
      "in turns after one compiling pass each; the median pass (by wall "
      "time) is reported, the spread of the rounds beside it.",
      name="serve_timed_passes", lower_bound=1)
  accuracy_rows: int = config_flags.field(
      0, "serve: validation rows (of --lm seq_len transitions) read through "
      "a float32, bfloat16, int8 and float8_e4m3fn paged cache for the "
      "accuracy table (0: every row, all the validation text).",
      name="serve_accuracy_rows", lower_bound=0)
  eviction_rows: int = config_flags.field(
      64, "serve: full validation rows (of --lm seq_len tokens) read with "
      "each eviction policy and budget (0: every full row).",
      name="serve_eviction_rows", lower_bound=0)
  lm_checkpoint: str = config_flags.field(
      os.path.join("runs", "lm", "checkpoints", "segments"),
      "serve: the LM experiment's segments checkpoint, loaded when it was "
      "written with these --lm_* model flags and --seed and the LM's "
      "default budget, and finished; otherwise a model is trained here "
      "(--serve_steps). Empty: always train.", name="serve_lm_checkpoint")
  model: lm_model.LMModelConfig = lm_model.LMModelConfig()
  train: training.TrainConfig = config_flags.nested(
      training.TrainConfig(steps=200, batch_size=16, learning_rate=3e-3,
                           checkpoint_every=0, log_every=20),
      expose=_TRAIN_FLAGS)
  seq_len: int = 128  # training rows, as the LM experiment's default
  valid_fraction: float = 0.2  # of the documents, as the LM's


# ---------------------------------------------------------------------------
# The workload


@dataclasses.dataclass(frozen=True)
class Request:
  """One request of the workload.

  Attributes:
    index: its place in arrival order.
    arrival: the model step at which it arrives.
    prompt: int32 ``[P]``, BOS first.
    max_tokens: ``G``, the greedy tokens it generates.
    document: the validation document its prompt comes from.
  """
  index: int
  arrival: int
  prompt: np.ndarray
  max_tokens: int
  document: str

  def cache_tokens(self) -> int:
    """Tokens its cache holds at the end: the prompt and every generated
    token but the last (which is never fed back)."""
    return len(self.prompt) + self.max_tokens - 1


def workload(config: ServeConfig, corpus: lm_data.Corpus) -> list[Request]:
  """The requests, a pure function of ``config`` and the corpus.

  Raises:
    ValueError: no validation document is long enough for ``max_prompt``.
  """
  rng = np.random.default_rng([config.train.seed, 7])
  n = config.requests
  gaps = rng.exponential(1.0 / config.arrival_rate, n)
  arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)  # first at 0
  prompt_lengths = draw_lengths(rng, config.lengths, config.min_prompt,
                                config.max_prompt, n)
  outputs = draw_lengths(rng, config.lengths, config.min_output,
                         config.max_output, n)
  docs = lm.documents_of(corpus.valid)  # each [BOS, c_1, ...]
  longest = max(len(d) for d in docs)
  if config.max_prompt > longest:
    raise ValueError(
        f"max_prompt={config.max_prompt} is longer than the longest "
        f"validation document ({longest} tokens with BOS).")
  requests = []
  for i in range(n):
    p = int(prompt_lengths[i])
    eligible = [j for j, d in enumerate(docs) if len(d) >= p]
    j = eligible[int(rng.integers(len(eligible)))]
    start = 1 + int(rng.integers(len(docs[j]) - p + 1))  # after BOS
    prompt = np.concatenate([[lm_data.BOS], docs[j][start:start + p - 1]])
    requests.append(Request(i, int(arrivals[i]), prompt.astype(np.int32),
                            int(outputs[i]), corpus.valid_names[j]))
  return requests


def draw_lengths(rng: np.random.Generator, distribution: str, low: int,
                 high: int, n: int) -> np.ndarray:
  """``n`` int lengths in ``[low, high]``: ``"uniform"``, or
  ``"log_uniform"`` (uniform in log length: as many requests in 16-64 as
  in 256-1024, so the mean is far below the midpoint, as in chat traffic,
  where most requests are short and a few long)."""
  if distribution == "uniform":
    return rng.integers(low, high + 1, n)
  if distribution == "log_uniform":
    x = np.exp(rng.uniform(np.log(low), np.log(high + 1), n))
    return np.clip(np.floor(x).astype(int), low, high)
  raise ValueError(f"distribution must be one of {LENGTH_DISTRIBUTIONS}, "
                   f"got {distribution!r}.")


def bucket(n: int, cap: int) -> int:
  """The smallest power of two ``>= n``, at most ``cap`` (``>= n``): padded
  lengths from a few shapes, so a jitted step compiles a few times."""
  return min(1 << max(0, n - 1).bit_length(), cap)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pages_needed(request: Request, page_size: int, extra: int = 0) -> int:
  """Pages a request may hold: its cache tokens, plus ``extra`` slots a
  drafted tree takes beyond them before verification drops its rejects."""
  return -(-(request.cache_tokens() + extra) // page_size)


DRAFTS = ("ngram", "model")


def drafts(config: ServeConfig) -> list[str]:
  """The drafts named by ``--serve_drafts`` (ValueError for another)."""
  names = [d.strip() for d in config.drafts.split(",") if d.strip()]
  for name in names:
    if name not in DRAFTS:
      raise ValueError(f"--serve_drafts names {name!r}; the drafts are "
                       f"{DRAFTS} (comma-separated, or empty for none).")
  return names


def tree_nodes(config: ServeConfig) -> int:
  """Most nodes a drafted tree has (root included); 0 without drafts."""
  return 1 + config.draft_width * config.draft_depth if drafts(config) else 0


def max_pages(config: ServeConfig) -> int:
  """``M``: pages of the longest request the config allows (and, with
  drafts, of the tree it verifies beyond its tokens)."""
  return -(-(config.max_prompt + config.max_output - 1 + tree_nodes(config))
           // config.page_size)


def check_config(config: ServeConfig) -> None:
  """Refuses settings the workload cannot be served with.

  Raises:
    ValueError: naming the setting.
  """
  if config.min_prompt > config.max_prompt:
    raise ValueError(f"min_prompt={config.min_prompt} exceeds max_prompt="
                     f"{config.max_prompt}.")
  if config.min_output > config.max_output:
    raise ValueError(f"min_output={config.min_output} exceeds max_output="
                     f"{config.max_output}.")
  if max_pages(config) > config.num_pages:
    raise ValueError(
        f"num_pages={config.num_pages} cannot hold the longest request the "
        f"config allows: {config.max_prompt} + {config.max_output} - 1 "
        f"tokens (+ {tree_nodes(config)} drafted tree nodes) need "
        f"{max_pages(config)} pages of {config.page_size}.")


# ---------------------------------------------------------------------------
# Jitted model calls. The state is split into the caches (donated: updated
# in place) and everything else (the parameters).


def split(model: nnx.Module):
  """``(graphdef, caches, rest)``."""
  return nnx.split(model, nnx.Cache, ...)


@functools.lru_cache(maxsize=4)
def programs(graphdef) -> tuple:
  """``(paged_step, linear_step)`` jitted for this model, the caches
  donated (updated in place). The graph definition is bound here, once: as
  a static argument it would be hashed on every call, which cost this
  model's decode step more host time than its computation."""
  return tuple(jax.jit(functools.partial(step, graphdef), donate_argnums=0)
               for step in (_paged_step, _linear_step))


@functools.lru_cache(maxsize=4)
def verify_program(graphdef, depth: int):
  """``_verify_step`` jitted for this model and tree depth, both bound (as
  static arguments they would send every call through jit's slow path)."""
  return jax.jit(functools.partial(_verify_step, graphdef, depth=depth),
                 donate_argnums=0)


def _paged_step(graphdef, cache, rest, done, tokens, lengths, rows):
  """Releases the rows ``done [B]``, then appends ``tokens [R, T]``
  (``lengths [R]`` real) to the cache rows ``rows [R]`` (None: all ``B``);
  the argmax at each row's last real token ``[R]``, the pages in use and
  the first layer's page table ``[B, M]``."""
  model = nnx.merge(graphdef, cache, rest)
  model.release(done)
  logits = model.decode(tokens, lengths, rows=rows)  # [R, T, V]
  last = logits[jnp.arange(tokens.shape[0]), jnp.maximum(lengths - 1, 0)]
  table = model.blocks[0].attention.cache_page_table[...]
  return (nnx.state(model, nnx.Cache), jnp.argmax(last, -1).astype(jnp.int32),
          model.pages_in_use(), table)


def _verify_step(graphdef, cache, rest, done, tokens, parents, lengths,
                 depth):
  """Releases the rows ``done [B]``, then verifies each row's drafted tree
  (``tokens``/``parents [B, T]``, ``lengths [B]`` nodes, 0: idle) in one
  call and keeps its accepted path in the cache (``speculative``'s module
  doc): the path ``[B, depth + 1]``, its node count ``[B]``, the target's
  next token after every node ``[B, T]``, the pages in use and the first
  layer's page table."""
  model = nnx.merge(graphdef, cache, rest)
  model.release(done)
  prefix = model.blocks[0].attention.cache_index[...]  # [B]
  logits = model.decode(tokens, lengths, parents=parents)  # [B, T, V]
  nxt = jnp.argmax(logits, -1).astype(jnp.int32)
  path, count = aj.greedy_accept(tokens, parents, lengths, nxt, depth)
  model.move_slots(prefix, prefix[:, None] + path, count)
  table = model.blocks[0].attention.cache_page_table[...]
  return (nnx.state(model, nnx.Cache), path, count, nxt,
          model.pages_in_use(), table)


def _linear_step(graphdef, cache, rest, tokens, lengths):
  """Appends ``tokens [B, T]`` to a linear cache (``lengths [B]`` real per
  row, or None: all); the argmax ``[B]`` and logits ``[B, V]`` at each row's
  last real token."""
  model = nnx.merge(graphdef, cache, rest)
  logits = model.decode(tokens, lengths)  # [B, T, V]
  at = (jnp.full(tokens.shape[:1], tokens.shape[1] - 1) if lengths is None
        else jnp.maximum(lengths - 1, 0))
  last = logits[jnp.arange(tokens.shape[0]), at]  # [B, V]
  return (nnx.state(model, nnx.Cache), jnp.argmax(last, -1).astype(jnp.int32),
          last)


# ---------------------------------------------------------------------------
# Serving


class _Clock:
  """Wall time since the pass started, and arrivals by model step: each
  request gets the wall time at which its step was reached."""

  def __init__(self, requests: list[Request], records: list[dict]):
    self.requests, self.records = requests, records
    self.next = 0
    self.t0 = time.perf_counter()

  def now(self) -> float:
    return time.perf_counter() - self.t0

  def arrive(self, step: int, queue: collections.deque) -> None:
    now = self.now()
    while (self.next < len(self.requests)
           and self.requests[self.next].arrival <= step):
      self.records[self.next]["arrival_s"] = now
      queue.append(self.next)
      self.next += 1

  def next_arrival(self) -> int:
    return self.requests[self.next].arrival


def _new_records(requests: list[Request]) -> list[dict]:
  return [{"index": r.index, "arrival_step": r.arrival,
           "prompt_tokens": len(r.prompt), "max_tokens": r.max_tokens,
           "tokens": []} for r in requests]


def serve_paged(model: lm_model.DecoderLM, requests: list[Request],
                config: ServeConfig, draft=None) -> dict:
  """Continuous batching over a fresh paged cache (see the module doc).

  With a ``draft`` (``speculative.NgramDraft`` or ``ModelDraft``) each
  decoding step drafts a tree per decoding row and verifies all of them in
  one call over all rows (``_verify_step``), emitting each row's accepted
  tokens and the target's next one.

  Returns:
    ``{"records": per request (steps, times, tokens, row, pages held; with
    a draft the tokens each verification emitted), "log": per step,
    "wall_s", "steps", "token_rows", "pages_in_use_at_end",
    "pages_blocked_steps"}``.
  """
  b, z = config.slots, config.page_size
  chunk = config.prefill_chunk or config.max_prompt
  model.init_paged_cache(b, config.num_pages, z, max_pages(config))
  graphdef, cache, rest = split(model)
  paged_step, _ = programs(graphdef)
  verify_step = None if draft is None else verify_program(graphdef,
                                                          draft.depth)
  records = _new_records(requests)
  queue, rows = collections.deque(), [None] * b
  done = np.zeros(b, bool)
  reserved, finished, step, token_rows, blocked = 0, 0, 0, 0, 0
  log = []
  extra = 0 if draft is None else draft.max_nodes
  clock = _Clock(requests, records)
  while finished < len(requests):
    clock.arrive(step, queue)
    if not queue and all(r is None for r in rows):
      step = clock.next_arrival()  # idle: nothing to run until then
      continue
    for row in range(b):
      if rows[row] is None and queue:
        need = pages_needed(requests[queue[0]], z, extra)
        if reserved + need > config.num_pages:
          blocked += 1  # a free row, but the pool is reserved
          break
        i = queue.popleft()
        reserved += need
        rows[row] = {"request": i, "fed": 0}
        records[i].update(admit_step=step, row=row)
    reserved_in_step = reserved
    # Rows still in their prompt prefill in one call over those rows alone
    # (cache_rows: nobody else is computed); rows with a token decode in
    # one call over all B rows (T = 1; the others append nothing).
    prefilling = [row for row, a in enumerate(rows) if a is not None
                  and a["fed"] < len(requests[a["request"]].prompt)]
    decoding = [row for row, a in enumerate(rows) if a is not None
                and a["fed"] >= len(requests[a["request"]].prompt)]
    calls, emitted = [], {}
    if prefilling:
      r = bucket(len(prefilling), b)
      # Padding entries: other rows (distinct, as cache_rows needs) that
      # append nothing.
      picked = prefilling + [row for row in range(b)
                             if row not in prefilling][:r - len(prefilling)]
      feeds = {}
      for row in prefilling:
        active = rows[row]
        prompt = requests[active["request"]].prompt
        feeds[row] = prompt[active["fed"]:active["fed"] + chunk]
      t = bucket(max(len(f) for f in feeds.values()), chunk)
      tokens = np.full((r, t), lm_data.PAD, np.int32)
      lengths = np.zeros(r, np.int32)
      for i, row in enumerate(prefilling):
        tokens[i, :len(feeds[row])] = feeds[row]
        lengths[i] = len(feeds[row])
      before = clock.now()
      cache, nxt, in_use, table = paged_step(
          cache, rest, jnp.asarray(done), jnp.asarray(tokens),
          jnp.asarray(lengths), jnp.asarray(picked, np.int32))
      nxt, in_use = np.asarray(nxt), int(in_use)
      calls.append({"rows": r, "T": t, "s": clock.now() - before})
      token_rows += r * t
      done = np.zeros(b, bool)
      for i, row in enumerate(prefilling):
        active = rows[row]
        active["fed"] += len(feeds[row])
        if active["fed"] >= len(requests[active["request"]].prompt):
          emitted[row] = int(nxt[i])  # the prompt's last token: a token
    if decoding and draft is not None:
      before = clock.now()
      trees = [None] * b
      histories = [np.concatenate([
          requests[rows[row]["request"]].prompt,
          records[rows[row]["request"]]["tokens"]]).astype(np.int32)
                   for row in decoding]
      for row, tree in zip(decoding, draft.trees(histories)):
        trees[row] = tree
      drafted = clock.now() - before
      tokens, parents, lengths = speculative.pad_trees(trees, draft.max_nodes)
      cache, path, count, nxt, in_use, table = verify_step(
          cache, rest, jnp.asarray(done), jnp.asarray(tokens),
          jnp.asarray(parents), jnp.asarray(lengths))
      path, count, nxt = np.asarray(path), np.asarray(count), np.asarray(nxt)
      in_use = int(in_use)
      calls.append({"rows": b, "T": draft.max_nodes,
                    "s": clock.now() - before, "draft_s": drafted})
      token_rows += b * draft.max_nodes
      done = np.zeros(b, bool)
      for row in decoding:
        kept = path[row, :count[row]]
        record = records[rows[row]["request"]]
        emitted[row] = [int(tokens[row, i]) for i in kept[1:]] + [
            int(nxt[row, kept[-1]])]
        record.setdefault("accepted", []).append(len(kept) - 1)
        record.setdefault("tree_nodes", []).append(int(lengths[row]))
    elif decoding:
      tokens = np.full((b, 1), lm_data.PAD, np.int32)
      lengths = np.zeros(b, np.int32)
      for row in decoding:
        tokens[row, 0] = records[rows[row]["request"]]["tokens"][-1]
        lengths[row] = 1
      before = clock.now()
      cache, nxt, in_use, table = paged_step(
          cache, rest, jnp.asarray(done), jnp.asarray(tokens),
          jnp.asarray(lengths), None)
      nxt, in_use = np.asarray(nxt), int(in_use)
      calls.append({"rows": b, "T": 1, "s": clock.now() - before})
      token_rows += b
      done = np.zeros(b, bool)
      emitted.update({row: int(nxt[row]) for row in decoding})
    now = clock.now()
    for row, new in emitted.items():
      active = rows[row]
      i = active["request"]
      record = records[i]
      # A verified tree emits several tokens: those past the request's
      # budget are dropped (its row is released next step).
      room = requests[i].max_tokens - len(record["tokens"])
      new = [new] if isinstance(new, int) else new
      record["tokens"].extend(new[:room])
      if len(record["tokens"]) == len(new[:room]):
        record.update(first_token_step=step, first_token_s=now)
      if len(record["tokens"]) == requests[i].max_tokens:
        held = np.asarray(table)[row]
        record.update(finish_step=step, finish_s=now,
                      pages=held[held < config.num_pages].tolist())
        rows[row], done[row] = None, True
        reserved -= pages_needed(requests[i], z, extra)
        finished += 1
    log.append({"step": step, "calls": calls, "seconds": now,
                "call_s": sum(c["s"] for c in calls),
                "active": len(prefilling) + len(decoding),
                "prefilling": len(prefilling), "decoding": len(decoding),
                "waiting": len(queue), "pages_in_use": in_use,
                "pages_reserved": reserved_in_step})
    step += 1
  wall = clock.now()
  # The last finished rows: release them (a T = 1 call appending nothing).
  cache, _, in_use, _ = paged_step(
      cache, rest, jnp.asarray(done),
      jnp.zeros((b, 1), jnp.int32), jnp.zeros(b, jnp.int32), None)
  nnx.update(model, cache)
  model.check_cache()
  return {"records": records, "log": log, "wall_s": wall, "steps": step,
          "token_rows": token_rows, "pages_in_use_at_end": int(in_use),
          "pages_blocked_steps": blocked}


def serve_static(model: lm_model.DecoderLM, requests: list[Request],
                 config: ServeConfig) -> dict:
  """Static batches over a padded linear cache (see the module doc).

  Returns:
    ``{"records", "log", "wall_s", "steps", "token_rows", "batches": [{"requests",
    "length", "allocated_length", "start_step"}]}``.
  """
  b = config.slots
  records = _new_records(requests)
  queue = collections.deque()
  finished, step, token_rows, log, batches = 0, 0, 0, [], []
  clock = _Clock(requests, records)
  while finished < len(requests):
    clock.arrive(step, queue)
    if not queue:
      step = clock.next_arrival()
      continue
    batch = [queue.popleft() for _ in range(min(b, len(queue)))]
    longest_prompt = max(len(requests[i].prompt) for i in batch)
    longest_output = max(requests[i].max_tokens for i in batch)
    length = longest_prompt + longest_output - 1  # what every row may reach
    allocated = _round_up(length, STATIC_LENGTH_MULTIPLE)
    batches.append({"requests": batch, "length": length,
                    "allocated_length": allocated, "start_step": step})
    model.init_cache(b, allocated)
    graphdef, cache, rest = split(model)
    _, linear_step = programs(graphdef)
    t = bucket(longest_prompt, allocated)
    tokens = np.full((b, t), lm_data.PAD, np.int32)
    lengths = np.zeros(b, np.int32)
    for row, i in enumerate(batch):
      prompt = requests[i].prompt
      tokens[row, :len(prompt)], lengths[row] = prompt, len(prompt)
      records[i].update(admit_step=step, row=row)
    before = clock.now()
    cache, nxt, _ = linear_step(cache, rest, jnp.asarray(tokens),
                                 jnp.asarray(lengths))
    token_rows += b * t
    for k in range(longest_output):
      if k:  # feed every row's last token (finished rows too: padding)
        clock.arrive(step, queue)
        before = clock.now()
        cache, nxt, _ = linear_step(cache, rest,
                                     jnp.asarray(nxt)[:, None], None)
        token_rows += b
      nxt_host = np.asarray(nxt)
      now = clock.now()
      for row, i in enumerate(batch):
        record = records[i]
        if len(record["tokens"]) < requests[i].max_tokens:
          record["tokens"].append(int(nxt_host[row]))
          if len(record["tokens"]) == 1:
            record.update(first_token_step=step, first_token_s=now)
          if len(record["tokens"]) == requests[i].max_tokens:
            record.update(finish_step=step, finish_s=now)
            finished += 1
      call = {"rows": b, "T": t if k == 0 else 1, "s": now - before}
      log.append({"step": step, "calls": [call], "seconds": now,
                  "call_s": now - before, "cache_tokens": b * length,
                  "allocated_tokens": b * allocated, "waiting": len(queue)})
      step += 1
    nnx.update(model, cache)
    model.check_cache()
  return {"records": records, "log": log, "wall_s": clock.now(),
          "steps": step, "token_rows": token_rows, "batches": batches}


def generate_alone(model: lm_model.DecoderLM, requests: list[Request]
                   ) -> list[dict]:
  """Each request generated alone: ``init_cache(1, L)``, a ragged prefill,
  then one ``decode`` call per token (greedy). ``{"tokens", "logits"
  [G, V]}`` per request."""
  length = _round_up(max(r.cache_tokens() for r in requests),
                     STATIC_LENGTH_MULTIPLE)
  out = []
  for request in requests:
    model.init_cache(1, length)
    graphdef, cache, rest = split(model)
    _, linear_step = programs(graphdef)
    p = len(request.prompt)
    tokens = np.full((1, bucket(p, length)), lm_data.PAD, np.int32)
    tokens[0, :p] = request.prompt
    cache, nxt, logits = linear_step(cache, rest,
                                      jnp.asarray(tokens),
                                      jnp.asarray([p], jnp.int32))
    got, rows = [nxt], [logits]
    for _ in range(request.max_tokens - 1):
      cache, nxt, logits = linear_step(cache, rest,
                                        nxt[:, None], None)
      got.append(nxt)
      rows.append(logits)
    nnx.update(model, cache)
    model.check_cache()
    out.append({"tokens": np.concatenate([np.asarray(g) for g in got]),
                "logits": np.concatenate([np.asarray(r) for r in rows])})
  return out


def compare(records: list[dict], alone: list[dict]) -> dict:
  """Each request's tokens against its alone generation.

  A request whose tokens first differ where the alone logits of both picks
  are within ``lm_generate.LOGIT_TOL`` is a near tie (float rounding may
  pick either); any other difference is a mismatch.

  Returns:
    ``{"requests", "matching", "near_ties": [index, ...], "mismatches":
    [index, ...]}``.
  """
  matching, ties, mismatches = 0, [], []
  for record, ref in zip(records, alone):
    got, want = np.asarray(record["tokens"]), ref["tokens"]
    if len(got) == len(want) and np.array_equal(got, want):
      matching += 1
      continue
    n = min(len(got), len(want))
    first = int(np.argmin(got[:n] == want[:n])) if n else 0
    if n and got[first] != want[first]:
      row = ref["logits"][first]
      gap = float(row[want[first]] - row[got[first]])
      if gap <= lm_generate.LOGIT_TOL:
        ties.append(record["index"])
        continue
    mismatches.append(record["index"])
  return {"requests": len(records), "matching": matching,
          "near_ties": ties, "mismatches": mismatches}


# ---------------------------------------------------------------------------
# Metrics


def _stats(values) -> dict:
  values = np.asarray(values, np.float64)
  if not len(values):
    return {"mean": None, "p50": None, "p90": None}
  return {"mean": float(values.mean()),
          "p50": float(np.percentile(values, 50)),
          "p90": float(np.percentile(values, 90))}


def _call_ms(log: list[dict]) -> dict:
  """``{"RxT": {"calls", "mean_ms"}}``: model calls by their padded shape
  (``R`` rows of ``T`` new tokens), host scheduling excluded."""
  by = collections.defaultdict(list)
  for s in log:
    for c in s["calls"]:
      by[c["rows"], c["T"]].append(c["s"])
  return {f"{r}x{t}": {"calls": len(v), "mean_ms": 1000 * float(np.mean(v))}
          for (r, t), v in sorted(by.items())}


def cache_bytes_per_token(model: lm_model.DecoderLM) -> int:
  """Keys and values of one token in every layer: ``K * H * 2 * bytes * layers``."""
  attention = model.blocks[0].attention
  dtype = attention.dtype or attention.param_dtype
  return (attention.num_kv_heads * attention.head_dim * 2
          * jnp.dtype(dtype).itemsize * len(model.blocks))


def metrics(run: dict, requests: list[Request]) -> dict:
  """Throughput and latencies of one timed pass."""
  records = run["records"]
  generated = sum(len(r["tokens"]) for r in records)
  ttft = [r["first_token_s"] - r["arrival_s"] for r in records]
  ttft_steps = [r["first_token_step"] - r["arrival_step"] + 1
                for r in records]
  tpot = [(r["finish_s"] - r["first_token_s"]) / (len(r["tokens"]) - 1)
          for r in records if len(r["tokens"]) > 1]
  latency = [r["finish_s"] - r["arrival_s"] for r in records]
  return {"generated_tokens": generated,
          "prompt_tokens": sum(len(r.prompt) for r in requests),
          "wall_s": run["wall_s"], "tokens_per_s": generated / run["wall_s"],
          "model_calls": sum(len(s["calls"]) for s in run["log"]),
          "model_steps": len(run["log"]), "token_rows": run["token_rows"],
          "useful_share": (generated + sum(len(r.prompt) for r in requests))
          / run["token_rows"],
          "call_ms_by_shape": _call_ms(run["log"]),
          "ttft_s": _stats(ttft), "ttft_steps": _stats(ttft_steps),
          "tpot_s": _stats(tpot), "latency_s": _stats(latency)}


# ---------------------------------------------------------------------------
# The model


def _lm_config(config: ServeConfig) -> lm.LMConfig:
  """The LM experiment's config whose ``segments`` checkpoint this run can
  load: its defaults, with this run's model, seed and corpus settings."""
  base = lm.LMConfig()
  return dataclasses.replace(
      base, model=config.model, seq_len=config.seq_len,
      valid_fraction=config.valid_fraction,
      train=dataclasses.replace(base.train, seed=config.train.seed))


def fingerprint(config: ServeConfig) -> dict:
  """The settings a model trained here depends on (its checkpoint's)."""
  flat = checkpoints.flatten(dataclasses.asdict(config))
  keep = {"seq_len", "valid_fraction", "train.steps", "train.batch_size",
          "train.learning_rate", "train.seed"}
  return report.jsonable({k: v for k, v in flat.items()
                          if k in keep or k.startswith("model.")})


def load_lm_checkpoint(model: lm_model.DecoderLM,
                       config: ServeConfig) -> tuple[bool, str]:
  """Restores the LM experiment's checkpoint into ``model`` if it matches.

  Returns:
    ``(loaded, why)``; when not loaded, ``model`` may hold partly restored
    weights (build a fresh one).
  """
  path = config.lm_checkpoint
  if not path or not os.path.isdir(path):
    return False, f"no LM checkpoint at {path!r}"
  lm_config = _lm_config(config)
  ckpt = checkpoints.Checkpointer(path, lm.fingerprint("segments", lm_config))
  try:
    step, _ = ckpt.restore(model, training.make_optimizer(model,
                                                          lm_config.train))
  except ValueError as e:
    return False, f"the LM checkpoint at {path!r} does not match: {e}"
  finally:
    ckpt.close()
  if step != lm_config.train.steps:
    return False, (f"the LM checkpoint at {path!r} stopped at step {step} "
                   f"of {lm_config.train.steps}")
  return True, f"the LM experiment's checkpoint {path!r} (step {step})"


def build_model(config: ServeConfig, corpus: lm_data.Corpus
                ) -> tuple[lm_model.DecoderLM, dict]:
  """The LM checkpoint's model, or one trained here; and where it came from."""
  lm_config = _lm_config(config)
  model = lm.build_model("segments", lm_config, corpus.vocab.size)
  loaded, why = load_lm_checkpoint(model, config)
  if loaded:
    return model, {"source": why, "trained_here": False}
  train_config = dataclasses.replace(lm_config, train=config.train)
  model, stats, valid = _train_here(
      "serve model", train_config, corpus, config, "model",
      fingerprint(config))
  # A rerun restores the whole model from the workdir: say so, rather than
  # "trained here" by a run that trained no step.
  where = ("trained here" if stats["trained_steps"] else
           "restored from this workdir's checkpoint of an earlier run")
  return model, {"source": f"{where} ({why})", "trained_here": True,
                 "train_steps": stats["steps"],
                 "resumed_from": stats["resumed_from"],
                 "train_steps_per_s": stats["steps_per_s"],
                 "train_timing": stats["timing"],
                 "final_loss_bits": stats["final_loss"] / math.log(2),
                 "valid_bits_per_char": valid["bits_per_char"]}


def _train_here(name: str, lm_config: lm.LMConfig, corpus: lm_data.Corpus,
                config: ServeConfig, directory: str, fingerprint_: dict):
  """A fresh ``lm_config`` model trained on the LM's batches for its
  ``train`` steps, checkpointed under the workdir's ``checkpoints/
  directory`` (a rerun restores it); ``(model, stats, validation)``."""
  model = lm.build_model("segments", lm_config, corpus.vocab.size)
  ckpt = checkpoints.Checkpointer(
      os.path.join(config.workdir, "checkpoints", directory), fingerprint_)
  try:
    stats = training.train(
        name, model, lm_config.train, ckpt,
        batches=functools.partial(lm.train_batch, corpus, lm_config,
                                  "segments"),
        step_fn=lm.train_step)
  finally:
    ckpt.close()
  valid = lm.evaluate(model, "segments", corpus.valid,
                      config.train.batch_size, 64)
  return model, stats, valid


# The draft model: small, trained here on the same text.
DRAFT_MODEL = lm_model.LMModelConfig(d_model=64, num_heads=2, num_layers=1,
                                     ffn_dim=256)


def build_drafts(config: ServeConfig, corpus: lm_data.Corpus
                 ) -> tuple[dict, dict]:
  """``({name: draft}, {name: where it came from})`` for ``--serve_drafts``;
  the model draft is trained here for ``draft_steps`` (checkpointed in the
  workdir: a rerun restores it)."""
  built, sources = {}, {}
  width, depth = config.draft_width, config.draft_depth
  for name in drafts(config):
    if name == "ngram":
      built[name] = speculative.NgramDraft(width=width, depth=depth)
      sources[name] = "prompt lookup (no model)"
      continue
    lm_config = dataclasses.replace(
        _lm_config(config), model=DRAFT_MODEL,
        train=dataclasses.replace(config.train, steps=config.draft_steps))
    model, stats, valid = _train_here(
        "draft model", lm_config, corpus, config, "draft",
        {**fingerprint(config), "draft_model": report.jsonable(
            dataclasses.asdict(DRAFT_MODEL)),
         "draft_steps": config.draft_steps})
    built[name] = speculative.ModelDraft(model, width=width, depth=depth)
    sources[name] = {
        "model": report.jsonable(dataclasses.asdict(DRAFT_MODEL)),
        "train_steps": stats["steps"],
        "valid_bits_per_char": valid["bits_per_char"]}
  return built, sources


# ---------------------------------------------------------------------------
# The experiment


def _timed_passes(model, requests, config, drafted=None) -> dict:
  """Each system's compiling pass, then ``config.timed_passes`` rounds of
  one timed pass each in turns (so a slow spell of the machine falls on
  every system): ``{"paged"|"static"|"paged+DRAFT": (compile pass, median
  pass by wall time, every timed pass)}``."""
  fns = {"paged": serve_paged, "static": serve_static}
  for name, draft in (drafted or {}).items():
    fns[f"paged+{name}"] = functools.partial(serve_paged, draft=draft)
  warm = {name: fn(model, requests, config) for name, fn in fns.items()}
  passes = {name: [] for name in fns}
  for _ in range(config.timed_passes):
    for name, fn in fns.items():
      passes[name].append(fn(model, requests, config))
  return {name: (warm[name], sorted(runs, key=lambda r: r["wall_s"])[
      (len(runs) - 1) // 2], runs) for name, runs in passes.items()}


def _speculation(run: dict) -> dict:
  """How far drafting went in a speculative pass: drafted tokens accepted
  per verified tree, tokens emitted per verification (accepted + the
  target's own), tree nodes, and the draft's and the verification calls'
  mean wall times."""
  accepted = [a for r in run["records"] for a in r.get("accepted", [])]
  nodes = [n for r in run["records"] for n in r.get("tree_nodes", [])]
  calls = [c for s in run["log"] for c in s["calls"] if "draft_s" in c]
  return {"verified_trees": len(accepted),
          "mean_accepted": float(np.mean(accepted)) if accepted else 0.0,
          "mean_tokens_per_verify": float(np.mean(accepted)) + 1
          if accepted else 0.0,
          "mean_tree_nodes": float(np.mean(nodes)) if nodes else 0.0,
          "verify_calls": len(calls),
          "draft_ms": 1000 * float(np.mean([c["draft_s"] for c in calls]))
          if calls else 0.0,
          "verify_call_ms": 1000 * float(np.mean(
              [c["s"] - c["draft_s"] for c in calls])) if calls else 0.0}


def _reused_pages(run: dict) -> int:
  """Requests holding a page some request finished with before they were
  admitted (a released page serving a new request)."""
  records = run["records"]
  count = 0
  for r in records:
    earlier = {p for o in records
               if o["finish_step"] < r["admit_step"] for p in o["pages"]}
    count += bool(earlier & set(r["pages"]))
  return count


def run(config: ServeConfig) -> dict:
  """Builds or loads the model, serves the workload both ways, checks every
  request against its alone generation and writes the report.

  Raises:
    ValueError: settings the workload cannot be served with.
    RuntimeError: after writing the report, if a request's tokens differ
      from its alone generation (beyond a near tie), or the two passes of
      a system differ.
  """
  check_config(config)
  report.check_writable(config.workdir)
  t_start = time.perf_counter()
  corpus = lm_data.build_corpus(config.seq_len, config.valid_fraction,
                                config.train.seed)
  requests = workload(config, corpus)
  model, source = build_model(config, corpus)
  print(f"[serve] model: {source['source']}")
  drafted, draft_sources = build_drafts(config, corpus)

  t0 = time.perf_counter()
  passes = _timed_passes(model, requests, config, drafted)
  paged_warm, paged, paged_runs = passes["paged"]
  static_warm, static, static_runs = passes["static"]
  serving_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  alone = generate_alone(model, requests)
  alone_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  rows = cache_accuracy.validation_rows(corpus.valid, config.seq_len)
  if config.accuracy_rows:
    rows = cache_accuracy.Rows(rows.tokens[:config.accuracy_rows],
                               rows.lengths[:config.accuracy_rows])
  accuracy = cache_accuracy.cache_accuracy(model, rows)
  accuracy_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  eviction = eviction_accuracy.evaluate(
      model, cache_accuracy.validation_rows(corpus.valid, config.seq_len),
      max_rows=config.eviction_rows or None)
  eviction_s = time.perf_counter() - t0

  per_token = cache_bytes_per_token(model)
  z = config.page_size
  peak = max(s["pages_in_use"] for s in paged["log"])
  longest = max(static["batches"], key=lambda b: b["length"])
  systems = {"paged": metrics(paged, requests),
             "static": metrics(static, requests)}
  systems["paged"].update(
      cache_bytes=config.num_pages * z * per_token,
      peak_pages_in_use=peak, peak_in_use_bytes=peak * z * per_token,
      mean_pages_in_use=float(np.mean([s["pages_in_use"]
                                       for s in paged["log"]])),
      pages_in_use_at_end=paged["pages_in_use_at_end"],
      pages_blocked_steps=paged["pages_blocked_steps"],
      requests_reusing_freed_pages=_reused_pages(paged),
      compile_pass_wall_s=paged_warm["wall_s"],
      check=compare(paged["records"], alone))
  systems["static"].update(
      cache_bytes=config.slots * longest["length"] * per_token,
      allocated_cache_bytes=config.slots * longest["allocated_length"]
      * per_token,
      batches=len(static["batches"]),
      compile_pass_wall_s=static_warm["wall_s"],
      check=compare(static["records"], alone))
  for name in drafted:
    warm, median, runs = passes[f"paged+{name}"]
    systems[f"paged+{name}"] = dict(
        metrics(median, requests), **_speculation(median),
        compile_pass_wall_s=warm["wall_s"],
        pages_in_use_at_end=median["pages_in_use_at_end"],
        check=compare(median["records"], alone))
  for name, (warm, _, runs) in passes.items():
    systems[name]["passes_equal"] = all(
        a["tokens"] == b["tokens"] for timed in runs
        for a, b in zip(warm["records"], timed["records"]))
    systems[name]["timed_pass_wall_s"] = [r["wall_s"] for r in runs]
  paged_m, static_m = systems["paged"], systems["static"]
  comparison = {
      "tokens_per_s_ratio": paged_m["tokens_per_s"] / static_m["tokens_per_s"],
      # Each round's paged pass against its static pass (wall time of the
      # same tokens): the spread of the ratio on this machine.
      "tokens_per_s_ratio_by_round": [
          s["wall_s"] / p["wall_s"] for p, s in zip(paged_runs,
                                                    static_runs)],
      "ttft_mean_ratio": paged_m["ttft_s"]["mean"] / static_m["ttft_s"]["mean"],
      "cache_bytes_ratio": paged_m["cache_bytes"] / static_m["cache_bytes"],
      "peak_in_use_bytes_ratio": (paged_m["peak_in_use_bytes"]
                                  / static_m["cache_bytes"])}
  for name in drafted:
    spec = f"paged+{name}"
    comparison[f"{spec}_tokens_per_s_ratio"] = (
        systems[spec]["tokens_per_s"] / paged_m["tokens_per_s"])
    comparison[f"{spec}_tokens_per_s_ratio_by_round"] = [
        p["wall_s"] / d["wall_s"] for p, d in zip(paged_runs,
                                                  passes[spec][2])]
  payload = {
      "config": report.jsonable(dataclasses.asdict(config)),
      "model": source, "drafts": draft_sources,
      "bytes_per_token": per_token,
      "workload": {
          "requests": len(requests),
          "prompt_tokens": [len(r.prompt) for r in requests],
          "max_tokens": [r.max_tokens for r in requests],
          "arrival_steps": [r.arrival for r in requests],
          "documents": [r.document for r in requests]},
      "systems": report.jsonable(systems), "comparison": comparison,
      "cache_accuracy": report.jsonable(accuracy),
      "eviction": report.jsonable(eviction),
      "seconds": {"serving_both_passes": serving_s, "alone": alone_s,
                  "cache_accuracy": accuracy_s, "eviction": eviction_s,
                  "total": time.perf_counter() - t_start},
      "static_batches": report.jsonable(static["batches"]),
      "requests": {"paged": report.jsonable(paged["records"]),
                   "static": report.jsonable(static["records"]),
                   **{f"paged+{name}": report.jsonable(
                       passes[f"paged+{name}"][1]["records"])
                      for name in drafted}},
      "paged_log": paged["log"], "static_log": static["log"]}
  if jax.process_index() == 0:
    serve_plots.pages_in_use(
        os.path.join(config.workdir, "pages_in_use.png"), paged["log"],
        static["log"], config.num_pages, z)
    eviction_accuracy.plot(eviction,
                           os.path.join(config.workdir, "eviction.png"))
    report.write_json(os.path.join(config.workdir, "results.json"), payload)
    text = _report(config, corpus, requests, payload)
    report.write_text(os.path.join(config.workdir, "report.md"), text)
    print(text)
  problems = [f"{name}: {s['check']}" for name, s in systems.items()
              if s["check"]["mismatches"]]
  problems += [f"{name}: its compile pass and timed passes gave different "
               "tokens" for name, s in systems.items()
               if not s["passes_equal"]]
  if problems:
    raise RuntimeError("serving differs from generating alone: "
                       + "; ".join(problems))
  return payload


def _report(config: ServeConfig, corpus: lm_data.Corpus,
            requests: list[Request], payload: dict) -> str:
  systems, c = payload["systems"], payload["comparison"]
  m = config.model
  prompts = [len(r.prompt) for r in requests]
  outputs = [r.max_tokens for r in requests]
  rows = []
  for name in ("paged", "static"):
    s = systems[name]
    check = s["check"]
    rows.append([
        name, s["tokens_per_s"], s["generated_tokens"], s["wall_s"],
        f"{s['ttft_s']['mean']:.3f} / {s['ttft_s']['p50']:.3f} / "
        f"{s['ttft_s']['p90']:.3f}",
        f"{s['ttft_steps']['mean']:.1f}",
        1000 * s["tpot_s"]["mean"], s["model_calls"], s["useful_share"],
        f"{s['cache_bytes'] / 2**20:.2f}",
        f"{check['matching']}/{check['requests']}"
        + (f" ({len(check['near_ties'])} near ties)" if check["near_ties"]
           else ""),
        s["compile_pass_wall_s"]])
  paged = systems["paged"]
  call_rows = []
  for name in ("paged", "static"):
    calls = systems[name]["call_ms_by_shape"]
    call_rows.append([name, ", ".join(
        f"{shape}: {c['mean_ms']:.1f} ms x {c['calls']}"
        for shape, c in calls.items())])
  parts = [
      "# Continuous batching over a paged KV cache\n",
      f"Model: {payload['model']['source']}; {m.num_layers} layers, "
      f"D={m.d_model}, {m.num_heads} heads, vocabulary "
      f"{corpus.vocab.size}. Cache: {payload['bytes_per_token']} bytes per "
      "token (keys and values, every layer, float32).\n",
      f"Workload: {len(requests)} requests, lengths drawn "
      f"{config.lengths.replace('_', '-')}: prompts {min(prompts)}-"
      f"{max(prompts)} tokens (mean {np.mean(prompts):.0f}) from the "
      f"validation documents, {min(outputs)}-{max(outputs)} generated "
      f"tokens each (mean {np.mean(outputs):.1f}, greedy), arriving at "
      f"{config.arrival_rate:g} requests per model step (last at step "
      f"{requests[-1].arrival}); {config.slots} rows. Paged: "
      f"{config.num_pages} pages of {config.page_size} tokens, prompts "
      f"prefilled in chunks of at most "
      f"{config.prefill_chunk or 'all'} tokens. Static: batches of up to "
      f"{config.slots} waiting requests, each with a linear cache for its "
      "longest prompt + longest output.\n",
      "## Results\n",
      report.markdown_table(
          ["system", "generated tokens/s", "tokens", "wall s",
           "TTFT mean / p50 / p90 (s)", "TTFT mean (steps)",
           "TPOT mean (ms)", "model calls", "useful token share",
           "cache MiB", "same tokens as alone", "compile pass wall s"],
          rows) + "\n",
      f"Paged / static: {c['tokens_per_s_ratio']:.2f}x the tokens/s "
      f"(median passes; round by round "
      f"{', '.join(f'{r:.2f}' for r in c['tokens_per_s_ratio_by_round'])}"
      f"x), "
      f"{c['ttft_mean_ratio']:.2f}x the mean TTFT, "
      f"{c['cache_bytes_ratio']:.2f}x the cache bytes (pool against the "
      f"largest static batch's {systems['static']['cache_bytes']} bytes; "
      f"peak pages in use {c['peak_in_use_bytes_ratio']:.2f}x).\n",
      f"Paged pool: {config.num_pages} pages, peak {paged['peak_pages_in_use']}"
      f" in use (mean {paged['mean_pages_in_use']:.1f}), "
      f"{paged['pages_in_use_at_end']} in use after the last release; "
      f"{paged['requests_reusing_freed_pages']} requests were served from "
      f"pages a finished request released; a free row waited for pages in "
      f"{paged['pages_blocked_steps']} steps. Static: "
      f"{systems['static']['batches']} batches.\n",
      "Mean wall time per model call by its padded shape (rows x new "
      "tokens per row), and how many:\n",
      report.markdown_table(["system", "calls"], call_rows) + "\n",
      "Times are wall clock of each system's median timed pass (a first "
      "pass compiles every shape; its wall time is the last column). "
      "TTFT: arrival to first token; TPOT: (finish - first token) / "
      "(tokens - 1); useful token share: prompt and generated tokens "
      "over the token rows the model computed (rows x T per call, "
      "padding included).\n"]
  parts += _speculative_section(config, payload)
  parts += _accuracy_section(config, payload["cache_accuracy"])
  parts += eviction_accuracy.section(payload["eviction"])
  parts.append("## Samples (paged)\n")
  records = payload["requests"]["paged"]
  for r in requests[:3]:
    text = corpus.vocab.decode(r.prompt[-60:])
    out = corpus.vocab.decode(records[r.index]["tokens"])
    parts.append("```text\n" + text + "\u2502" + out + "\n```\n")
  return "\n".join(parts)


def _accuracy_section(config: ServeConfig, accuracy: dict) -> list[str]:
  formats = list(accuracy)
  ref = accuracy[formats[0]]
  rows = []
  for f in formats:
    a = accuracy[f]
    errors = " / ".join(f"{e:.2g}" for e in a["attention_max_abs_error"])
    rows.append([f, a["bits_per_char"], f"{100 * a['greedy_agreement']:.2f}%",
                 errors, a["bytes_per_token"],
                 f"{a['bytes_per_token'] / ref['bytes_per_token']:.3f}"])
  scale = " / ".join(f"{v:.2g}" for v in ref["attention_max_abs"])
  return [
      "## Quantised caches\n",
      f"The validation text ({ref['positions']} transitions, in rows of at "
      f"most {config.seq_len}) read through a paged cache of each format "
      "(teacher forcing, 24 tokens per call, each call's tokens written "
      "before they attend). Greedy agreement: positions whose argmax equals "
      f"the {formats[0]} cache's. Attention error: the largest |output - "
      f"{formats[0]} output| per layer (the {formats[0]} outputs reach "
      f"{scale}).\n",
      report.markdown_table(
          ["cache", "bits/char", "greedy agreement",
           "attention max abs error per layer", "bytes per token",
           f"bytes vs {formats[0]}"], rows) + "\n"]


def _speculative_section(config: ServeConfig, payload: dict) -> list[str]:
  systems, c = payload["systems"], payload["comparison"]
  names = [n for n in systems if n.startswith("paged+")]
  if not names:
    return []
  rows = []
  for name in ["paged"] + names:
    s = systems[name]
    check = s["check"]
    spread = ""
    if name != "paged":
      rounds = c[f"{name}_tokens_per_s_ratio_by_round"]
      spread = (f"{c[f'{name}_tokens_per_s_ratio']:.2f}x ("
                f"{min(rounds):.2f}-{max(rounds):.2f})")
    rows.append([
        name, s["tokens_per_s"], spread or "1",
        f"{s['mean_accepted']:.2f}" if name != "paged" else "-",
        f"{s['mean_tree_nodes']:.1f}" if name != "paged" else "1",
        s.get("verify_calls", s["model_calls"]),
        f"{s['verify_call_ms']:.1f} + {s['draft_ms']:.1f}"
        if name != "paged" else "-",
        f"{check['matching']}/{check['requests']}"
        + (f" ({len(check['near_ties'])} near ties)" if check["near_ties"]
           else "")])
  drafts_text = "; ".join(
      f"{k}: {v if isinstance(v, str) else _draft_text(v)}"
      for k, v in payload["drafts"].items())
  return [
      "## Speculative decoding\n",
      f"Each decoding step drafts a tree per row ({config.draft_width} "
      f"branches of {config.draft_depth} tokens under the row's last token, "
      "merged as a trie) and the target verifies every row's tree in one "
      "call (tree mask, positions prefix + depth), keeping the longest "
      "path it agrees with and its own next token; the rejected nodes' "
      f"slots are dropped from the paged cache. Drafts: {drafts_text}.\n",
      report.markdown_table(
          ["system", "generated tokens/s", "vs paged (rounds)",
           "drafted tokens accepted per tree", "tree nodes (mean)",
           "decode calls", "verify + draft ms per call",
           "same tokens as alone"], rows) + "\n",
      "Tokens/s of each system's median timed pass; the ratio against "
      "plain continuous batching round by round in brackets (each round "
      "runs every system once, in turns).\n"]


def _draft_text(source: dict) -> str:
  m = source["model"]
  return (f"a DecoderLM of {m['num_layers']} layer, D={m['d_model']}, "
          f"{m['num_heads']} heads, trained {source['train_steps']} steps "
          f"here (validation {source['valid_bits_per_char']:.3f} bits/char)")
