"""Eight simulated CPU devices for the multi-device tests.

These files run only in their own process (``tests/test_multidevice.py``
starts it with ``AJ_MULTIDEVICE=1``), so the rest of the suite keeps one
device. The device count must be set before JAX's backend starts.
"""

import os

import jax
import pytest

if os.environ.get("AJ_MULTIDEVICE") == "1":
  jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(autouse=True, scope="session")
def _eight_devices():
  if jax.device_count() != 8:
    pytest.fail(f"multidevice tests need 8 devices, JAX sees "
                f"{jax.device_count()}: run them through "
                "tests/test_multidevice.py (AJ_MULTIDEVICE=1).")
