"""The implementation contract (tests/contract.py) for ring attention.

Run by tests/test_multidevice.py with 8 simulated devices; the ring uses
``contract.RING_DEVICES`` of them.
"""

from absl.testing import absltest

from tests import contract

RingContractTest = contract.suite(["ring"])

if __name__ == "__main__":
  absltest.main()
