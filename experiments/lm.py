"""Causal self-attention on real text: a character-level GPT on Python's docs.

``python run.py --experiment=lm`` trains one small decoder-only Transformer
(``lm_model.DecoderLM``) per variant on the help topics of Python's own
``pydoc_data`` (``lm_data``: split by document, packed into rows), with the
same step budget each:

* ``segments``: packed rows attended with segment ids (no attention across
  documents, rotary positions restarting per document);
* ``naive``: the same rows attended as one sequence (the common packing
  mistake: a document's first characters see the previous document). Its
  segment ids are all ones, so both variants run one compiled program and
  differ only in that input;
* ``window``: ``segments`` plus a causal sliding window of ``--window``.

Then, per variant: validation bits per character, overall and on the first
``--doc_start_chars`` characters of each document; batched generation from
prompts of different lengths with the KV cache (``lm_generate``: greedy and
sampled, prefill and decode tokens/s), with the check that cached greedy
generation equals recomputing the full forward at every step; attention
maps at a document boundary and for one token of an English sentence; and
leakage (``leakage``): one validation document scored after two different
predecessors in one packed row, its first characters' next-character
distributions compared (identical with segment ids, different naively).
Writes to the workdir:

* ``results.json``: every number; ``summary.md``: tables and samples;
* ``loss_curves.png``; ``attention_<variant>.png`` (every layer and head at
  a document boundary); ``boundary_attention.png`` (the variants side by
  side); ``where_it_looks.png`` (one token's weights as bars);
  ``leakage.png`` (per-character KL divergence between the two contexts);
* ``checkpoints/<variant>/``: orbax checkpoints (rerunning resumes).

Shape glossary: B batch, T ``seq_len``, D model dim, N heads, H head dim,
V vocabulary size, L layers; leakage: K (predecessor, predecessor, document)
triples, C characters compared, P predecessor tokens (``P + C = T``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import attention_jax as aj
from experiments import checkpoints
from experiments import config_flags
from experiments import lm_data
from experiments import lm_generate
from experiments import lm_model
from experiments import lm_plots
from experiments import parallel
from experiments import report
from experiments import training

VARIANTS = ("segments", "naive", "window")
SEQUENCE_PARALLEL = ("ring", "ulysses", "hybrid")
# Different lengths on purpose: one batched prefill, each example decoding
# from its own position.
PROMPTS = ("The cat sat on the mat", 'The "for" statement is used to',
           "def f(x):\n   return", "Lists")
# The lesson's self-attention example: where does "sat" (its last
# character) look?
SENTENCE, QUERY_WORD = "The cat sat on the mat.", "sat"
BOUNDARY_HALF = 24  # characters shown either side of a document start
LEAKAGE_TRIPLES = 8  # (A, B, D) triples the leakage is averaged over


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """What ``python run.py --experiment=lm`` runs; flagged fields are flags."""
  workdir: str = config_flags.field("runs/lm", config_flags.WORKDIR)
  variants: tuple[str, ...] = config_flags.field(
      VARIANTS, f"lm: variants to train, comma-separated, from "
      f"{list(VARIANTS)}.", name="lm_variants", choices=VARIANTS)
  seq_len: int = config_flags.field(
      128, "lm: characters per packed row (T).", lower_bound=2)
  window: int = config_flags.field(
      32, "lm: the window variant's causal window: each character sees "
      "itself and this many before it.", lower_bound=1)
  doc_start_chars: int = config_flags.field(
      64, "lm: the first characters of each validation document, scored "
      "on their own.", lower_bound=1)
  valid_fraction: float = 0.2  # of the documents, held out by document
  model: lm_model.LMModelConfig = lm_model.LMModelConfig()
  train: training.TrainConfig = config_flags.nested(
      training.TrainConfig(steps=350, batch_size=16, learning_rate=3e-3,
                           checkpoint_every=100, log_every=10),
      expose=config_flags.training_flags(
          "lm", "training steps per variant.", "rows per batch."))
  sequence_parallel: str = config_flags.field(
      "ring", "lm: how a --mesh with a seq axis splits each row's attention: "
      "ring (key/value blocks round the seq axis), ulysses (all-to-all to "
      "whole rows of fewer heads) or hybrid (all-to-all over seq, ring "
      "across the ring axis: --mesh=data:2,ring:2,seq:2).",
      name="lm_sequence_parallel", choices=SEQUENCE_PARALLEL)
  seq_layout: str = config_flags.field(
      "zigzag", "lm: how the rows' tokens are laid over the sequence "
      "devices: zigzag (each device two chunks, i and 2P-1-i: the same "
      "causal work on every device) or contiguous.", name="lm_seq_layout",
      choices=("zigzag", "contiguous"))
  gen_tokens: int = config_flags.field(
      120, "lm: characters generated per prompt.", lower_bound=1)
  temperature: float = config_flags.field(
      0.8, "lm: sampling temperature (0: greedy samples only).",
      lower_bound=0.0)
  top_k: int = config_flags.field(
      10, "lm: sample among the k most likely characters (0: all).",
      lower_bound=0)
  prompts: tuple[str, ...] = PROMPTS


# Settings a checkpoint's run and the run resuming it may differ in: where
# results go, what is evaluated or generated, logging, saving and devices.
RESUMABLE_CHANGES = frozenset({
    "workdir", "variants", "doc_start_chars", "gen_tokens", "temperature",
    "top_k", "prompts", "train.log_every", "train.checkpoint_every",
    "train.mesh", "sequence_parallel", "seq_layout"})
# TrainConfig fields of the copy task that do not shape this experiment.
_UNUSED_TRAIN = frozenset({"train.task", "train.min_len", "train.max_len",
                           "train.vocab_size"})


def build_model(variant: str, config: LMConfig, vocab_size: int,
                mesh: jax.sharding.Mesh | None = None) -> lm_model.DecoderLM:
  """A fresh model of ``variant``; every variant starts from the same seed.

  With a mesh whose ``model`` axis is > 1, heads and FFN units are
  annotated to split over it (build under ``jax.set_mesh(mesh)``); one
  that splits sequences gets ``sequence_attention``'s attention.
  """
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
  return lm_model.DecoderLM(
      config.model, vocab_size=vocab_size,
      window=config.window if variant == "window" else None,
      rngs=nnx.Rngs(config.train.seed),
      implementation=sequence_attention(config, mesh),
      model_axis=parallel.model_axis(mesh) if mesh else None)


def sequence_attention(config: LMConfig, mesh: jax.sharding.Mesh | None
                       ) -> aj.SequenceParallel | None:
  """The attention of a mesh that splits sequences (None: it does not).

  ``--lm_sequence_parallel`` picks ring or all-to-all over ``seq``, or the
  hybrid (all-to-all over ``seq``, ring across ``ring``); the batch is
  split over ``data`` and the heads over ``model`` as the rest of the
  model is.
  """
  if mesh is None or parallel.sequence_devices(mesh) == 1:
    return None
  method = config.sequence_parallel
  ring, seq = mesh.shape["ring"], mesh.shape["seq"]
  if (method == "hybrid") != (ring > 1 and seq > 1):
    raise ValueError(
        f"--lm_sequence_parallel={method} with --mesh {dict(mesh.shape)}: "
        "the hybrid needs both a ring and a seq axis (e.g. "
        "--mesh=data:2,ring:2,seq:2), ring and ulysses one seq axis "
        "(--mesh=data:2,seq:4).")
  if ring > 1 and method != "hybrid":
    raise ValueError("--mesh: put a sequence split of one kind on the seq "
                     "axis (ring is the hybrid's outer axis).")
  # (zigzag: the batches come permuted, train_batch; once per batch rather
  # than every layer's q, k, v and output)
  return aj.SequenceParallel(
      "seq", method=method, layout=config.seq_layout,
      ring_axis="ring" if method == "hybrid" else None,
      batch_axis="data" if mesh.shape["data"] > 1 else None,
      head_axis=parallel.model_axis(mesh),
      permuted=config.seq_layout == "zigzag")


def layout_devices(config: LMConfig, mesh: jax.sharding.Mesh | None) -> int:
  """The devices ``aj.zigzag`` lays a row over (1: rows stay in order):
  the ring's in the hybrid, the sequence axis's otherwise."""
  if (sequence_attention(config, mesh) is None
      or config.seq_layout != "zigzag"):
    return 1
  return mesh.shape["ring" if config.sequence_parallel == "hybrid"
                    else "seq"]


def fingerprint(variant: str, config: LMConfig) -> dict:
  """The settings a checkpoint must share with the run that resumes it:
  every field but ``RESUMABLE_CHANGES``, the copy task's and, for variants
  without a window, ``window``."""
  skip = RESUMABLE_CHANGES | _UNUSED_TRAIN | (
      set() if variant == "window" else {"window"})
  settings = {k: v for k, v in checkpoints.flatten(dataclasses.asdict(config)).items()
              if k not in skip}
  return report.jsonable({"variant": variant, **settings})


def loss_fn(model, inputs, targets, weights, segment_ids, positions=None):
  """Mean cross-entropy (nats) over the targets of each input's document
  (``positions``: rotary positions, given when the rows are permuted)."""
  logits = model(inputs, segment_ids, positions)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)


@nnx.jit
def train_step(model, optimizer, inputs, targets, weights, segment_ids,
               positions=None):
  loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets, weights,
                                            segment_ids, positions)
  optimizer.update(model, grads)
  return loss


class _TimedStep:
  """``train_step`` that remembers how long its first call (the compile)
  took, so steps/s can be reported with and without it."""

  def __init__(self):
    self.first_seconds = 0.0

  def __call__(self, *args):
    if self.first_seconds:
      return train_step(*args)
    t0 = time.perf_counter()
    loss = jax.block_until_ready(train_step(*args))
    self.first_seconds = time.perf_counter() - t0
    return loss


def attended_ids(variant: str, segment_ids: np.ndarray) -> np.ndarray:
  """The segment ids ``variant`` attends with: the packing's, or for
  ``naive`` all ones (each row one sequence)."""
  return np.ones_like(segment_ids) if variant == "naive" else segment_ids


def train_batch(corpus: lm_data.Corpus, config: LMConfig, variant: str,
                step: int, devices: int = 1) -> tuple[np.ndarray, ...]:
  """``(inputs, targets, weights, segment_ids)`` of training step ``step``;
  laid out over ``devices`` in the zigzag order (``layout_devices``), with
  each token's rotary position after them (the loss is a sum over tokens:
  the order changes nothing else)."""
  rows = lm_data.batch_rows(corpus.train.num_rows, step,
                            config.train.batch_size, config.train.seed)
  inputs, targets, weights, ids = lm_data.batch(corpus.train, rows)
  arrays = (inputs, targets, weights, attended_ids(variant, ids))
  if devices == 1:
    return arrays
  positions = np.asarray(aj.segment_positions(arrays[-1]))
  return tuple(np.asarray(aj.zigzag(x, devices, axis=1))
               for x in (*arrays, positions))


@nnx.jit
def _token_nll(model, inputs, targets, segment_ids):
  logits = model(inputs, segment_ids)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def evaluate(model: lm_model.DecoderLM, variant: str,
             packed: lm_data.Packed, batch_size: int, start_chars: int,
             mesh: jax.sharding.Mesh | None = None) -> dict:
  """Bits per character of every target, and of each document's first
  ``start_chars`` characters (where attention across documents matters)."""
  rows, width = packed.num_rows, packed.tokens.shape[1] - 1
  # About 8192 tokens per call, a multiple of the (mesh-checked) batch.
  chunk = batch_size * max(1, 8192 // (width * batch_size))
  index = np.arange(math.ceil(rows / chunk) * chunk) % rows
  nll = []
  for i in range(0, len(index), chunk):
    inputs, targets, _, ids = lm_data.batch(packed, index[i:i + chunk])
    arrays = (inputs, targets, attended_ids(variant, ids))
    if mesh is not None:
      arrays = parallel.shard_batch(arrays, mesh)
    nll.append(np.asarray(_token_nll(model, *arrays)))
  nll = np.concatenate(nll)[:rows] / math.log(2)  # [R, T] bits
  weights = packed.target_weights()
  start = weights * (packed.doc_positions[:, 1:] <= start_chars)
  rest = weights - start
  bits = lambda w: float((nll * w).sum() / max(w.sum(), 1.0))  # noqa: E731
  return {"bits_per_char": bits(weights), "bits_per_char_doc_start": bits(
      start), "bits_per_char_rest": bits(rest), "chars": int(weights.sum()),
          "doc_start_chars": int(start.sum())}


@nnx.jit
def _attention_maps(model, tokens, segment_ids):
  """``[B, L, N, T, T]`` weights of ``tokens [B, T]``."""
  _, weights = model(tokens, segment_ids, return_weights=True)
  return jnp.stack(weights, 1)


def attention_analysis(model: lm_model.DecoderLM, variant: str,
                       corpus: lm_data.Corpus) -> dict:
  """Maps at a validation document boundary, and one token's weights."""
  tokens, ids, boundary = lm_data.boundary_window(corpus.valid,
                                                  BOUNDARY_HALF)
  sentence = np.concatenate([[lm_data.BOS], corpus.vocab.encode(SENTENCE)])
  query = 1 + SENTENCE.index(QUERY_WORD) + len(QUERY_WORD) - 1
  # One call for both examples, right-padded to one length: causal
  # attention keeps the padding out of every real token's row.
  width = max(len(tokens), len(sentence))
  pad = lambda x, v: np.pad(x, (0, width - len(x)), constant_values=v)  # noqa: E731
  maps = np.asarray(_attention_maps(
      model, jnp.asarray(np.stack([pad(tokens, lm_data.PAD),
                                   pad(sentence, lm_data.PAD)])),
      jnp.asarray(np.stack([pad(attended_ids(variant, ids), 0),
                            pad(np.ones_like(sentence), 0)]))))
  n = len(tokens)
  window = maps[0, :, :, :n, :n]  # [L, N, W, W]
  # Weight the new document's tokens put on the previous document.
  cross = window[:, :, boundary:, :boundary].sum(-1).mean((1, 2))  # [L]
  return {"boundary_tokens": tokens, "boundary": boundary, "maps": window,
          "cross_document_mass": cross.tolist(), "sentence": sentence,
          "query": query, "looks": maps[1, :, :, query, :query + 1]}


def documents_of(packed: lm_data.Packed) -> list[np.ndarray]:
  """The packed documents back, in packing order, each ``[BOS, c_1, ...]``."""
  # Rows overlap by one token: row r's inputs, then the last row's last.
  stream = np.concatenate([packed.tokens[:, :-1].ravel(),
                           packed.tokens[-1, -1:]])
  stream = stream[stream != lm_data.PAD]  # padding only trails the stream
  return np.split(stream, np.flatnonzero(stream == lm_data.BOS)[1:])


@dataclasses.dataclass(frozen=True)
class LeakageRows:
  """Packed rows ``[A | D]`` and ``[B | D]`` of K triples.

  Attributes:
    inputs: int32 ``[2, K, T]``: ``[0]`` after predecessor A, ``[1]`` after B.
    segment_ids: int32 ``[2, K, T]``: 1 on the predecessor, 2 on D.
    targets: int32 ``[K, C]``: D's first ``C`` characters.
    offset: ``P``, the index of D's BOS in every row (the same in all).
    triples: ``[K]`` of ``(a, b, d)`` document indices (packing order).
  """
  inputs: np.ndarray
  segment_ids: np.ndarray
  targets: np.ndarray
  offset: int
  triples: list[tuple[int, int, int]]


def leakage_chars(config: LMConfig) -> int:
  """C: the characters of a document compared for leakage:
  ``doc_start_chars``, at most half a row (the rest holds the
  predecessor)."""
  return min(config.doc_start_chars, config.seq_len // 2)


def leakage_rows(packed: lm_data.Packed, seq_len: int, chars: int,
                 count: int = LEAKAGE_TRIPLES) -> LeakageRows:
  """Rows that score one document D after two predecessors A and B.

  Each row is A's (or B's) last ``P`` tokens, then D's BOS and first
  ``chars - 1`` characters as inputs, so the targets are D's first
  ``chars`` characters. ``P = seq_len - chars`` (a full row), or less when
  fewer than three documents are that long (the rows are then shorter).
  Both predecessors have the same length, so D sits at the same offset in
  both rows: with segment ids D's computation is then the same sequence of
  floating-point operations in both (the other document's keys get weight
  exactly 0 wherever they sit), and the predictions can be compared bit
  for bit. Triple ``i`` is documents ``(i + 1, i + 2, i)`` (mod the
  eligible count) of those of at least ``max(P, chars + 1)`` tokens.

  Raises:
    ValueError: ``chars`` outside ``[1, seq_len - 1]``, or fewer than three
      documents of at least ``chars + 1`` tokens.
  """
  if not 1 <= chars < seq_len:
    raise ValueError(f"chars must lie in [1, seq_len - 1] = [1, "
                     f"{seq_len - 1}], got {chars}.")
  docs = documents_of(packed)
  lengths = sorted((len(d) for d in docs if len(d) >= chars + 1),
                   reverse=True)
  if len(lengths) < 3:
    raise ValueError(
        f"leakage needs three documents of at least {chars + 1} tokens "
        f"(BOS and chars={chars} characters), got {len(lengths)} of "
        f"{len(docs)}: lower doc_start_chars.")
  before = min(seq_len - chars, lengths[2])  # P
  long = [i for i, d in enumerate(docs) if len(d) >= max(before, chars + 1)]
  triples = [(long[(i + 1) % len(long)], long[(i + 2) % len(long)], long[i])
             for i in range(min(count, len(long)))]
  ids = np.concatenate([np.full(before, 1, np.int32),
                        np.full(chars + 1, 2, np.int32)])
  rows = np.stack([np.stack([np.concatenate([docs[p][-before:],
                                             docs[d][:chars + 1]])
                             for p in (a, b)]) for a, b, d in triples], 1)
  return LeakageRows(
      inputs=rows[..., :-1].astype(np.int32),
      segment_ids=np.broadcast_to(ids[:-1], rows[..., :-1].shape).copy(),
      targets=np.stack([docs[d][1:chars + 1] for _, _, d in triples]),
      offset=before, triples=triples)


@nnx.jit
def _log_probs(model, inputs, segment_ids):
  return jax.nn.log_softmax(model(inputs, segment_ids), axis=-1)


def leakage(model: lm_model.DecoderLM, variant: str, rows: LeakageRows) -> dict:
  """How much D's first characters' predictions depend on its predecessor.

  ``rows`` are scored the way ``variant`` packs (segment ids, or for
  ``naive`` one undivided causal row). Compares, per triple and position,
  the next-character distributions after A (``p``) and after B (``q``):
  ``KL(p || q)`` in bits, ``|log p - log q|`` (nats, every character of the
  vocabulary) and the bits of D's actual next character.

  Returns:
    ``max_abs_log_prob_diff`` (nats), ``mean_kl_bits``,
    ``mean_abs_bits_diff`` (per character), ``bits_per_char_abs_diff``
    (``|bits/char after A - after B|`` over the C characters, mean over
    triples), ``bitwise_equal``, per-position means ``kl_bits_per_position``
    and ``abs_bits_diff_per_position`` (``[C]``), ``chars``, ``triples``.
  """
  two, count, width = rows.inputs.shape
  chars = rows.targets.shape[1]
  log_p = np.asarray(_log_probs(
      model, jnp.asarray(rows.inputs.reshape(two * count, width)),
      jnp.asarray(attended_ids(variant, rows.segment_ids).reshape(
          two * count, width))))
  log_p = log_p.reshape(two, count, width, -1)[
      :, :, rows.offset:rows.offset + chars]  # [2, K, C, V] float32
  after_a, after_b = log_p.astype(np.float64)
  kl = (np.exp(after_a) * (after_a - after_b)).sum(-1) / math.log(2)  # [K, C]
  pick = lambda lp: -np.take_along_axis(  # noqa: E731
      lp, rows.targets[..., None], -1)[..., 0] / math.log(2)  # [K, C] bits
  bits_a, bits_b = pick(after_a), pick(after_b)
  return {
      "chars": chars, "triples": count, "predecessor_tokens": rows.offset,
      "bitwise_equal": bool(np.array_equal(log_p[0], log_p[1])),
      "max_abs_log_prob_diff": float(np.abs(after_a - after_b).max()),
      "mean_kl_bits": float(kl.mean()),
      "mean_abs_bits_diff": float(np.abs(bits_a - bits_b).mean()),
      "bits_per_char_abs_diff": float(np.abs(bits_a.mean(1)
                                             - bits_b.mean(1)).mean()),
      "kl_bits_per_position": kl.mean(0).tolist(),
      "abs_bits_diff_per_position": np.abs(bits_a - bits_b).mean(0).tolist()}


def _chars(vocab: lm_data.Vocab, tokens) -> list[str]:
  return ["<s>" if t == lm_data.BOS else vocab.decode([t]) for t in tokens]


def generation(model: lm_model.DecoderLM, corpus: lm_data.Corpus,
               config: LMConfig) -> dict:
  """Greedy and sampled continuations of ``config.prompts`` with the KV
  cache, their throughput, and cached greedy vs full recomputation."""
  vocab = corpus.vocab
  prompts = [np.concatenate([[lm_data.BOS], vocab.encode(p)])
             for p in config.prompts]
  greedy, check = lm_generate.check_cached_greedy(model, prompts,
                                                  config.gen_tokens)
  out = {"check": check, "greedy": [vocab.decode(t) for t in greedy.tokens],
         "throughput": {"greedy": _rates(greedy)}}
  if config.temperature > 0:
    sampled = lm_generate.generate(
        model, prompts, config.gen_tokens, temperature=config.temperature,
        top_k=config.top_k, seed=config.train.seed)
    out["sampled"] = [vocab.decode(t) for t in sampled.tokens]
    out["throughput"]["sampled"] = _rates(sampled)
  return out


def _rates(g: lm_generate.Generation) -> dict:
  return {"prefill_tokens_per_s": g.prefill_tokens / g.prefill_seconds,
          "decode_tokens_per_s": (g.decode_tokens / g.decode_seconds
                                  if g.decode_tokens else 0.0),
          "prefill_tokens": g.prefill_tokens,
          "decode_tokens": g.decode_tokens}


def run(config: LMConfig) -> dict:
  """Trains and evaluates every variant of ``config.variants``; writes the
  report. Raises ``RuntimeError`` after writing it if cached generation
  disagreed with recomputation."""
  report.check_writable(config.workdir)
  mesh = training.training_mesh(config.train, sequence=True)
  corpus = lm_data.build_corpus(config.seq_len, config.valid_fraction,
                                config.train.seed)
  rows = leakage_rows(corpus.valid, config.seq_len,
                      leakage_chars(config))
  results, analyses = {}, {}
  for variant in config.variants:
    with jax.set_mesh(mesh):
      model = build_model(variant, config, corpus.vocab.size, mesh)
    ckpt = checkpoints.Checkpointer(
        os.path.join(config.workdir, "checkpoints", variant),
        fingerprint(variant, config))
    timed = _TimedStep()
    try:
      stats = training.train(
          variant, model, config.train, ckpt, mesh,
          batches=functools.partial(train_batch, corpus, config, variant,
                                    devices=layout_devices(config, mesh)),
          step_fn=timed)
    finally:
      ckpt.close()
    # What follows needs weights and a KV cache: every layer's attention
    # unsplit again (the same parameters).
    model.set_attention(None)
    trained = stats["steps"] - stats["resumed_from"]
    steady = stats["seconds"] - timed.first_seconds
    # None: no step ran here (a rerun restored every step); not a zero.
    stats["first_step_seconds"] = timed.first_seconds if trained else None
    # None: too few steps ran here to time (e.g. everything was restored).
    stats["steady_steps_per_s"] = ((trained - 1) / steady
                                   if trained > 1 and steady > 0 else None)
    with jax.set_mesh(mesh):
      valid = evaluate(model, variant, corpus.valid, config.train.batch_size,
                       config.doc_start_chars, mesh)
      gen = generation(model, corpus, config)
      analyses[variant] = attention_analysis(model, variant, corpus)
      leaks = leakage(model, variant, rows)
    results[variant] = {
        "train": stats, "valid": valid, "generation": gen,
        "cross_document_mass": analyses[variant]["cross_document_mass"],
        "leakage": leaks}
  names = corpus.valid_names
  payload = {"config": report.jsonable(dataclasses.asdict(config)),
             "corpus": _corpus_stats(corpus),
             "leakage_documents": [
                 {"a": names[a], "b": names[b], "d": names[d]}
                 for a, b, d in rows.triples],
             "variants": report.jsonable(results)}
  if jax.process_index() == 0:  # one writer when several hosts run this
    _write_report(config, corpus, results, analyses, payload)
  failed = [v for v, r in results.items()
            if not r["generation"]["check"]["passed"]]
  if failed:
    raise RuntimeError(
        f"cached greedy generation differs from full recomputation for "
        f"{failed}: {[results[v]['generation']['check'] for v in failed]}")
  return payload


def _corpus_stats(corpus: lm_data.Corpus) -> dict:
  weights = lambda p: int(p.target_weights().sum())  # noqa: E731
  return {"train_documents": len(corpus.train_names),
          "valid_documents": corpus.valid_names,
          "train_chars": weights(corpus.train),
          "valid_chars": weights(corpus.valid),
          "train_rows": corpus.train.num_rows,
          "vocab_size": corpus.vocab.size,
          "unigram_entropy": corpus.unigram_entropy,
          "unigram_valid_bits_per_char": corpus.unigram_valid}


def _write_report(config: LMConfig, corpus: lm_data.Corpus, results: dict,
                  analyses: dict, payload: dict) -> None:
  """The plots, results.json and summary.md (also printed)."""
  workdir, vocab = config.workdir, corpus.vocab
  lm_plots.loss_curves(
      os.path.join(workdir, "loss_curves.png"),
      {v: [[s, loss / math.log(2)] for s, loss in r["train"]["loss_curve"]]
       for v, r in results.items()}, corpus.unigram_entropy,
      {v: r["valid"]["bits_per_char"] for v, r in results.items()})
  some = next(iter(analyses.values()))
  chars = _chars(vocab, some["boundary_tokens"])
  for variant, a in analyses.items():
    lm_plots.attention_grid(
        os.path.join(workdir, f"attention_{variant}.png"), a["maps"], chars,
        f"{variant}: attention at a validation document start (red lines)",
        a["boundary"])
  # The layer where the naive model looks across the boundary most.
  cross = (analyses.get("naive") or some)["cross_document_mass"]
  layer = int(np.argmax(cross))
  shown = {v: a for v, a in analyses.items() if v in ("segments", "naive")}
  lm_plots.boundary_comparison(
      os.path.join(workdir, "boundary_attention.png"),
      {v: a["maps"][layer].mean(0) for v, a in (shown or analyses).items()},
      chars, some["boundary"], layer)
  first = next(iter(analyses))
  a = analyses[first]
  lm_plots.where_it_looks(
      os.path.join(workdir, "where_it_looks.png"), a["looks"],
      _chars(vocab, a["sentence"][:a["query"] + 1]), a["query"],
      f'{first}: where does "{QUERY_WORD}" (its last character) look in '
      f'"{SENTENCE}"?')
  leaks = {v: r["leakage"] for v, r in results.items()}
  some_leak = next(iter(leaks.values()))
  lm_plots.leakage(
      os.path.join(workdir, "leakage.png"), leaks,
      f"One validation document after two different ones in a packed row: "
      f"its first {some_leak['chars']} characters' predictions, mean over "
      f"{some_leak['triples']} triples")
  report.write_json(os.path.join(workdir, "results.json"), payload)
  summary = _summary(config, corpus, results, analyses, payload)
  report.write_text(os.path.join(workdir, "summary.md"), summary)
  print(summary)


def _summary(config: LMConfig, corpus: lm_data.Corpus, results: dict,
             analyses: dict, payload: dict) -> str:
  stats, m, t = _corpus_stats(corpus), config.model, config.train
  rows = []
  for v, r in results.items():
    g, tp = r["generation"], r["generation"]["throughput"]["greedy"]
    check = g["check"]
    rows.append([
        v, r["valid"]["bits_per_char"], r["valid"]["bits_per_char_doc_start"],
        r["valid"]["bits_per_char_rest"],
        r["train"]["final_loss"] / math.log(2),
        r["train"]["steady_steps_per_s"]
        or (f"{r['train']['steps_per_s']:.3g} (restored, first step included)"
            if r["train"].get("steps_per_s") else "- (restored)"),
        tp["prefill_tokens_per_s"],
        tp["decode_tokens_per_s"],
        ("yes" if check["tokens_equal"] else
         "near tie" if check["passed"] else "NO") + (
            ", bitwise" if check["logits_bitwise_equal"] else
            f", logits within {check['max_abs_logit_diff']:.2g}"),
        ", ".join(f"{x:.3f}" for x in r["cross_document_mass"])])
  parts = [
      "# Character-level language model on Python's help topics\n",
      f"{stats['train_documents']} training documents "
      f"({stats['train_chars']} characters), "
      f"{len(corpus.valid_names)} validation documents "
      f"({stats['valid_chars']} characters: "
      f"{', '.join(corpus.valid_names)}); vocabulary {stats['vocab_size']}. "
      f"Unigram entropy of the training text: "
      f"{corpus.unigram_entropy:.3f} bits/char; the training unigram model "
      f"on the validation text: {corpus.unigram_valid:.3f} bits/char.\n",
      f"{m.num_layers} layers, D={m.d_model}, {m.num_heads} heads, FFN "
      f"{m.ffn_dim}, RoPE base {m.rope_base:g}, qk-norm "
      f"{'on' if m.normalize_qk else 'off'}; {t.steps} steps of "
      f"{t.batch_size} rows x {config.seq_len} characters, Adam "
      f"{t.learning_rate:g} (cosine), seed {t.seed}; window "
      f"{config.window}.\n",
      "## Validation bits per character\n",
      report.markdown_table(
          ["variant", "bits/char", f"first {config.doc_start_chars} chars "
           "of each document", "rest", "final train loss (bits)",
           "train steps/s", "prefill tokens/s", "decode tokens/s",
           "cached == recomputed greedy", "cross-document attention "
           "mass per layer"], rows) + "\n",
      "Steps/s exclude the first step (compilation). Cross-document mass: "
      "the attention weight the first characters of a validation document "
      "put on the previous document, averaged over heads and queries.\n",
  ]
  some = next(iter(results.values()))["leakage"]
  parts += [
      "## Leakage across documents\n",
      f"Each of {some['triples']} validation documents D scored after two "
      f"different validation documents A and B (their last "
      f"{some['predecessor_tokens']} tokens, so D starts at the same offset "
      f"in both rows), each row attended the way the variant packs; "
      f"compared: D's first {some['chars']} next-character distributions. "
      "Triples (A, B, D): " + "; ".join(
          f"({t['a']}, {t['b']}, {t['d']})"
          for t in payload["leakage_documents"]) + ".\n",
      report.markdown_table(
          ["variant", "bitwise equal", "max abs log p - log q (nats)",
           "mean KL(p, q) (bits)", "mean abs bits diff per char",
           f"abs bits/char diff over {some['chars']} chars"],
          [[v, "yes" if r["leakage"]["bitwise_equal"] else "no",
            r["leakage"]["max_abs_log_prob_diff"],
            r["leakage"]["mean_kl_bits"], r["leakage"]["mean_abs_bits_diff"],
            r["leakage"]["bits_per_char_abs_diff"]]
           for v, r in results.items()]) + "\n"]
  first = next(iter(analyses))
  a = analyses[first]
  chars = _chars(corpus.vocab, a["sentence"][:a["query"] + 1])
  mean = a["looks"][-1].mean(0)
  top = np.argsort(-mean)[:5]
  parts.append(
      f'## Where does "{QUERY_WORD}" look ({first}, last layer, mean over '
      f'heads)\n\n"{SENTENCE}", query = the last character of '
      f'"{QUERY_WORD}": ' + ", ".join(
          f"{chars[i]!r} at {i} ({mean[i]:.2f})" for i in top) + "\n")
  parts.append("## Samples\n")
  for v, r in results.items():
    g = r["generation"]
    for kind in ("greedy", "sampled"):
      if kind not in g:
        continue
      label = kind if kind == "greedy" else (
          f"sampled, temperature {config.temperature:g}, top-k "
          f"{config.top_k}")
      parts.append(f"### {v}, {label}\n")
      for prompt, text in zip(config.prompts, g[kind]):
        parts.append("```text\n" + prompt + "\u2502" + text + "\n```\n")
  return "\n".join(parts)
