"""The kernel contract (tests/contract.py) for every kernel of the registry.

``ring`` runs the same cases on simulated devices in
``tests/multidevice/test_contract_ring.py``.
"""

from absl.testing import absltest
from absl.testing import parameterized

from tests import contract

ContractTest = contract.suite(contract.kernel_names())


class DefaultSubsetTest(parameterized.TestCase):
  """The default run's cases of a slow column still exercise everything
  its column does: every facet of the cases it takes, every feature it
  refuses, and a refusal for shapes where it has one."""

  @parameterized.parameters(
      *sorted((set(contract.kernel_names()) | set(contract.SEQUENCE_PARALLEL))
              - contract.EVERY_CASE_BY_DEFAULT))
  def test_covers_the_column(self, name):
    every = contract.case_names(name)
    chosen = contract.covering_cases(name)
    self.assertLessEqual(set(chosen), set(every))
    refused = contract.REFUSES[name]
    taken = lambda names: set().union(*(
        contract.facets(contract.CASES[n]) for n in names
        if not contract.CASES[n].features() & refused))
    self.assertEqual(taken(chosen), taken(every))
    features = lambda names: set().union(*(
        contract.CASES[n].features() & refused for n in names))
    self.assertEqual(features(chosen), features(every))
    shaped = contract.REFUSES_SHAPES.get(name, (lambda case: False,))[0]
    self.assertEqual(any(shaped(contract.CASES[n]) for n in chosen),
                     any(shaped(contract.CASES[n]) for n in every))
    # and the tests the default run keeps are exactly those cases
    for case in every:
      self.assertEqual(
          contract.is_exhaustive(f"test_contract_{name}__{case}"),
          case not in chosen)
# The default run keeps a covering subset of the slow columns' cases.
is_exhaustive = contract.is_exhaustive

if __name__ == "__main__":
  absltest.main()
