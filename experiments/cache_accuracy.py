"""What a quantised KV cache costs: the LM's validation text read through it.

The validation documents are cut into rows of at most ``T`` transitions
(``row[:-1]`` inputs, ``row[1:]`` targets; rows of one document overlap by
one token, so every transition of the text is a target exactly once, and a
row starts with no context, as a packed row of the LM's evaluation does).
Each row is fed to ``DecoderLM.decode`` ``chunk`` tokens per call over a
paged cache of each storage format (teacher forcing: the text itself, never
generated tokens). A call's tokens are written to the cache first and then
attend through it, so with a quantised format every score and every value
a position sees, its own included, went through quantisation.

Per format, against the float32 cache (the reference):

* ``bits_per_char``: mean ``-log2 p(target)`` over every transition;
* ``greedy_agreement``: the share of positions whose argmax equals the
  float32 cache's (what greedy decoding would emit next, given the text);
* ``attention_max_abs_error``: per layer, the largest ``|out - out_f32|``
  of the attention output over every position (errors of earlier layers
  included: the whole model runs on the quantised cache), with the largest
  ``|out_f32|`` beside it for scale;
* ``bytes_per_token``: pages and scales of every layer over the tokens the
  pool holds.

Shape glossary: R rows, T transitions per row, C tokens per call, D model
width, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from experiments import lm
from experiments import lm_data
from experiments import lm_model

# The reference first: the others are compared with it.
FORMATS = ("float32", "bfloat16", "int8", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class Rows:
  """Validation rows, right-padded.

  Attributes:
    tokens: int32 ``[R, T + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``.
    lengths: int32 ``[R]``: real inputs (transitions) of each row.
  """
  tokens: np.ndarray
  lengths: np.ndarray


def validation_rows(packed: lm_data.Packed, row_tokens: int) -> Rows:
  """Every transition of the validation documents, in rows of at most
  ``row_tokens`` transitions that never cross a document.

  Raises:
    ValueError: ``row_tokens`` < 1.
  """
  if row_tokens < 1:
    raise ValueError(f"row_tokens must be >= 1, got {row_tokens}.")
  pieces = []
  for doc in lm.documents_of(packed):
    for start in range(0, len(doc) - 1, row_tokens):
      pieces.append(doc[start:start + row_tokens + 1])  # [<= T + 1]
  tokens = np.full((len(pieces), row_tokens + 1), lm_data.PAD, np.int32)
  for r, piece in enumerate(pieces):
    tokens[r, :len(piece)] = piece
  return Rows(tokens, np.array([len(p) - 1 for p in pieces], np.int32))


@functools.partial(jax.jit, static_argnums=0)  # small pools: not donated
def _read(graphdef, cache, rest, inputs, targets, lengths):
  """Appends ``inputs [R, C]`` (``lengths [R]`` real); the targets' bits
  ``[R, C]``, the argmax ``[R, C]`` and each layer's attention output
  ``[R, C, D]``."""
  model = nnx.merge(graphdef, cache, rest)
  logits, outs = model.decode(inputs, lengths, return_attention=True)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))  # [R, C, V]
  bits = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] / math.log(2)
  return (nnx.state(model, nnx.Cache), bits,
          jnp.argmax(logits, -1).astype(jnp.int32), outs)


def _pool_bytes(model: lm_model.DecoderLM) -> int:
  total = 0
  for block in model.blocks:
    a = block.attention
    for var in (a.cached_key, a.cached_value, a.cache_key_scales,
                a.cache_value_scales):
      if var is not None:
        total += var[...].nbytes
  return total


def cache_accuracy(model: lm_model.DecoderLM, rows: Rows, *,
                   formats=FORMATS, batch_rows: int = 128, chunk: int = 24,
                   page_size: int = 16) -> dict:
  """Reads ``rows`` through a paged cache of each format (see the module doc).

  Args:
    model: the LM; its cache is replaced (``init_paged_cache``).
    rows: ``validation_rows(...)``.
    formats: storage dtypes; the first is the reference.
    batch_rows: rows per call.
    chunk: ``C``, tokens a row appends per call.
    page_size: tokens per page.

  Returns:
    ``{format: {"bits_per_char", "greedy_agreement",
    "attention_max_abs_error" [layers], "attention_max_abs" [layers],
    "bytes_per_token", "positions"}}``.
  """
  t = rows.tokens.shape[1] - 1
  max_pages = -(-t // page_size)
  n = rows.tokens.shape[0]
  sums = {f: {"bits": 0.0, "agree": 0, "err": np.zeros(len(model.blocks)),
              "ref": np.zeros(len(model.blocks))} for f in formats}
  per_token = {}
  for start in range(0, n, batch_rows):
    tokens = np.full((batch_rows, t + 1), lm_data.PAD, np.int32)
    lengths = np.zeros(batch_rows, np.int32)
    part = slice(start, min(start + batch_rows, n))
    tokens[:part.stop - start] = rows.tokens[part]
    lengths[:part.stop - start] = rows.lengths[part]
    states = {}
    for f in formats:
      model.init_paged_cache(batch_rows, batch_rows * max_pages, page_size,
                             max_pages, dtype=f)
      per_token[f] = _pool_bytes(model) / (batch_rows * max_pages * page_size)
      states[f] = list(nnx.split(model, nnx.Cache, ...))
    for c in range(0, t, chunk):
      width = min(chunk, t - c)
      inputs = np.zeros((batch_rows, chunk), np.int32)
      targets = np.zeros((batch_rows, chunk), np.int32)
      inputs[:, :width] = tokens[:, c:c + width]
      targets[:, :width] = tokens[:, c + 1:c + 1 + width]
      real = np.clip(lengths - c, 0, chunk).astype(np.int32)  # [R]
      valid = np.arange(chunk)[None, :] < real[:, None]  # [R, C]
      results = {}
      for f in formats:
        graphdef, cache, rest = states[f]
        cache, bits, top, outs = _read(graphdef, cache, rest, inputs,
                                       targets, real)
        states[f][1] = cache
        results[f] = (np.asarray(bits), np.asarray(top),
                      [np.asarray(o) for o in outs])
      _, ref_top, ref_outs = results[formats[0]]
      for f in formats:
        bits, top, outs = results[f]
        s = sums[f]
        s["bits"] += float(bits[valid].sum())
        s["agree"] += int((top == ref_top)[valid].sum())
        for layer, (o, r) in enumerate(zip(outs, ref_outs)):
          s["err"][layer] = max(s["err"][layer],
                                float(np.abs(o - r)[valid].max(initial=0)))
          s["ref"][layer] = max(s["ref"][layer],
                                float(np.abs(r)[valid].max(initial=0)))
    for f in formats:  # no write was dropped (the pool holds every row)
      nnx.merge(*states[f]).check_cache()
  positions = int(rows.lengths.sum())
  return {f: {"bits_per_char": s["bits"] / positions,
              "greedy_agreement": s["agree"] / positions,
              "attention_max_abs_error": s["err"].tolist(),
              "attention_max_abs": s["ref"].tolist(),
              "bytes_per_token": per_token[f], "positions": positions}
          for f, s in sums.items()}
