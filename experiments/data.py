"""Random-token copy and reverse tasks, generated on the fly.

Shape glossary: B batch, S source length (padded), T target length (padded,
S + 1 for the EOS token).

Vocabulary: 0 PAD, 1 BOS, 2 EOS, then ``vocab_size`` content tokens. A batch
of lengths drawn from ``[min_len, max_len]`` is padded to ``max_len`` so every
training step has the same shapes (one compile). Batches are a pure function
of ``(seed, step)``: a resumed run sees exactly the data an uninterrupted run
would have seen.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
TASKS = ("copy", "reverse")


@dataclasses.dataclass(frozen=True)
class Batch:
  src: np.ndarray  # int32 [B, S]: content tokens, PAD after src_len
  src_len: np.ndarray  # int32 [B]
  tgt_in: np.ndarray  # int32 [B, T]: BOS + target (teacher forcing input)
  tgt_out: np.ndarray  # int32 [B, T]: target + EOS, PAD after
  tgt_len: np.ndarray  # int32 [B]: src_len + 1 (EOS included)

  @property
  def tgt_mask(self) -> np.ndarray:
    """bool [B, T]: positions that count in the loss."""
    return np.arange(self.tgt_out.shape[1])[None, :] < self.tgt_len[:, None]


def target_of(src: np.ndarray, length: int, task: str) -> np.ndarray:
  """The target tokens for one source of ``length`` tokens."""
  if task == "copy":
    return src[:length]
  if task == "reverse":
    return src[:length][::-1]
  raise ValueError(f"task must be one of {TASKS}, got {task!r}.")


def gold_position(length: int, task: str) -> np.ndarray:
  """pi(i): the source position output ``i`` should attend to, ``[length]``."""
  i = np.arange(length)
  return i if task == "copy" else length - 1 - i


def make_batch(task: str, lengths: np.ndarray, max_len: int, vocab_size: int,
               rng: np.random.Generator) -> Batch:
  """A batch with the given source ``lengths``, padded to ``max_len``."""
  lengths = np.asarray(lengths, np.int32)
  b = lengths.shape[0]
  src = np.full((b, max_len), PAD, np.int32)
  tgt_in = np.full((b, max_len + 1), PAD, np.int32)
  tgt_out = np.full((b, max_len + 1), PAD, np.int32)
  tokens = rng.integers(NUM_SPECIAL, NUM_SPECIAL + vocab_size, (b, max_len),
                        dtype=np.int32)
  for row, n in enumerate(lengths):
    src[row, :n] = tokens[row, :n]
    target = target_of(tokens[row], n, task)
    tgt_in[row, 0] = BOS
    tgt_in[row, 1:n + 1] = target
    tgt_out[row, :n] = target
    tgt_out[row, n] = EOS
  return Batch(src, lengths, tgt_in, tgt_out, lengths + 1)


def train_batch(task: str, step: int, *, seed: int, batch_size: int,
                min_len: int, max_len: int, vocab_size: int) -> Batch:
  """The training batch of ``step``; lengths uniform in [min_len, max_len]."""
  rng = np.random.default_rng([seed, step])
  lengths = rng.integers(min_len, max_len + 1, batch_size)
  return make_batch(task, lengths, max_len, vocab_size, rng)


def eval_batch(task: str, length: int, *, seed: int, num_examples: int,
               vocab_size: int) -> Batch:
  """``num_examples`` sources of exactly ``length`` tokens (held-out seed)."""
  rng = np.random.default_rng([seed, 1_000_003, length])
  lengths = np.full(num_examples, length, np.int32)
  return make_batch(task, lengths, length, vocab_size, rng)
