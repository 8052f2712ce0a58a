"""The MoBA selection benchmark: its visited-block count, and a tiny run.

No timing is asserted. The count of kernel blocks a walk visits is checked
against a hand count (rows choosing together read exactly their chosen
blocks; per-query choices visit at least as many), and a tiny run of every
way produces its rows and a table.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp

from benchmarks import sparse as bench


class SparseBenchmarkTest(absltest.TestCase):

  def test_visited_blocks_against_a_hand_count(self):
    q, k = (jax.random.normal(key, (1, 2, 256, 8), jnp.float32)
            for key in jax.random.split(jax.random.key(0)))
    # Rows of 32 queries, blocks of 32 keys, top 2: row i visits min(2,
    # i + 1) of its i + 1 causal blocks, 15 of 36 over the 8 rows.
    rows = bench.visited_share(q, k, block=32, top_k=2, way="rows")
    self.assertAlmostEqual(rows, 15 / 36, places=6)
    per_query = bench.visited_share(q, k, block=32, top_k=2,
                                    way="per query")
    self.assertBetween(per_query, rows, 1.0)

  def test_a_tiny_run_writes_its_table(self):
    rows = bench.run([256], heads=1, head_dim=8, block=32, repeats=1)
    self.assertEqual([r["way"] for r in rows], list(bench.WAYS))
    for r in rows:
      for part in ("fwd", "fwd+bwd"):
        self.assertGreater(r[part][1], 0.0)
    text = bench.table(rows, heads=1, head_dim=8, block=32, repeats=1)
    self.assertIn("| 256 | rows: top 1 of 8 |", text)
    self.assertIn("| 256 | per query: top 1 of 8 |", text)


if __name__ == "__main__":
  absltest.main()
