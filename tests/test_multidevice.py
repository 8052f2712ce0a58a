"""Runs tests/multidevice/ in fresh processes with 8 simulated CPU devices.

JAX fixes the device count when its backend starts, and the rest of the
suite expects one device, so each multi-device file gets its own
``python -m pytest`` process (``AJ_MULTIDEVICE=1`` lets it collect them);
pytest-xdist spreads the files over workers like any other test. The ring
contract, by far the longest file (a column per layout), runs as
``_PARTS`` processes (a share of its columns' cases each, every case in
exactly one) so that several workers share it.
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
# The contract's cases over all its columns, by node id, cut into _PARTS
# consecutive shares: a process runs each of the first _PARTS - 1 shares,
# the last runs the file less them (so nothing else in it is lost). About
# 3 minutes each on a 2-core machine (20 cases took 7 beside other jobs).
_PARTS = 6
_NODES = [
    f"tests/multidevice/{_CONTRACT}::RingContractTest::test_contract_{name}__"
    f"{case}"
    for name in test_contract_ring.COLUMNS for case in contract.case_names(name)]
_SHARES = [_NODES[i * len(_NODES) // _PARTS:(i + 1) * len(_NODES) // _PARTS]
           for i in range(_PARTS)]


def _runs():
  """``(name, pytest arguments)``: one process per file, the contract's
  _PARTS."""
  runs = [(name, [f"tests/multidevice/{name}"]) for name in FILES
          if name != _CONTRACT]
  if _CONTRACT in FILES:
    runs += [(f"{_CONTRACT}_part_{i}", share)
             for i, share in enumerate(_SHARES[:-1])]
    runs.append((f"{_CONTRACT}_part_{_PARTS - 1}",
                 [f"tests/multidevice/{_CONTRACT}",
                  *(f"--deselect={node}" for share in _SHARES[:-1]
                    for node in share)]))
  return runs


class MultiDeviceTest(parameterized.TestCase):

  def test_files_exist(self):
    self.assertGreaterEqual(len(FILES), 3, FILES)

  def test_the_contract_splits_into_nonempty_shares(self):
    # (The last share is the file less the others, so no case is lost.)
    self.assertLessEqual({"ring", "ring_zigzag"},
                         set(test_contract_ring.COLUMNS))
    self.assertTrue(all(_SHARES), _SHARES)
    self.assertLen(set(_NODES), sum(map(len, _SHARES)))

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
    self.assertEqual(result.returncode, 0,
                     msg=f"\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}")


if __name__ == "__main__":
  absltest.main()
