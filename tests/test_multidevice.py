"""Runs tests/multidevice/ in fresh processes with 8 simulated CPU devices.

JAX fixes the device count when its backend starts, and the rest of the
suite expects one device, so each multi-device file gets its own
``python -m pytest`` process (``AJ_MULTIDEVICE=1`` lets it collect them);
pytest-xdist spreads the files over workers like any other test. The ring
contract, by far the longest file, runs as two processes (half its cases
each, every case in exactly one) so that two workers share it.
"""

import os
import pathlib
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

from tests import contract

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted(p.name for p in (ROOT / "tests" / "multidevice").glob("test_*.py"))
_CONTRACT = "test_contract_ring.py"
# The first half of the ring contract's cases, by node id: one process runs
# them, another the rest of the file (those deselected).
_FIRST_HALF = [
    f"tests/multidevice/{_CONTRACT}::RingContractTest::test_contract_ring__{c}"
    for c in contract.case_names("ring")[:len(contract.case_names("ring")) // 2]]


def _runs():
  """``(name, pytest arguments)``: one process per file, the contract's two."""
  runs = [(name, [f"tests/multidevice/{name}"]) for name in FILES
          if name != _CONTRACT]
  if _CONTRACT in FILES:
    runs += [(f"{_CONTRACT}_first_half", _FIRST_HALF),
             (f"{_CONTRACT}_second_half",
              [f"tests/multidevice/{_CONTRACT}",
               *(f"--deselect={node}" for node in _FIRST_HALF)])]
  return runs


class MultiDeviceTest(parameterized.TestCase):

  def test_files_exist(self):
    self.assertGreaterEqual(len(FILES), 3, FILES)

  def test_the_contract_splits_into_two_nonempty_halves(self):
    # (The second half is the file less the first, so no case is lost.)
    cases = contract.case_names("ring")
    self.assertNotEmpty(_FIRST_HALF)
    self.assertLess(len(_FIRST_HALF), len(cases))
    self.assertLen(set(_FIRST_HALF), len(_FIRST_HALF))

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
