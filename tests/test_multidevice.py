"""Runs tests/multidevice/ in fresh processes with 8 simulated CPU devices.

JAX fixes the device count when its backend starts, and the rest of the
suite expects one device, so the multi-device files run in ``python -m
pytest`` processes of their own (``AJ_MULTIDEVICE=1`` lets them collect):
all but the ring contract in one (JAX and 8 devices start once); pytest-xdist
spreads the processes over workers like any other test. The ring
contract, by far the longest file (a column per layout), runs as several
processes (a share of its columns' cases each, every case in exactly one)
so that several workers share it: the default run its columns' covering
subsets (ring and ring_zigzag sharing theirs), the exhaustive run (``-m
exhaustive``) the rest.
"""

import os
import pathlib
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

from tests import contract
from tests.multidevice import test_contract_ring

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted(p.name for p in (ROOT / "tests" / "multidevice").glob("test_*.py"))
_CONTRACT = "test_contract_ring.py"
_PREFIX = f"tests/multidevice/{_CONTRACT}::RingContractTest::test_contract_"
# The contract's cases over all its columns, by node id: the default run's
# (the columns' covering subsets, contract.covering_cases) in
# _DEFAULT_PARTS processes, the others (the exhaustive run's) in
# _EXHAUSTIVE_PARTS, so that several workers share them; a share takes
# every n-th node, so each holds about as many of each column's cases (a
# ring case costs 5-17 CPU-seconds, an all-to-all one about 1). The last
# default share is the file less the other default shares (its other tests
# run there; contract.is_exhaustive deselects the exhaustive cases).
_DEFAULT_PARTS = 2
_EXHAUSTIVE_PARTS = 5
_NODES = [(f"{_PREFIX}{name}__{case}",
           case in contract.covering_cases(name))
          for name in test_contract_ring.COLUMNS
          for case in contract.case_names(name)]


def _shares(nodes, parts):
  return [nodes[i::parts] for i in range(parts)]


_DEFAULT = _shares([n for n, default in _NODES if default], _DEFAULT_PARTS)
_EXHAUSTIVE = _shares([n for n, default in _NODES if not default],
                      _EXHAUSTIVE_PARTS)


def _runs():
  """``(name, pytest arguments)``: the other files in one process (their
  default tests; their exhaustive ones in another), the contract's shares
  (a name with ``exhaustive`` belongs to the exhaustive run)."""
  others = [f"tests/multidevice/{name}" for name in FILES if name != _CONTRACT]
  runs = [("others", others), ("others_exhaustive", ["-m", "exhaustive",
                                                     *others])]
  if _CONTRACT in FILES:
    runs += [(f"{_CONTRACT}_part_{i}", share)
             for i, share in enumerate(_DEFAULT[:-1])]
    runs.append((f"{_CONTRACT}_part_{_DEFAULT_PARTS - 1}",
                 [f"tests/multidevice/{_CONTRACT}",
                  *(f"--deselect={node}" for share in _DEFAULT[:-1]
                    for node in share)]))
    runs += [(f"{_CONTRACT}_exhaustive_part_{i}", ["-m", "exhaustive", *share])
             for i, share in enumerate(_EXHAUSTIVE)]
  return runs


def is_exhaustive(test_name: str) -> bool:
  """The processes of exhaustive tests run in the exhaustive run only."""
  return "exhaustive" in test_name


class MultiDeviceTest(parameterized.TestCase):

  def test_files_exist(self):
    self.assertGreaterEqual(len(FILES), 3, FILES)

  def test_the_contract_splits_into_nonempty_shares(self):
    # Every case node is in exactly one share of one run.
    self.assertLessEqual({"ring", "ring_zigzag", "ulysses"},
                         set(test_contract_ring.COLUMNS))
    self.assertTrue(all(_DEFAULT) and all(_EXHAUSTIVE))
    shared = [n for share in _DEFAULT + _EXHAUSTIVE for n in share]
    self.assertCountEqual(shared, [n for n, _ in _NODES])

  @parameterized.named_parameters(*_runs())
  def test_file_passes_on_eight_devices(self, selection):
    env = dict(os.environ, AJ_MULTIDEVICE="1")
    # conftest sets the device count itself; other XLA flags pass through.
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split()
        if "force_host_platform_device_count" not in f)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=--import-mode=importlib",
         *selection],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # (5: no test selected, as in an exhaustive run of files with none.)
    ok = (0, 5) if "exhaustive" in selection else (0,)
    self.assertIn(result.returncode, ok,
                  msg=f"\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}")


if __name__ == "__main__":
  absltest.main()
