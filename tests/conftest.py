"""The multi-device tests run in a subprocess of their own (8 devices)."""

import os

collect_ignore = [] if os.environ.get("AJ_MULTIDEVICE") == "1" else [
    "multidevice"]
