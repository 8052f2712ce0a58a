"""The README and the docs pages say what is true.

Every ```` ```python ```` block of ``README.md`` and of each ``docs/*.md`` page
runs, in order, in one fresh namespace per page (as a reader pasting them
into one session would), and any exception fails the test; the traceback
names the page and its line. Blocks meant as text use another language tag.
The rest checks the pages' shape: the README starts with the commands that
work on a fresh machine, stays a front page, links only to pages that exist,
and no page carries issue numbers or test counts that go stale.
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

import attention_jax as aj

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
  """``(first line number, code)`` of each ```python block of ``page``."""
  text = page.read_text()
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
          for m in _PYTHON_BLOCK.finditer(text)]


def _name(page: pathlib.Path) -> str:
  return str(page.relative_to(ROOT))


@pytest.mark.slow  # seconds of compiles per page: not in the quick subset
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)],
                         ids=_name)
def test_python_examples_run(page):
  namespace = {"__name__": f"example_{page.stem}"}
  for line, code in python_blocks(page):
    # Leading newlines put tracebacks on the page's own line numbers.
    exec(compile("\n" * (line - 1) + code, _name(page), "exec"), namespace)  # noqa: S102


def test_readme_starts_with_the_fresh_machine_commands():
  first_block = re.search(r"```(\w*)\n(.*?)```", README.read_text(), re.DOTALL)
  lang, body = first_block.groups()
  commands = [line.split("#")[0].strip() for line in body.splitlines()
              if line.strip()]
  assert lang == "bash"
  install = "python -m pip install -r requirements.txt"
  assert commands[:2] == [f"{install} && python run.py",
                          f"{install} && python -m pytest"], commands


def test_readme_gives_the_quick_subset_command():
  # The line after the two commands; pyproject registers the marker it uses
  # (an unregistered one would select nothing and only warn).
  body = re.search(r"```bash\n(.*?)```", README.read_text(), re.DOTALL).group(1)
  commands = [line.split("#")[0].strip() for line in body.splitlines()
              if line.strip()]
  assert commands[2] == 'python -m pytest -m "not slow"', commands
  assert commands[3] == "python -m pytest -m exhaustive", commands
  pyproject = (ROOT / "pyproject.toml").read_text()
  assert re.search(r'^markers = \[\s*"slow:', pyproject, re.MULTILINE)
  assert re.search(r'^\s*"exhaustive:', pyproject, re.MULTILINE)


def test_first_command_installs_this_checkout():
  # After the README's first command a script anywhere imports the package,
  # and it is this checkout's code (an editable install), not a stale copy.
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  with tempfile.TemporaryDirectory() as elsewhere:
    result = subprocess.run(
        [sys.executable, "-c",
         "import attention_jax; print(attention_jax.__file__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=False)
  assert result.returncode == 0, (
      "`import attention_jax` fails outside the repository after `python -m "
      f"pip install -r requirements.txt`:\n{result.stderr[-2000:]}")
  found = pathlib.Path(result.stdout.strip()).resolve()
  assert found == ROOT / "attention_jax" / "__init__.py", found


def test_readme_first_example_is_the_lessons_line():
  _, code = python_blocks(README)[0]
  assert ("out, weights = aj.scaled_dot_product_attention(Q, K, V, mask, "
          "return_weights=True)") in code


def test_readme_is_a_front_page():
  text = README.read_text()
  assert len(text.splitlines()) <= 160, "move detail to docs/"
  assert "sphinx-build" in text  # says how to build the docs
  for name in ("blockwise_attention", "ring_attention", "additive_score",
               "attend_heads", "update_kv_cache"):
    assert f"`{name}" in text, f"the function table lacks {name}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_and_images_exist(page):
  for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue
    path = (page.parent / target.split("#")[0]).resolve()
    assert path.exists(), f"{_name(page)} links to missing {target}"


def test_every_docs_page_is_in_the_index():
  index = (DOCS / "index.md").read_text()
  toctree = re.search(r"```\{toctree\}\n(.*?)```", index, re.DOTALL).group(1)
  listed = {line.strip() for line in toctree.splitlines()
            if line.strip() and not line.startswith(":")}
  pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
  assert pages == listed


def test_api_reference_documents_every_public_name():
  text = (DOCS / "api.md").read_text()
  documented = re.findall(r"^\.\. auto(?:function|class):: (\w+)", text,
                          re.MULTILINE)
  assert sorted(documented) == sorted(aj.__all__)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_issue_numbers_or_test_counts(page):
  text = page.read_text()
  for pattern in (r"\bissue", r"(?<![\w/])#\d+", r"\b\d+ tests\b",
                  r"\btests? count"):
    found = re.search(pattern, text, re.IGNORECASE)
    assert not found, f"{_name(page)}: {found.group(0)!r} goes stale"
