"""Test-suite set-up: hypothesis profiles; multi-device files run apart.

Hypothesis profiles: ``ci`` (default; bounded and derandomized, so every CI
run checks the same examples) and ``thorough`` (select with
``pytest --hypothesis-profile=thorough``) for long local runs.
"""

import os

import hypothesis

hypothesis.settings.register_profile(
    "ci", max_examples=10, deadline=None, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
    print_blob=True)
hypothesis.settings.register_profile(
    "thorough", max_examples=400, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
    print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The multi-device tests run in a subprocess of their own (8 devices).
collect_ignore = [] if os.environ.get("AJ_MULTIDEVICE") == "1" else [
    "multidevice"]
