"""Experiments that show what attention does; launched from ``run.py``.

Library code here never reads absl flags: ``run.py`` turns flags into a
config dataclass and calls one ``run(config)`` function.
"""
