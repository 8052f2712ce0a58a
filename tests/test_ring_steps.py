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

from attention_jax.kernels import ring
from attention_jax.masking import intervals

WINDOWS = (None, (0, 0), (1, 0), (0, 1), (2, 3), (3, 2), (5, 0), (0, 6),
           (7, 1), (12, 12))


def _brute_force(size, t, s, causal, window, relative):
  """Steps k at which some device i sees a key of device (i - k) mod P,
  global query row r standing at key position r + relative."""
  big_t, big_s = size * t, size * s
  i = np.arange(big_t)[:, None] + relative  # query positions
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
    for size, t, s, causal, window, placed in itertools.product(
        (1, 2, 3, 4, 8), range(1, 6), range(1, 6), (False, True), WINDOWS,
        (None, -7, 0, 3)):
      # bottom-right: global row 0 stands P * (S - T) after key column 0;
      # positions in the mask place it anywhere
      relative = size * (s - t) if placed is None else placed
      bounds = intervals.bounds(causal, window)
      want = _brute_force(size, t, s, causal, window, relative)
      got = ring.needed_steps(bounds, t, s, size, relative)
      self.assertEqual(got, want,
                       f"P={size} T={t} S={s} (per device) causal={causal} "
                       f"window={window} relative={relative}")
      checked += want != tuple(range(size))
    # Most configurations skip steps: the comparison is not all-or-nothing.
    self.assertGreater(checked, 3000)  # 3,880 of the 10,000


if __name__ == "__main__":
  absltest.main()
