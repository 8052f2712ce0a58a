"""Accuracy under greedy decoding and alignment quality of attention maps.

Shape glossary: B batch, T output positions, S source positions, L the
source length of an evaluation batch (all examples share it).

Alignment (Luong et al. 2015 measure AER by forced decoding): with teacher
forcing, output position ``i`` should attend to its gold source position
``pi(i)`` (``i`` for copy, ``L - 1 - i`` for reverse). For the first ``L``
outputs (the EOS step has no gold position):

* ``align_acc``: share whose attention argmax is ``pi(i)`` (= 1 - AER);
* ``align_acc_pm1``: share whose argmax is within one position of ``pi(i)``;
* ``gold_mass``: mean attention weight on ``pi(i)``;
* ``offset``: mean centre of mass ``sum_j j a_ij - pi(i)`` (signed);
* ``entropy``: mean entropy of the attention row over ``log L`` (1 = uniform).
"""

from __future__ import annotations

import numpy as np

from experiments import data


def sequence_metrics(predicted: np.ndarray, batch: data.Batch) -> dict:
  """Token and whole-sequence accuracy of greedy outputs.

  Args:
    predicted: int ``[B, >= T]`` greedy tokens.
    batch: the evaluation batch (targets include EOS).

  Returns:
    ``{"token_acc", "seq_acc"}`` over the target positions (EOS included).
  """
  gold = batch.tgt_out
  predicted = np.asarray(predicted)[:, :gold.shape[1]]
  mask = batch.tgt_mask
  correct = (predicted == gold) & mask
  return {
      "token_acc": float(correct.sum() / mask.sum()),
      "seq_acc": float(np.mean(correct.sum(1) == mask.sum(1))),
  }


def alignment_metrics(attention: np.ndarray, length: int, task: str) -> dict:
  """Alignment of teacher-forced attention maps against the gold positions.

  Args:
    attention: ``[B, T, S]`` weights (rows for outputs ``0..T-1``), from a
      batch whose sources all have ``length`` tokens.
    length: ``L``.
    task: ``"copy"`` or ``"reverse"``.

  Returns:
    The five metrics of the module docstring.
  """
  a = np.asarray(attention, np.float64)[:, :length, :length]  # [B, L, L]
  gold = data.gold_position(length, task)  # [L]
  argmax = a.argmax(-1)  # [B, L]
  positions = np.arange(length)
  centre = (a * positions[None, None, :]).sum(-1)  # [B, L]
  total = a.sum(-1)
  p = a / np.where(total > 0, total, 1.0)[..., None]
  entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)
  return {
      "align_acc": float(np.mean(argmax == gold[None])),
      "align_acc_pm1": float(np.mean(np.abs(argmax - gold[None]) <= 1)),
      "gold_mass": float(np.mean(a[:, positions, gold])),
      "offset": float(np.mean(centre - gold[None])),
      "entropy": float(np.mean(entropy) / np.log(length)) if length > 1
                 else 0.0,
  }
