"""The kernel contract (tests/contract.py) for every kernel of the registry.

``ring`` runs the same cases on simulated devices in
``tests/multidevice/test_contract_ring.py``.
"""

from absl.testing import absltest

from tests import contract

ContractTest = contract.suite(contract.kernel_names())

if __name__ == "__main__":
  absltest.main()
