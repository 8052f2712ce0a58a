"""Character-level text for the language model: Python's own help topics.

The corpus is ``pydoc_data.topics`` (the language reference's help texts,
shipped with every CPython: 79 documents, about 465 KB of English with code
fragments), so nothing is downloaded. Everything here is NumPy: the split,
the vocabulary and the packed rows are pure functions of their arguments,
and the batch of training step ``s`` is a pure function of ``(seed, s)``.

Packing: each document becomes ``[BOS, c_1, ..., c_n]``; the documents are
concatenated into one stream and cut into rows of ``T + 1`` tokens that
overlap by one (row ``r`` is ``stream[r T : r T + T + 1]``), so every
transition of the stream is a target exactly once. Inputs are ``row[:-1]``,
targets ``row[1:]``. A row holds pieces of several documents: its segment
ids number them ``1, 2, ...`` within the row (0 is padding after the last
document), and a target counts only when it belongs to the same document as
its input (the first character of a document is predicted from its BOS,
never from the previous document's last character).

Shape glossary: R packed rows, B batch, T length (``seq_len``), V vocab.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PAD, BOS, UNK = 0, 1, 2
NUM_SPECIAL = 3


def load_documents() -> dict[str, str]:
  """The help topics, ``{name: text}`` in name order (CPython's own text)."""
  from pydoc_data.topics import topics  # noqa: PLC0415 - only when needed
  return {name: topics[name] for name in sorted(topics)}


def split_documents(names, valid_fraction: float,
                    seed: int) -> tuple[list[str], list[str]]:
  """Splits document names into ``(train, valid)``, by document.

  A seeded permutation decides; each side keeps name order. At least one
  document goes to each side.

  Raises:
    ValueError: fewer than two documents, or a fraction outside (0, 1).
  """
  names = sorted(names)
  if len(names) < 2:
    raise ValueError(f"need at least two documents to split, got "
                     f"{len(names)}.")
  if not 0.0 < valid_fraction < 1.0:
    raise ValueError(f"valid_fraction must lie in (0, 1), got "
                     f"{valid_fraction}.")
  count = min(max(1, round(valid_fraction * len(names))), len(names) - 1)
  order = np.random.default_rng(seed).permutation(len(names))
  valid = set(order[:count].tolist())
  return ([n for i, n in enumerate(names) if i not in valid],
          [n for i, n in enumerate(names) if i in valid])


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Characters of the training text; ids 0-2 are PAD, BOS, UNK."""
  chars: str

  @classmethod
  def from_texts(cls, texts) -> Vocab:
    return cls("".join(sorted(set("".join(texts)))))

  @property
  def size(self) -> int:  # V
    return NUM_SPECIAL + len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    """``text`` as int32 ids; characters outside the vocabulary are UNK."""
    ids = {c: NUM_SPECIAL + i for i, c in enumerate(self.chars)}
    return np.array([ids.get(c, UNK) for c in text], np.int32)

  def decode(self, ids) -> str:
    """Ids back to text: PAD and BOS vanish, UNK shows as U+FFFD."""
    out = []
    for i in np.asarray(ids).tolist():
      if i >= NUM_SPECIAL:
        out.append(self.chars[i - NUM_SPECIAL])
      elif i == UNK:
        out.append("\ufffd")
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class Packed:
  """Packed rows of ``T + 1`` tokens (inputs ``[:, :-1]``, targets ``[:, 1:]``).

  Attributes:
    tokens: int32 ``[R, T + 1]``.
    segment_ids: int32 ``[R, T + 1]``: documents numbered from 1 within each
      row, 0 for padding.
    doc_positions: int32 ``[R, T + 1]``: each token's index in its document
      (BOS is 0, the first character 1); -1 for padding.
  """
  tokens: np.ndarray
  segment_ids: np.ndarray
  doc_positions: np.ndarray

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  def target_weights(self) -> np.ndarray:
    """float32 ``[R, T]``: 1 where a target belongs to its input's document."""
    seg = self.segment_ids
    return ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(np.float32)


def pack(documents, seq_len: int) -> Packed:
  """Packs encoded documents (``[n]`` int arrays, BOS added here) into rows.

  Raises:
    ValueError: ``seq_len`` < 1 or no documents.
  """
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}.")
  if not documents:
    raise ValueError("no documents to pack.")
  pieces = [np.concatenate([[BOS], np.asarray(d, np.int32)])
            for d in documents]
  stream = np.concatenate(pieces).astype(np.int32)
  doc = np.concatenate([np.full(len(p), i, np.int32)
                        for i, p in enumerate(pieces)])
  position = np.concatenate([np.arange(len(p), dtype=np.int32)
                             for p in pieces])
  rows = max(1, math.ceil((len(stream) - 1) / seq_len))
  width = seq_len + 1
  pad = rows * seq_len + 1 - len(stream)
  stream = np.concatenate([stream, np.full(pad, PAD, np.int32)])
  doc = np.concatenate([doc, np.full(pad, -1, np.int32)])
  position = np.concatenate([position, np.full(pad, -1, np.int32)])
  index = np.arange(rows)[:, None] * seq_len + np.arange(width)[None, :]
  tokens, row_doc = stream[index], doc[index]  # [R, T + 1]
  # Documents increase along the stream: renumber from 1 within each row.
  segment_ids = np.where(row_doc >= 0, row_doc - row_doc[:, :1] + 1, 0)
  return Packed(tokens, segment_ids.astype(np.int32), position[index])


def batch_rows(num_rows: int, step: int, batch_size: int,
               seed: int) -> np.ndarray:
  """Row indices ``[B]`` of training step ``step``: a new permutation each
  epoch (``default_rng([seed, epoch])``), read in order."""
  flat = step * batch_size + np.arange(batch_size)
  epochs, within = np.divmod(flat, num_rows)
  out = np.empty(batch_size, np.int64)
  for epoch in np.unique(epochs):
    perm = np.random.default_rng([seed, int(epoch)]).permutation(num_rows)
    out[epochs == epoch] = perm[within[epochs == epoch]]
  return out


def batch(packed: Packed, rows) -> tuple[np.ndarray, ...]:
  """``(inputs, targets, weights, segment_ids)``, each ``[B, T]``, of ``rows``.

  ``segment_ids`` are the inputs' (queries' and keys').
  """
  rows = np.asarray(rows)
  tokens = packed.tokens[rows]
  return (tokens[:, :-1], tokens[:, 1:], packed.target_weights()[rows],
          packed.segment_ids[rows, :-1])


def unigram_entropy(text: str) -> float:
  """Bits per character of ``text`` under its own character frequencies."""
  _, counts = np.unique(np.frombuffer(text.encode("utf-32-le"), np.uint32),
                        return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log2(p)).sum())


def unigram_cross_entropy(train_text: str, vocab: Vocab, text: str) -> float:
  """Bits per character of ``text`` under ``train_text``'s add-one-smoothed
  unigram model over ``vocab`` (the baseline a model has to beat)."""
  counts = np.bincount(vocab.encode(train_text), minlength=vocab.size)
  counts = counts.astype(np.float64) + 1.0  # add-one, UNK included
  counts[[PAD, BOS]] = 0.0  # never a character of the text
  p = counts / counts.sum()
  return float(-np.mean(np.log2(p[vocab.encode(text)])))


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The split, its vocabulary and packed rows, and the unigram baselines.

  Attributes:
    train_names / valid_names: document names of each side.
    vocab: characters of the training documents.
    train / valid: packed rows of each side.
    unigram_entropy: bits/char of the training text under its own
      character frequencies.
    unigram_valid: bits/char of the validation text under the training
      text's (add-one smoothed) frequencies.
  """
  train_names: list[str]
  valid_names: list[str]
  vocab: Vocab
  train: Packed
  valid: Packed
  unigram_entropy: float
  unigram_valid: float


def build_corpus(seq_len: int, valid_fraction: float, seed: int,
                 documents: dict[str, str] | None = None) -> Corpus:
  """Splits, encodes and packs ``documents`` (default: the help topics)."""
  documents = load_documents() if documents is None else documents
  train_names, valid_names = split_documents(documents, valid_fraction, seed)
  train_text = "".join(documents[n] for n in train_names)
  valid_text = "".join(documents[n] for n in valid_names)
  vocab = Vocab.from_texts(documents[n] for n in train_names)
  encode = lambda names: [vocab.encode(documents[n]) for n in names]  # noqa: E731
  return Corpus(train_names, valid_names, vocab,
                pack(encode(train_names), seq_len),
                pack(encode(valid_names), seq_len),
                unigram_entropy(train_text),
                unigram_cross_entropy(train_text, vocab, valid_text))


def boundary_window(packed: Packed, half: int) -> tuple[np.ndarray,
                                                        np.ndarray, int]:
  """Inputs around a document start: up to ``half`` tokens of the previous
  document, then as many of the new one, all from one row.

  Takes the first start with the most context on both sides (``half``
  when a row allows it).

  Returns:
    ``(tokens [W], segment_ids [W], boundary)``: ``W`` is twice the context
    found and ``boundary`` the index of the new document's BOS. Without a
    start after a row's first token anywhere: row 0's first ``2 * half``
    inputs and boundary 0.
  """
  inputs, seg = packed.tokens[:, :-1], packed.segment_ids[:, :-1]
  best, where = 0, None
  for r in range(packed.num_rows):
    for p in np.flatnonzero(inputs[r, 1:] == BOS).tolist():
      p += 1
      before = p - np.flatnonzero(seg[r, :p] != seg[r, p - 1]).max(
          initial=-1) - 1  # tokens of the previous document in this row
      after = int(np.sum(seg[r, p:] == seg[r, p]))
      context = min(half, before, after)
      if context > best:
        best, where = context, (r, p)
        if best == half:
          break
    if best == half:
      break
  if where is None:
    return inputs[0, :2 * half], seg[0, :2 * half], 0
  r, p = where
  return inputs[r, p - best:p + best], seg[r, p - best:p + best], best
