"""The ring's step schedule: exactly the steps some device needs.

``ring.needed_steps`` decides, from shapes and window bounds alone, which
of the ``P`` ring steps any device may see a key at (the others are never
computed and their ``ppermute`` is jumped over). A step left out that is
needed drops keys silently; so it is compared here, exhaustively over small
shapes, with a brute-force reading of the global mask (bottom-right
aligned, jax.nn's window) written from the conventions. No devices needed:
the schedule is plain Python.
"""

import itertools

from absl.testing import absltest
import numpy as np

from attention_jax.kernels import flash_core
from attention_jax.kernels import ring
from attention_jax.masking import intervals

WINDOWS = (None, (0, 0), (1, 0), (0, 1), (2, 3), (3, 2), (5, 0), (0, 6),
           (7, 1), (12, 12))


def _brute_force(size, t, s, causal, window):
  """Steps k at which some device i sees a key of device (i - k) mod P."""
  big_t, big_s = size * t, size * s
  i = np.arange(big_t)[:, None] + (big_s - big_t)  # aligned query positions
  j = np.arange(big_s)[None, :]
  ok = np.ones((big_t, big_s), bool)
  if causal:
    ok &= j <= i
  if window is not None:
    ok &= (j >= i - window[0]) & (j <= i + window[1])
  steps = [k for k in range(size)
           if any(ok[d * t:(d + 1) * t,
                     ((d - k) % size) * s:((d - k) % size + 1) * s].any()
                  for d in range(size))]
  return tuple(steps) or (0,)  # nothing visible: one step still runs


class NeededStepsTest(absltest.TestCase):

  def test_equals_brute_force(self):
    checked = 0
    for size, t, s, causal, window in itertools.product(
        (1, 2, 3, 4, 8), range(1, 6), range(1, 6), (False, True), WINDOWS):
      st = flash_core.Static(scale=1.0,
                             bounds=intervals.bounds(causal, window),
                             score_mod=None, t=t, s=s, bq=1, bk=1)
      want = _brute_force(size, t, s, causal, window)
      self.assertEqual(ring.needed_steps(st, size), want,
                       f"P={size} T={t} S={s} (per device) causal={causal} "
                       f"window={window}")
      checked += want != tuple(range(size))
    # Most configurations skip steps: the comparison is not all-or-nothing.
    self.assertGreater(checked, 500)  # 724 of the 2,500


if __name__ == "__main__":
  absltest.main()
