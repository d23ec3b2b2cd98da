"""The package's shape: layered imports without a circle, no private names across modules,
NumPy-only planning layers, short functions, and no mutable module-level behaviour flags."""

from __future__ import annotations

import ast
import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import jax_reshard

PACKAGE = Path(jax_reshard.__file__).parent
ROOT = PACKAGE.parent  # the repository: tests, benchmarks, examples and notebooks beside it
# Each module may import only modules listed before it.
LAYERS = [
  "_errors",
  "_options",
  "_layout",
  "_topology",
  "_pieces",
  "_planner",
  "_chunks",
  "_rounds",
  "_schedule",
  "_classes",
  "_cost",
  "_plan",
  "_viz",
  "_program",
  "_build",
  "_buffers",
  "_emit",
  "_executable",
  "_tree",
  "_edge",
  "_transform",
  "_distributed",
  "_api",
  "_traced",
  "_vjp",
  "_reshard",
  "__init__",
  "flax",
  "tunix",
  "_demo",
  "__main__",
]
NUMPY_ONLY = {
  "_chunks",
  "_errors",
  "_options",
  "_layout",
  "_topology",
  "_pieces",
  "_planner",
  "_rounds",
  "_schedule",
  "_classes",
  "_cost",
  "_plan",
  "_viz",
  "_program",
  "_build",
}
MAX_FUNCTION_LINES = 80


def _tree(module: str) -> ast.Module:
  return ast.parse((PACKAGE / f"{module}.py").read_text())


def _imports(module: str) -> list[tuple[str, list[str]]]:
  """``(imported module, names)`` for every import in ``module`` (nested ones included)."""
  out = []
  for node in ast.walk(_tree(module)):
    if isinstance(node, ast.Import):
      out += [(a.name, []) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [a.name for a in node.names]
      if node.module == "jax_reshard":  # from jax_reshard import _x
        out += [(f"jax_reshard.{n}", []) for n in names]
      else:
        out.append((node.module, names))
  return out


def test_every_module_is_layered() -> None:
  assert sorted(LAYERS) == sorted(p.stem for p in PACKAGE.glob("*.py"))


def test_imports_follow_the_layers() -> None:
  for i, module in enumerate(LAYERS):
    for target, _ in _imports(module):
      if target == "jax_reshard":
        target = "jax_reshard.__init__"
      if target.startswith("jax_reshard."):
        name = target.removeprefix("jax_reshard.")
        assert LAYERS.index(name) < i, f"{module} imports {name}, a later layer"


def test_no_private_names_across_modules() -> None:
  for module in LAYERS:
    for target, names in _imports(module):
      if target.startswith("jax_reshard"):
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{module} imports {private} from {target}"


# The one module that reads JAX's private members (per-device buffers of an array, and the
# constructor that wraps them without checks), each with a fallback to the public API.
JAX_INTERNALS = {"_buffers"}


def test_no_private_fields_of_other_objects() -> None:
  """Outside ``self``, no attribute access to a private name (``plan._leaves``)."""
  for module in sorted(set(LAYERS) - JAX_INTERNALS):
    for node in ast.walk(_tree(module)):
      if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
        if node.attr.startswith("__") or (
          isinstance(node.value, ast.Name)
          and node.value.id
          in {
            "self",
            "cls",
          }
        ):
          continue
        owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
        assert owner in {"jax", "jax_reshard"}, f"{module}: {owner}.{node.attr}"


def test_planning_layers_need_no_jax() -> None:
  for module in NUMPY_ONLY:
    for target, _ in _imports(module):
      assert not target.startswith("jax") or target.startswith("jax_reshard"), (module, target)


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """A function's lines without its docstring (whose ``Example:`` the docstring style asks
  for): the measure of its code."""
  lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
  if ast.get_docstring(node, clean=False) is not None:
    doc = node.body[0]
    lines -= doc.end_lineno - doc.lineno + 1  # type: ignore[operator]
  return lines


def test_functions_are_short() -> None:
  for module in LAYERS:
    for node in ast.walk(_tree(module)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = _code_lines(node)
        assert lines <= MAX_FUNCTION_LINES, f"{module}.{node.name}: {lines} lines"


def test_no_module_level_flags() -> None:
  """Behaviour is chosen by ``Options`` values passed down, never by module state: no module of
  the package binds a module-level name to ``True`` or ``False`` (a flag), and none assigns a
  module-level name from inside a function (``global``)."""
  for module in LAYERS:
    tree = _tree(module)
    for node in tree.body:
      value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
      flag = isinstance(value, ast.Constant) and isinstance(value.value, bool)
      assert not flag, f"{module}:{node.lineno}: a module-level flag ({ast.unparse(node)})"
    for node in ast.walk(tree):
      assert not isinstance(node, ast.Global), f"{module}:{node.lineno}: global {node.names}"


def _sources() -> Iterator[tuple[str, ast.Module]]:
  """``(name, syntax tree)`` of every Python file of the package, tests, benchmarks and
  examples, and of every notebook's code cells."""
  for folder in ("jax_reshard", "tests", "benchmarks", "examples"):
    for path in sorted((ROOT / folder).glob("*.py")):
      yield str(path.relative_to(ROOT)), ast.parse(path.read_text())
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    yield str(path.relative_to(ROOT)), ast.parse(code)


def _module_aliases(tree: ast.Module) -> dict[str, str]:
  """Local name -> ``jax_reshard`` module it is bound to by an import of ``tree``."""
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("jax_reshard") and (a.asname or "." not in a.name):
          out[a.asname or a.name] = a.name
    elif isinstance(node, ast.ImportFrom) and node.module == "jax_reshard":
      for a in node.names:  # from jax_reshard import _emit: a module, not a name of __init__
        if not hasattr(jax_reshard, a.name) or a.name.startswith("_") or a.name == "flax":
          out[a.asname or a.name] = f"jax_reshard.{a.name}"
  return out


def _attribute_writes(node: ast.AST) -> Iterator[tuple[ast.expr, str]]:
  """``(owner, attribute)`` that ``node`` writes: the targets of an assignment
  (``owner.attribute = ...``), or a ``setattr`` call with a literal name (``setattr(owner,
  "attribute", ...)``, ``monkeypatch.setattr(owner, "attribute", ...)``)."""
  if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    yield from ((t.value, t.attr) for t in targets if isinstance(t, ast.Attribute))
  elif isinstance(node, ast.Call) and len(node.args) >= 2:
    func, (owner, attr) = node.func, node.args[:2]
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    if name == "setattr" and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
      yield owner, attr.value


def _module_state_writes(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
  """``(line, module, attribute)`` for every write of ``tree`` to a ``jax_reshard`` module's
  attribute that is not a function or class (a flag, threshold or other state), assigned or
  set with ``setattr`` (see :func:`_attribute_writes`)."""
  aliases = _module_aliases(tree)
  for node in ast.walk(tree):
    for owner, attr in _attribute_writes(node):
      if isinstance(owner, ast.Name) and owner.id in aliases:
        module = importlib.import_module(aliases[owner.id])
        if not callable(getattr(module, attr, None)):
          yield getattr(node, "lineno", 0), aliases[owner.id], attr


def test_no_code_sets_module_state() -> None:
  """No module, test, benchmark, example or notebook changes a ``jax_reshard`` module's flags,
  thresholds or other state (assigned, or patched with ``monkeypatch.setattr``): a plan made
  with other behaviour is made with ``options=Options(...)``. (Tests may still wrap or stub a
  module's functions to watch or steer a call.)"""
  found = [
    f"{name}:{line}: {module}.{attr}"
    for name, tree in _sources()
    for line, module, attr in _module_state_writes(tree)
  ]
  assert not found, found
