"""The shape of the code: the folders are its layers, imports go down them.

No import cycle, no private names across modules, and a module imports only
its own folder and the folders below it (``LAYERS``). Read from the source
(``ast``), so the check covers imports inside functions too, which is where
a circle used to hide.
"""

import ast
import pathlib

from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "attention_jax"

# The package's folders, lowest first; a tuple is one layer of peers, which
# import neither each other nor anything above. ``lesson`` (imports nothing
# of ours) and ``__init__`` (re-exports every layer) stand outside.
LAYERS = (
    ("core",),                # validation and numerics everything shares
    ("masking", "scores"),    # what may attend; what changes a score, RoPE
    ("kernels",),             # the kernel interface and the kernels
    ("attention",),           # the attention functions over the kernels
    ("decoding",),            # the caches the layers write into
    ("layers",),              # the pure layers, each beside its NNX module
    ("interop",),             # other libraries' signatures and weights
)
OUTSIDE = {PACKAGE, f"{PACKAGE}.lesson"}
# Imports that go up, each with its reason; one no longer made fails the
# test, so the list only shrinks. (Empty: none does.)
UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in sorted((ROOT / PACKAGE).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


def _imports(tree: ast.AST, modules) -> dict[str, str]:
  """``{local name: module}`` for every attention_jax module imported."""
  names = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        target = full if full in modules else node.module
        names[alias.asname or alias.name] = target
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith(PACKAGE):
          names[alias.asname or alias.name] = alias.name
  return names


def _folder(module: str, modules) -> str | None:
  """The layer folder of ``module`` (None for the package's own files)."""
  parts = module.split(".")
  is_package = modules[module].name == "__init__.py"
  return parts[1] if len(parts) > 2 or (is_package and len(parts) == 2) \
      else None


class ArchitectureTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.modules = _modules()
    self.trees = {m: ast.parse(p.read_text()) for m, p in self.modules.items()}

  def test_import_graph_has_no_cycle(self):
    graph = {m: {t for t in _imports(tree, self.modules).values()
                 if t != m and t != PACKAGE}
             for m, tree in self.trees.items() if m != PACKAGE}
    state = {}  # module -> "open" while on the DFS stack, then "done"

    def visit(m, path):
      if state.get(m) == "done":
        return
      if state.get(m) == "open":
        cycle = path[path.index(m):] + [m]
        self.fail("import cycle: " + " -> ".join(cycle))
      state[m] = "open"
      for t in sorted(graph.get(m, ())):
        visit(t, path + [m])
      state[m] = "done"

    for m in sorted(graph):
      visit(m, [])
    self.assertIn("attention_jax.kernels.flash_core",
                  graph["attention_jax.kernels.ring"])
    self.assertIn("attention_jax.kernels", graph["attention_jax.attention.dot_product"])

  def test_kernels_never_import_the_dispatcher(self):
    kernels = [m for m in self.modules
               if m == f"{PACKAGE}.kernels" or m.startswith(f"{PACKAGE}.kernels.")]
    self.assertContainsSubset(
        {f"{PACKAGE}.kernels{suffix}" for suffix in
         ("", ".base", ".dense", ".flash", ".flash_core", ".cudnn", ".ring")},
        kernels)
    for kernel in kernels:
      imported = set(_imports(self.trees[kernel], self.modules).values())
      self.assertNotIn(f"{PACKAGE}.attention.dot_product", imported, kernel)

  def test_every_module_is_in_a_layer(self):
    folders = {f for layer in LAYERS for f in layer}
    self.assertEqual(
        sorted(m for m in self.modules if m not in OUTSIDE
               and _folder(m, self.modules) not in folders), [],
        "put the module in the folder of its layer (LAYERS)")

  def test_imports_go_down_the_layers(self):
    rank = {f: i for i, layer in enumerate(LAYERS) for f in layer}
    upward = set()
    for m, tree in self.trees.items():
      if m in OUTSIDE:
        continue
      here = _folder(m, self.modules)
      for target in set(_imports(tree, self.modules).values()):
        if target == PACKAGE:  # the top re-exports every layer: above all
          upward.add((m, target))
          continue
        there = _folder(target, self.modules)
        if there is None or there == here:  # lesson: imports nothing of ours
          continue
        if rank[there] >= rank[here]:
          upward.add((m, target))
    self.assertEqual(sorted(upward - UPWARD), [],
                     "an import that goes up (or across peers): move the "
                     "code to the layer it belongs to")
    self.assertEqual(sorted(UPWARD - upward), [],
                     "an exception no longer needed: remove it from UPWARD")

  def test_code_outside_the_package_never_imports_core(self):
    # core/ is internal as a whole: its public functions reach users as
    # aj.* (aj.masked_softmax, aj.merge_attentions). Tests may test it.
    roots = [ROOT / "experiments", ROOT / "benchmarks", ROOT / "run.py"]
    offences = []
    for path in [p for r in roots
                 for p in ([r] if r.suffix == ".py" else sorted(r.rglob("*.py")))]:
      for target in _imports(ast.parse(path.read_text()), self.modules).values():
        if target == f"{PACKAGE}.core" or target.startswith(f"{PACKAGE}.core."):
          offences.append(f"{path.relative_to(ROOT)}: {target}")
    self.assertEqual(offences, [])

  def test_no_private_name_of_another_module_is_used(self):
    # Modules (core/ ones too) are the package's internal interfaces and may
    # be imported from any layer above; a private *name* inside another
    # module may not.
    roots = [ROOT / PACKAGE, ROOT / "experiments", ROOT / "benchmarks",
             ROOT / "run.py"]
    files = [p for r in roots
             for p in ([r] if r.suffix == ".py" else sorted(r.rglob("*.py")))]
    offences = []
    for path in files:
      tree = ast.parse(path.read_text())
      local = _imports(tree, self.modules)
      for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name) and node.value.id in local):
          offences.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                          f"{node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in self.modules:
          offences += [f"{path.relative_to(ROOT)}:{node.lineno} from "
                       f"{node.module} import {a.name}" for a in node.names
                       if a.name.startswith("_")
                       and f"{node.module}.{a.name}" not in self.modules]
    self.assertEqual(offences, [])


if __name__ == "__main__":
  absltest.main()
