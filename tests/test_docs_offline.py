"""The docs site needs no network: formulas render from files in the build.

Reads ``docs/conf.py``'s settings as Sphinx would (no build: that takes a
minute). Sphinx's default ``mathjax_path`` is a CDN address, so a page opened
offline would show its formulas as raw TeX; the site must load MathJax from
the build's ``_static`` (copied there by ``html_static_path``) or render math
to images at build time (``sphinx.ext.imgmath``).
"""

import pathlib
import runpy

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _conf() -> dict:
  return runpy.run_path(str(DOCS / "conf.py"))


def _is_remote(path: str) -> bool:
  return "://" in path or path.startswith("//")


def test_math_renders_without_the_network():
  conf = _conf()
  if (conf.get("html_math_renderer") == "imgmath"
      or "sphinx.ext.imgmath" in conf.get("extensions", [])):
    return  # images made at build time: nothing to load when viewing
  mathjax = conf.get("mathjax_path")
  assert mathjax, ("docs/conf.py sets no mathjax_path: Sphinx's default loads "
                   "MathJax from a CDN")
  assert not _is_remote(mathjax), f"mathjax_path {mathjax!r} is remote"
  # A relative mathjax_path is resolved inside the build's _static, which
  # html_static_path fills: a file entry lands there by its name, a folder
  # entry's contents land there.
  shipped = []
  for entry in conf.get("html_static_path", []):
    source = DOCS / entry
    if source.is_file():
      shipped.append(source.name == mathjax)
    else:
      shipped.append((source / mathjax).is_file())
  assert any(shipped), (
      f"mathjax_path {mathjax!r} is not a file that html_static_path "
      f"({conf.get('html_static_path')}) copies into _static")


def test_no_remote_scripts_or_styles():
  conf = _conf()
  for setting in ("html_js_files", "html_css_files"):
    for entry in conf.get(setting, []):
      name = entry[0] if isinstance(entry, tuple) else entry
      assert not _is_remote(name), f"{setting} loads {name!r} from the network"
