"""Sphinx configuration: ``sphinx-build -W --keep-going -b html docs build/docs``.

Sphinx because autodoc imports the package and documents exactly the objects
``attention_jax.__all__`` exports, napoleon reads their Google-style
docstrings, and myst-parser renders these Markdown pages; the bundled
alabaster theme and the MathJax copied into ``_static`` need no network.
"""

import importlib.metadata
import os
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # importing the package only

from sphinx.util import logging  # noqa: E402

import attention_jax  # noqa: E402

project = "attention_jax"
version = release = attention_jax.__version__
author = "attention_jax authors"
copyright = "attention_jax authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["figures"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links
myst_enable_extensions = ["dollarmath"]

# Google-style docstrings: Args / Returns / Raises / Example sections.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # dtype=jnp.float32, not <class ...>
autodoc_typehints = "signature"
autodoc_type_aliases = {name: name for name in ("ArrayLike", "Params",
                                                 "AttentionFn")}
autodoc_class_signature = "separated"
autodoc_default_options = {"members": True, "special-members": "__call__"}

html_theme = "alabaster"  # bundled with Sphinx: no remote assets
html_theme_options = {"nosidebar": False}

# Formulas render offline. Sphinx's default mathjax_path loads MathJax from a
# CDN, so with no network the pages showed raw TeX. MathJax 3.2.2 ships inside
# the sphinx-mathjax-offline wheel (pinned in requirements.txt); its one-file
# TeX-to-SVG bundle is copied into _static and loaded from there. The SVG
# output draws glyphs as paths (no web-font files to load) and the -full
# bundle has every TeX extension built in (nothing autoloaded at view time),
# so the page needs no other file. Not that package's own Sphinx extension: it
# copies all 24 MB of MathJax into every build. Not imgmath: it needs LaTeX and
# dvipng from apt on every CI machine. Not KaTeX prerendering: it needs node.
_MATHJAX_DIST = "sphinx-mathjax-offline"
_MATHJAX_FILE = "sphinx-mathjax-offline/static/mathjax/tex-svg-full.js"
try:
  _mathjax = pathlib.Path(
      importlib.metadata.distribution(_MATHJAX_DIST).locate_file(_MATHJAX_FILE))
except importlib.metadata.PackageNotFoundError:
  _mathjax = None
if _mathjax is None or not _mathjax.is_file():
  raise RuntimeError(
      f"docs/conf.py: MathJax for offline formulas not found ({_MATHJAX_FILE} "
      f"of the {_MATHJAX_DIST} package); install it with "
      "`python -m pip install -r requirements.txt`")
html_static_path = [str(_mathjax)]  # a file entry lands in _static/ itself
mathjax_path = _mathjax.name  # relative: resolved inside the build's _static
html_title = "attention_jax"


def _check_api_page(app):
  """Warns (an error under -W) for a public name api.md does not document."""
  text = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^\.\. auto(?:function|class):: (\w+)", text,
                              re.MULTILINE))
  logger = logging.getLogger(__name__)
  for name in sorted(set(attention_jax.__all__) - documented):
    logger.warning(f"docs/api.md does not document aj.{name}")
  for name in sorted(documented - set(attention_jax.__all__)):
    logger.warning(f"docs/api.md documents {name}, not in attention_jax.__all__")


def _tidy_signature(app, what, name, obj, options, signature, annotation):
  """Writes type aliases and qualified names as the source spells them.

  Sphinx 9.0 prints an alias inside a union as ``TypeAliasForwardRef('X')``
  and some evaluated annotations as ``~package.module.Name``.
  """
  def tidy(text):
    if text is None:
      return None
    text = re.sub(r"TypeAliasForwardRef\('(\w+)'\)", r"\1", text)
    return re.sub(r"~(?:\w+\.)*(\w+)", r"\1", text)
  return tidy(signature), tidy(annotation)


def setup(app):
  app.connect("builder-inited", _check_api_page)
  app.connect("autodoc-process-signature", _tidy_signature)
