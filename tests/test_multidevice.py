"""Runs tests/multidevice/ in fresh processes with 8 simulated CPU devices.

JAX fixes the device count when its backend starts, and the rest of the
suite expects one device, so each multi-device file gets its own
``python -m pytest`` process (``AJ_MULTIDEVICE=1`` lets it collect them);
pytest-xdist spreads the files over workers like any other test.
"""

import os
import pathlib
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted(p.name for p in (ROOT / "tests" / "multidevice").glob("test_*.py"))


class MultiDeviceTest(parameterized.TestCase):

  def test_files_exist(self):
    self.assertGreaterEqual(len(FILES), 3, FILES)

  @parameterized.parameters(*FILES)
  def test_file_passes_on_eight_devices(self, name):
    env = dict(os.environ, AJ_MULTIDEVICE="1")
    # conftest sets the device count itself; other XLA flags pass through.
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split()
        if "force_host_platform_device_count" not in f)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=--import-mode=importlib",
         f"tests/multidevice/{name}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    self.assertEqual(result.returncode, 0,
                     msg=f"\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}")


if __name__ == "__main__":
  absltest.main()
