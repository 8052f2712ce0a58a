"""The serving benchmark's rows run at tiny sizes (no timing asserted):
every implementation agrees with the others before it is timed, and each
row has its ratio to the reference row."""

from absl.testing import absltest

from benchmarks import serving


class ServingBenchmarkSmokeTest(absltest.TestCase):

  def test_one_query_rows(self):
    rows = serving.one_query_rows(100, n=2, k=1, h=8, repeats=1)
    self.assertEqual([r[0] for r in rows],
                     ["dense (one row)", "flash (one walk)"])
    self.assertEqual(rows[1][2], 1.0)

  def test_paged_rows(self):
    rows = serving.paged_rows(2, 21, 4, n=2, k=1, h=8, repeats=1)
    self.assertLen(rows, 4)
    self.assertEqual(rows[0][0], "linear (automatic)")
    self.assertEqual(rows[0][2], 1.0)


if __name__ == "__main__":
  absltest.main()
