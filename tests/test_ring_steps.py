"""The ring's step schedule and work: exactly the steps some device needs.

``ring.needed_steps`` decides, from shapes and window bounds alone, which
of the ``P`` ring steps any device may see a key at (the others are never
computed and their ``ppermute`` is jumped over). A step left out that is
needed drops keys silently; so it is compared here, exhaustively over small
shapes and both layouts (contiguous; zigzag: device ``i`` holds chunks
``i`` and ``2P - 1 - i``), with a brute-force reading of the global mask
(bottom-right aligned, jax.nn's window) written from the conventions.
``ring.block_work`` (the block pairs each device computes per step, from
the flash walk's key ranges) is compared with a brute-force count of the
block pairs holding a visible entry. No devices needed: plain Python.
"""

import itertools

from absl.testing import absltest
import numpy as np

import attention_jax as aj
from attention_jax.kernels import ring
from attention_jax.kernels import ring_layout
from attention_jax.masking import intervals

WINDOWS = (None, (0, 0), (1, 0), (0, 1), (2, 3), (3, 2), (5, 0), (0, 6),
           (7, 1), (12, 12))


def _global_mask(big_t, big_s, causal, window, relative):
  """[T, S] bool: global query row r (at key position r + relative) may
  see key j."""
  i = np.arange(big_t)[:, None] + relative  # query positions
  j = np.arange(big_s)[None, :]
  ok = np.ones((big_t, big_s), bool)
  if causal:
    ok &= j <= i
  if window is not None:
    ok &= (j >= i - window[0]) & (j <= i + window[1])
  return ok


def _rows(layout, device, size, length):
  """The global rows a device holds, in local order (written from the
  layouts' definitions, not from ring_layout)."""
  if layout == "contiguous":
    return np.arange(device * length, (device + 1) * length)
  c = length // 2  # chunks device and 2P - 1 - device
  return np.concatenate([np.arange(device * c, (device + 1) * c),
                         np.arange((2 * size - 1 - device) * c,
                                   (2 * size - device) * c)])


def _brute_force(size, t, s, causal, window, relative, layout="contiguous"):
  """Steps k at which some device d sees a key of device (d - k) mod P."""
  ok = _global_mask(size * t, size * s, causal, window, relative)
  steps = [k for k in range(size)
           if any(ok[np.ix_(_rows(layout, d, size, t),
                            _rows(layout, (d - k) % size, size, s))].any()
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

  def test_zigzag_equals_brute_force(self):
    checked = 0
    for size, t, s, causal, window, placed in itertools.product(
        (1, 2, 3, 4), (2, 4, 6), (2, 4, 6), (False, True), WINDOWS,
        (None, -5, 0, 3)):
      relative = size * (s - t) if placed is None else placed
      bounds = intervals.bounds(causal, window)
      want = _brute_force(size, t, s, causal, window, relative, "zigzag")
      got = ring.needed_steps(bounds, t, s, size, relative, "zigzag")
      self.assertEqual(got, want,
                       f"zigzag P={size} T={t} S={s} (per device) causal="
                       f"{causal} window={window} relative={relative}")
      checked += want != tuple(range(size))
    self.assertGreater(checked, 300)  # windows skip zigzag steps too


class LayoutTest(absltest.TestCase):

  def test_zigzag_indices_and_round_trip(self):
    np.testing.assert_array_equal(ring_layout.zigzag_indices(8, 2),
                                  [0, 1, 6, 7, 2, 3, 4, 5])
    x = np.arange(2 * 12 * 3).reshape(2, 12, 3)  # [B, T, H]
    for devices in (1, 2, 3, 6):
      z = ring_layout.zigzag(x, devices)
      np.testing.assert_array_equal(ring_layout.unzigzag(z, devices), x)
      np.testing.assert_array_equal(
          ring_layout.unzigzag(ring_layout.zigzag(x[..., 0], devices,
                                                  axis=-1), devices,
                               axis=-1), x[..., 0])
      # device d's rows are chunks d and 2P - 1 - d
      rows = np.asarray(z[0, :, 0]) // 3
      per = 12 // devices
      for d in range(devices):
        np.testing.assert_array_equal(
            rows[d * per:(d + 1) * per], _rows("zigzag", d, devices, per))

  def test_local_lengths_are_a_prefix(self):
    # A global length's valid rows on each device are a prefix of its rows
    # (what the kernel's lengths count), in both layouts.
    for layout, size, length in itertools.product(("contiguous", "zigzag"),
                                                  (1, 2, 4), range(0, 17)):
      per = 16 // size
      for d in range(size):
        rows = _rows(layout, d, size, per)
        got = int(ring_layout.local_length(
            layout, length, d, size, per // ring_layout.num_chunks(layout)))
        valid = rows < length
        self.assertEqual(got, valid.sum())
        self.assertTrue(valid[:got].all())

  def test_refusals(self):
    with self.assertRaisesRegex(ValueError, r"length=12 is not a multiple "
                                r"of 2 \* devices = 8 \(devices=4\)"):
      ring_layout.zigzag_indices(12, 4)
    with self.assertRaisesRegex(ValueError, "devices must be a positive"):
      ring_layout.zigzag_indices(12, 0)
    with self.assertRaisesRegex(ValueError, r"layout must be one of "
                                r"\('contiguous', 'zigzag'\), got 'zig'"):
      ring.block_work(None, 8, 8, 2, "zig")
    with self.assertRaisesRegex(ValueError, r"Ring's layout must be one of "
                                r"\('contiguous', 'zigzag'\)"):
      aj.kernels.Ring("seq", layout="striped")
    with self.assertRaisesRegex(ValueError, r"also sets \['kv_lengths'\]"):
      ring.block_work(aj.Mask(causal=True, kv_lengths=3), 8, 8, 2)


class BlockWorkTest(absltest.TestCase):

  def _brute_force(self, size, t, s, bounds, layout, bq, bk):
    """[steps, devices]: block pairs (within each held chunk pair) with a
    visible entry, from the global mask."""
    n = 2 if layout == "zigzag" else 1
    ct, cs = t // (n * size), s // (n * size)
    left, right = bounds  # (None: open to the left)
    ok = _global_mask(t, s, False, (np.inf if left is None else left, right),
                      s - t)
    work = np.zeros((size, size), int)
    steps = ring.needed_steps(bounds, t // size, s // size, size, s - t,
                              layout)
    for k in steps:
      for d in range(size):
        rows = _rows(layout, d, size, t // size).reshape(n, ct)
        cols = _rows(layout, (d - k) % size, size, s // size).reshape(n, cs)
        for qc in rows:
          for kc in cols:
            pair = ok[np.ix_(qc, kc)]
            work[k, d] += sum(
                pair[i:i + bq, j:j + bk].any()
                for i in range(0, ct, bq) for j in range(0, cs, bk))
    return work

  def test_equals_brute_force(self):
    for size, (t, s), bounds, layout, (bq, bk) in itertools.product(
        (2, 4), ((16, 16), (16, 32), (32, 16)),
        ((None, 0), (3, 0), (2, 2), (5, 1)), ("contiguous", "zigzag"),
        ((2, 4), (4, 2))):
      got = ring.block_work(intervals.Bounds(*bounds), t, s, size, layout,
                            bq, bk)
      want = self._brute_force(size, t, s, intervals.Bounds(*bounds),
                               layout, bq, bk)
      np.testing.assert_array_equal(
          got, want, f"P={size} T={t} S={s} {bounds} {layout} {bq}x{bk}")

  def test_zigzag_balances_causal_work(self):
    for size in (2, 4, 8):
      zig = ring.block_work(aj.Mask(causal=True), 64 * size, 64 * size,
                            size, "zigzag", 8, 8)
      # every device the same count at every step ...
      self.assertTrue((zig == zig[:, :1]).all(), zig)
      contiguous = ring.block_work(aj.Mask(causal=True), 64 * size,
                                   64 * size, size, "contiguous", 8, 8)
      total = contiguous.sum(0)  # ... where contiguous grows with i
      self.assertGreater(total[-1] / total[0], 0.9 * size)
      self.assertEqual(zig.sum(), contiguous.sum())  # the same total work


if __name__ == "__main__":
  absltest.main()
