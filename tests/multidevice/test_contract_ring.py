"""The implementation contract (tests/contract.py) for sequence parallelism.

Run by tests/test_multidevice.py with 8 simulated devices (the file's
cases split over several processes); the ring uses
``contract.RING_DEVICES`` of them, in both layouts: ``ring`` (contiguous)
and ``ring_zigzag`` (load balanced, ``kernels/ring_layout.py``), and the
all-to-all variant ``ulysses`` (``attention/ulysses.py``).
"""

from absl.testing import absltest

from tests import contract

COLUMNS = ("ring", "ring_zigzag", "ulysses")

RingContractTest = contract.suite(list(COLUMNS))
# The default run keeps a covering subset of the slow columns' cases.
is_exhaustive = contract.is_exhaustive

if __name__ == "__main__":
  absltest.main()
