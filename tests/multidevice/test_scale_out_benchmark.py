"""benchmarks/scale_out.py and hlo_collectives.py count what they claim.

The bytes a ring call sends are known in closed form (``P - 1`` shifts of
the local K and V blocks forward), and the zigzag layout's causal work is
the same on every device: the benchmark's numbers are checked against
those, on a tiny call.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import attention_jax as aj
from benchmarks import hlo_collectives
from benchmarks import scale_out


class ScaleOutBenchmarkTest(absltest.TestCase):

  def test_work_is_balanced_by_zigzag(self):
    work = scale_out.work(256, 8, 8)
    self.assertEqual(work["zigzag"]["ratio"], 1.0)
    self.assertEqual(work["zigzag"]["worst_step_ratio"], 1.0)
    # Contiguous: device P-1 sees every earlier block, device 0 only its
    # own diagonal: their ratio is well over P.
    self.assertGreater(work["contiguous"]["ratio"], 8)
    self.assertEqual(sum(work["zigzag"]["totals"]),
                     sum(work["contiguous"]["totals"]))  # same total work

  def test_ring_forward_sends_its_blocks_p_minus_1_times(self):
    devices, b, k, s, h = 8, 1, 2, 64, 16
    mesh = jax.make_mesh((devices,), ("seq",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    q = jax.ShapeDtypeStruct((b, devices, s, h), jnp.float32)  # N = P
    kv = jax.ShapeDtypeStruct((b, k, s, h), jnp.float32)
    with jax.set_mesh(mesh):
      ring = jax.jit(lambda q, k, v: aj.SequenceParallel("seq")(
          q, k, v, is_causal=True))
      got = hlo_collectives.collectives(ring.lower(q, kv, kv).compile()
                                        .as_text())
      ulysses = jax.jit(lambda q, k, v: aj.SequenceParallel(
          "seq", method="ulysses")(q, k, v, is_causal=True))
      a2a = hlo_collectives.collectives(ulysses.lower(q, kv, kv).compile()
                                        .as_text())
    block = b * k * (s // devices) * h * 4  # one device's K (or V), bytes
    self.assertEqual(got["ops"]["collective-permute"], 2 * (devices - 1))
    self.assertEqual(got["sent"]["collective-permute"],
                     2 * (devices - 1) * block)
    # Ulysses: q, k, v, out, each (P-1)/P of a device's tensor (K = 2 < P:
    # each key/value head is repeated P / K times before it is sent, so
    # keys and values move as many heads as the queries).
    self.assertEqual(a2a["ops"], {"all-to-all": 4})
    local = b * devices * (s // devices) * h * 4
    want = 4 * local * (devices - 1) / devices
    self.assertTrue(np.isclose(a2a["total_sent"], want), (a2a, want))


if __name__ == "__main__":
  absltest.main()
