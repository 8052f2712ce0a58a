"""The kernel contract (tests/contract.py) for every kernel of the registry.

``ring`` runs the same cases on simulated devices in
``tests/multidevice/test_contract_ring.py``.
"""

from absl.testing import absltest
from absl.testing import parameterized

from tests import contract

ContractTest = contract.suite(contract.kernel_names())


class DefaultSubsetTest(parameterized.TestCase):
  """The default run's cases of the slow columns still exercise everything
  they do: every facet a column takes, taken by a default case of it or
  of a column of its group (``contract.COVERED_TOGETHER``: one kernel in
  several layouts); every feature a column refuses, and a refusal for
  its shapes where it has one, by the column itself."""

  @parameterized.named_parameters(*[
      ("_".join(columns), columns) for columns in sorted({
          contract.group(name)
          for name in (set(contract.kernel_names())
                       | set(contract.SEQUENCE_PARALLEL))
          - contract.EVERY_CASE_BY_DEFAULT})])
  def test_covers_the_columns(self, columns):
    every = {c: contract.case_names(c) for c in columns}
    chosen = {c: contract.covering_cases(c) for c in columns}
    why = lambda c, n: contract.refused(c, contract.CASES[n])  # noqa: E731
    taken = lambda names: set().union(*(  # noqa: E731
        contract.facets(contract.CASES[n]) for c in columns
        for n in names[c] if not why(c, n)))
    self.assertEqual(taken(chosen), taken(every))
    for c in columns:
      self.assertLessEqual(set(chosen[c]), set(every[c]))
      self.assertEqual(set().union(*(why(c, n) for n in chosen[c])),
                       set().union(*(why(c, n) for n in every[c])), c)
      # each column runs some case it takes (each layout runs by default)
      self.assertTrue(any(not why(c, n) for n in chosen[c]), c)
      # and the tests the default run keeps are exactly those cases
      for case in every[c]:
        self.assertEqual(
            contract.is_exhaustive(f"test_contract_{c}__{case}"),
            case not in chosen[c])

  def test_columns_covered_together_run_one_kernel(self):
    # (what lets one layout's case stand for the other's)
    for columns in contract.COVERED_TOGETHER:
      kernels = [contract.CONFIGURED[c] for c in columns]
      self.assertLen({type(k) for k in kernels}, 1, columns)
      self.assertLen({contract.REFUSES[c] for c in columns}, 1, columns)


# The default run keeps a covering subset of the slow columns' cases.
is_exhaustive = contract.is_exhaustive

if __name__ == "__main__":
  absltest.main()
