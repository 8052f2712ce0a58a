"""The implementation contract (tests/contract.py) for the in-process paths.

``ring`` runs the same cases on simulated devices in
``tests/multidevice/test_contract_ring.py``.
"""

from absl.testing import absltest

from tests import contract

ContractTest = contract.suite(["dense", "blockwise", "dispatch_blockwise",
                               "cudnn"])

if __name__ == "__main__":
  absltest.main()
