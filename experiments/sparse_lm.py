"""``--experiment=sparse``: trainable sparse attention in a long-context LM.

Shape glossary: B batch, T context (characters), D model width, N heads, H
head dim, V vocabulary, c a selection's key block, nk = T / c key blocks.

The character LM of ``--experiment=lm`` (Python's help topics; no
network) read as one stream of documents (BOS between them, no segment
ids) in rows of ``--sparse_seq_len`` characters, so a query has thousands
of characters behind it and a selection has something to choose from.
The same model (pre-norm blocks of causal self-attention with rotary
positions and a GELU feed-forward) is trained from the same seed for the
same steps with each attention:

* ``dense``: causal attention (the flash kernel);
* ``moba``: ``aj.moba_attention``: each query reads its ``top_k`` key
  blocks of ``c`` by a mean-pooled gate, its own block included;
* ``moba_rows``: the same with rows of ``c`` queries choosing together by
  their mean query (``query_block=c``), so the flash walk reads exactly
  the chosen blocks;
* ``nsa``: ``aj.NativeSparseAttention``: compressed, selected (top-n blocks
  of ``c`` per key/value head) and sliding-window branches, gated;
* ``dsa``: DeepSeek's lightning indexer (``aj.LightningIndexer``) picks each
  query's top-k tokens; a dense warm-up first (the attention dense, the
  indexer trained by its KL loss towards it), then the sparse stage (the
  attention over the chosen tokens, the KL over them). The indexer's input
  is detached, so the KL trains the indexer alone.

Reported per variant: validation bits per character, the share of key
blocks the first layer's attention reads (of those causality leaves), the
median time of a training step, and ``selection.png``: for a few queries
of a validation row, the dense model's attention mass per key block
beside the blocks each sparse variant read. Written to ``--workdir``
(default ``runs/sparse``): ``results.json``, ``summary.md``,
``selection.png``. No checkpoints: a rerun trains again.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from experiments import config_flags
from experiments import lm_data
from experiments import report
from experiments import training
from experiments import transformer

VARIANTS = ("dense", "moba", "moba_rows", "nsa", "dsa")


@dataclasses.dataclass(frozen=True)
class SparseConfig:
  """What ``python run.py --experiment=sparse`` runs; fields are flags."""
  workdir: str = config_flags.field("runs/sparse", config_flags.WORKDIR)
  variants: tuple[str, ...] = config_flags.field(
      VARIANTS, f"sparse: variants to train, from {list(VARIANTS)}.",
      name="sparse_variants", choices=VARIANTS)
  seq_len: int = config_flags.field(
      4096, "sparse: characters per row (T), a multiple of "
      "--sparse_block.", name="sparse_seq_len", lower_bound=2)
  d_model: int = config_flags.field(128, "sparse: model width D.",
                                    name="sparse_d_model", lower_bound=1)
  num_heads: int = config_flags.field(
      4, "sparse: heads per layer.", name="sparse_heads", lower_bound=1,
      divides="d_model")
  num_layers: int = config_flags.field(2, "sparse: Transformer blocks.",
                                       name="sparse_layers", lower_bound=1)
  block: int = config_flags.field(
      128, "sparse: key block c of MoBA's and NSA's selection.",
      name="sparse_block", lower_bound=1)
  top_k_blocks: int = config_flags.field(
      4, "sparse: key blocks each query reads (MoBA: own included; NSA: "
      "first and local included).", name="sparse_top_k_blocks",
      lower_bound=1)
  nsa_stride: int = config_flags.field(
      16, "sparse: NSA's compression stride d (its blocks are 2d).",
      name="sparse_nsa_stride", lower_bound=1)
  nsa_window: int = config_flags.field(
      256, "sparse: NSA's sliding window.", name="sparse_nsa_window",
      lower_bound=1)
  top_k_tokens: int = config_flags.field(
      512, "sparse: tokens each query reads under DSA.",
      name="sparse_top_k_tokens", lower_bound=1)
  indexer_heads: int = config_flags.field(
      4, "sparse: DSA's indexer heads.", name="sparse_indexer_heads",
      lower_bound=1)
  indexer_dim: int = config_flags.field(
      16, "sparse: DSA's indexer head dim.", name="sparse_indexer_dim",
      lower_bound=2)
  warmup_steps: int = config_flags.field(
      50, "sparse: DSA's dense warm-up steps before the sparse stage.",
      name="sparse_warmup_steps", lower_bound=0)
  timed_turns: int = config_flags.field(
      5, "sparse: turns of the timed training steps (every variant once a "
      "turn, after training).", name="sparse_timed_turns", lower_bound=1)
  eval_rows: int = config_flags.field(
      16, "sparse: validation rows scored.", name="sparse_eval_rows",
      lower_bound=1)
  valid_fraction: float = 0.2  # of the documents, held out by document
  train: training.TrainConfig = config_flags.nested(
      training.TrainConfig(steps=250, batch_size=2, learning_rate=3e-3,
                           log_every=25),
      # No checkpoints and one device: --sparse_checkpoint_every and
      # --mesh would be read and ignored, so they are not its flags.
      expose={name: flag for name, flag in config_flags.training_flags(
          "sparse", "training steps per variant.", "rows per batch."
      ).items() if name not in ("checkpoint_every", "mesh")})


class Attention(nnx.Module):
  """One layer's causal self-attention of ``variant``:
  ``x [B, T, D] -> (y [B, T, D], indexer loss, selection or None)``."""

  def __init__(self, variant: str, config: SparseConfig, *, rngs: nnx.Rngs):
    d, n = config.d_model, config.num_heads
    self.variant, self.config = variant, config
    self.heads, self.head_dim = n, d // n
    self.rope = aj.Rope()
    if variant == "nsa":
      self.nsa = aj.NativeSparseAttention(
          d, n, n, d // n, block=2 * config.nsa_stride,
          stride=config.nsa_stride, select_block=config.block,
          top_n=config.top_k_blocks, window=config.nsa_window,
          rope=self.rope, implementation="flash", rngs=rngs)
      return
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    if variant == "dsa":
      self.indexer = aj.LightningIndexer(
          d, config.indexer_heads, config.indexer_dim,
          top_k=config.top_k_tokens, chunk=min(512, config.seq_len),
          rope=self.rope, block_q=64, block_k=config.block, rngs=rngs)

  def _heads(self, x):
    b, t, _ = x.shape
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    split = lambda a: a.reshape(b, t, self.heads, self.head_dim).transpose(  # noqa: E731
        0, 2, 1, 3)  # [B, N, T, H]
    positions = jnp.arange(t)[None, None, :]
    q, k = (aj.apply_rope(split(a), positions, rope=self.rope) for a in (q, k))
    return q, k, split(v)

  def __call__(self, x, *, sparse: bool = True):
    zero = jnp.zeros((), jnp.float32)
    if self.variant == "nsa":
      y, parts = self.nsa(x, return_branches=True)
      return y, zero, parts["chosen"]
    b, t, d = x.shape
    q, k, v = self._heads(x)
    causal = aj.Mask(causal=True)
    chosen, loss = None, zero
    if self.variant == "dense" or (self.variant == "dsa" and not sparse):
      out = aj.scaled_dot_product_attention(q, k, v, causal,
                                            implementation="flash")
      if self.variant == "dsa":  # the warm-up: the KL over every key
        loss = self.indexer.loss(x, q, k, scale=self.head_dim ** -0.5)
    elif self.variant in ("moba", "moba_rows"):
      c = self.config.block
      rows = c if self.variant == "moba_rows" else 1
      out = aj.moba_attention(q, k, v, causal, block=c,
                              top_k=self.config.top_k_blocks,
                              implementation="flash", query_block=rows)
      chosen = aj.moba_selection(q, k, causal, block=c,
                                 top_k=self.config.top_k_blocks,
                                 query_block=rows)
      chosen = jnp.repeat(chosen, rows, axis=2)[:, :, :t]  # [B, N, T, nk]
    else:  # dsa, sparse stage
      indices, selection = self.indexer(x)
      # The gathered kernel: each query over its k chosen keys, O(T * k).
      out = aj.scaled_dot_product_attention(
          q, k, v, aj.Mask(causal=True, rule=selection),
          implementation="gathered")
      loss = self.indexer.loss(x, q, k, scale=self.head_dim ** -0.5,
                               indices=indices)
      chosen = indices
    out = out.transpose(0, 2, 1, 3).reshape(b, t, d)
    return self.out(out), loss, chosen


class Block(nnx.Module):

  def __init__(self, variant: str, config: SparseConfig, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.attention = Attention(variant, config, rngs=rngs)
    self.norm2 = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.ffn = transformer.FeedForward(config.d_model, 4 * config.d_model,
                                       rngs=rngs)

  def __call__(self, x, *, sparse: bool = True):
    y, loss, chosen = self.attention(self.norm1(x), sparse=sparse)
    x = x + y
    return x + self.ffn(self.norm2(x)), loss, chosen


class SparseLM(nnx.Module):
  """Next-character logits ``[B, T, V]``, the indexers' summed loss and the
  first layer's selection."""

  def __init__(self, variant: str, config: SparseConfig, vocab_size: int, *,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab_size, config.d_model, rngs=rngs)
    self.blocks = nnx.List([Block(variant, config, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.norm = nnx.LayerNorm(config.d_model, rngs=rngs)
    self.head = nnx.Linear(config.d_model, vocab_size, rngs=rngs)

  def __call__(self, tokens, *, sparse: bool = True):
    x = self.embed(tokens)
    total, first = jnp.zeros((), jnp.float32), None
    for i, block in enumerate(self.blocks):
      x, loss, chosen = block(x, sparse=sparse)
      total, first = total + loss, chosen if i == 0 else first
    return self.head(self.norm(x)), total, first


def _bits(logits, targets, weights):
  """Summed cross-entropy in bits and the weight it is over."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return jnp.sum(nll * weights) / jnp.log(2.0), jnp.sum(weights)


def _loss(model, inputs, targets, weights, sparse):
  """Cross-entropy in nats plus the indexers' KL; aux: bits/char, KL."""
  logits, index_loss, _ = model(inputs, sparse=sparse)
  bits, count = _bits(logits, targets, weights)
  return bits / count * jnp.log(2.0) + index_loss, (bits / count, index_loss)


@nnx.jit(static_argnames="sparse")
def train_step(model, optimizer, inputs, targets, weights, *, sparse):
  (_, (bits, index_loss)), grads = nnx.value_and_grad(
      _loss, has_aux=True)(model, inputs, targets, weights, sparse)
  optimizer.update(model, grads)
  return bits, index_loss


@nnx.jit
def gradient_step(model, inputs, targets, weights):
  """A training step's forward and backward (no update): what is timed."""
  (loss, _), grads = nnx.value_and_grad(_loss, has_aux=True)(
      model, inputs, targets, weights, True)
  return loss, grads


@nnx.jit
def eval_step(model, inputs, targets, weights):
  logits, _, chosen = model(inputs)
  bits, count = _bits(logits, targets, weights)
  return bits, count, chosen


def _rows(packed: lm_data.Packed, rows):
  tokens = packed.tokens[rows]
  return (jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]),
          jnp.asarray(packed.target_weights()[rows]))


def block_share(variant: str, chosen, config: SparseConfig) -> float | None:
  """Of the (query, key block) pairs causality leaves, the share the
  selection reads (per head or key/value head, averaged)."""
  if chosen is None:
    return None if variant != "dense" else 1.0
  t, c = config.seq_len, config.block
  nk = t // c
  own = np.arange(t) // c  # each query's own block
  causal = (np.arange(nk)[None, :] <= own[:, None])  # [T, nk]
  chosen = np.asarray(chosen)
  if variant == "dsa":  # [B, T, k] tokens -> the blocks they lie in
    hits = np.zeros(chosen.shape[:2] + (nk,), bool)
    b, q, j = np.nonzero(chosen >= 0)
    hits[b, q, chosen[b, q, j] // c] = True
    chosen = hits[:, None]
  return float((chosen & causal).sum() / (causal.sum() * np.prod(
      chosen.shape[:2])))


def train_variant(variant: str, config: SparseConfig,
                  corpus: lm_data.Corpus) -> tuple[SparseLM, dict]:
  model = SparseLM(variant, config, corpus.vocab.size,
                   rngs=nnx.Rngs(config.train.seed))
  optimizer = training.make_optimizer(model, config.train)
  times, history = [], []
  for step in range(config.train.steps):
    rows = lm_data.batch_rows(corpus.train.num_rows, step,
                              config.train.batch_size, config.train.seed)
    sparse = not (variant == "dsa" and step < config.warmup_steps)
    start = time.perf_counter()
    bits, index_loss = train_step(model, optimizer, *_rows(corpus.train,
                                                           rows),
                                  sparse=sparse)
    jax.block_until_ready(bits)
    times.append(time.perf_counter() - start)
    if step % config.train.log_every == 0 or step == config.train.steps - 1:
      history.append({"step": step, "bits_per_char": float(bits),
                      "indexer_loss": float(index_loss)})
      print(f"  {variant} step {step}: {float(bits):.3f} bits/char, "
            f"indexer KL {float(index_loss):.3f}", flush=True)
  # The first step of each stage compiles: the median of the others.
  steady = [s for i, s in enumerate(times)
            if i not in (0, config.warmup_steps)]
  return model, {"history": history, "training_step_seconds":
                 statistics.median(steady or times)}


def timed_in_turns(models: dict, config: SparseConfig,
                   corpus: lm_data.Corpus) -> dict:
  """``{variant: [seconds per turn]}`` of a training step's forward and
  backward on one batch, every variant once a turn (load that shifts
  during the run falls on all of them alike)."""
  rows = lm_data.batch_rows(corpus.train.num_rows, 0,
                            config.train.batch_size, config.train.seed)
  batch = _rows(corpus.train, rows)
  for model in models.values():  # compiled and warmed, untimed
    jax.block_until_ready(gradient_step(model, *batch))
  times = {v: [] for v in models}
  for _ in range(config.timed_turns):
    for variant, model in models.items():
      start = time.perf_counter()
      jax.block_until_ready(gradient_step(model, *batch))
      times[variant].append(time.perf_counter() - start)
  return times


def evaluate(model: SparseLM, variant: str, config: SparseConfig,
             corpus: lm_data.Corpus) -> dict:
  rows = np.arange(min(config.eval_rows, corpus.valid.num_rows))
  bits = count = 0.0
  shares = []
  for i in range(0, len(rows), config.train.batch_size):
    b, n, chosen = eval_step(model, *_rows(corpus.valid,
                                           rows[i:i + config.train.batch_size]))
    bits, count = bits + float(b), count + float(n)
    shares.append(block_share(variant, chosen, config))
  return {"bits_per_char": bits / count,
          "block_share": None if shares[0] is None else float(
              np.mean(shares))}


def run(config: SparseConfig) -> dict:
  """Trains every variant of ``config.variants``; writes the report."""
  if config.seq_len % config.block:
    raise ValueError(f"--sparse_seq_len={config.seq_len} must be a multiple "
                     f"of --sparse_block={config.block}.")
  report.check_writable(config.workdir)
  corpus = lm_data.build_corpus(config.seq_len, config.valid_fraction,
                                config.train.seed)
  results, models = {}, {}
  for variant in config.variants:
    print(f"training {variant} ...", flush=True)
    models[variant], stats = train_variant(variant, config, corpus)
    results[variant] = {**stats, **evaluate(models[variant], variant, config,
                                            corpus)}
  print("timing a training step of each, in turns ...", flush=True)
  turns = timed_in_turns(models, config, corpus)
  for variant, times in turns.items():
    results[variant]["step_seconds"] = statistics.median(times)
    results[variant]["step_seconds_turns"] = times
    if "dense" in turns:  # each turn's ratio: its spread
      results[variant]["vs_dense_turns"] = [
          t / d for t, d in zip(times, turns["dense"])]
  payload = {"config": report.jsonable(dataclasses.asdict(config)),
             "machine": _machine(), "variants": report.jsonable(results)}
  if jax.process_index() == 0:
    _write_report(config, corpus, models, results, payload)
  return payload


def _machine() -> str:
  return (f"{os.cpu_count()}-core {jax.default_backend()}, jax "
          f"{jax.__version__}")


def _write_report(config, corpus, models, results, payload) -> None:
  from experiments import sparse_plots  # matplotlib only when reporting
  os.makedirs(config.workdir, exist_ok=True)
  report.write_json(os.path.join(config.workdir, "results.json"), payload)
  rows = []
  for variant, r in results.items():
    share, ratios = r["block_share"], r.get("vs_dense_turns")
    rows.append([variant, f"{r['bits_per_char']:.3f}",
                 "-" if share is None else f"{share:.2f}",
                 f"{r['step_seconds']:.2f}",
                 "-" if not ratios else (
                     f"{statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f})"),
                 f"{r['training_step_seconds']:.2f}"])
  table = report.markdown_table(
      ["variant", "valid bits/char", "key blocks read (of causal)",
       "fwd+bwd s (median of turns)", "vs dense (min-max)",
       "step s while training"], rows)
  text = (f"# Sparse attention, T = {config.seq_len}\n\n"
          f"{config.train.steps} steps of {config.train.batch_size} rows, "
          f"{config.num_layers} layers, D = {config.d_model}, "
          f"N = {config.num_heads}; a training step's forward and backward "
          f"timed in {config.timed_turns} turns after training; "
          f"{_machine()}.\n\n{table}\n")
  report.write_text(os.path.join(config.workdir, "summary.md"), text)
  print(text)
  sparse_plots.selection_figure(
      os.path.join(config.workdir, "selection.png"), models, config,
      _rows(corpus.valid, np.arange(1))[0])
