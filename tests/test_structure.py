"""The package's shape: layered imports without a circle, no private names across modules,
NumPy-only planning layers, and short functions."""

from __future__ import annotations

import ast
from pathlib import Path

import jax_reshard

PACKAGE = Path(jax_reshard.__file__).parent
# Each module may import only modules listed before it.
LAYERS = [
  "_errors",
  "_layout",
  "_topology",
  "_pieces",
  "_planner",
  "_schedule",
  "_classes",
  "_cost",
  "_plan",
  "_tplan",
  "_viz",
  "_program",
  "_buffers",
  "_emit",
  "_tree",
  "_edge",
  "_transform",
  "_distributed",
  "_tapi",
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
  "_errors",
  "_layout",
  "_topology",
  "_pieces",
  "_planner",
  "_schedule",
  "_classes",
  "_cost",
  "_plan",
  "_viz",
  "_program",
  "_tplan",
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


def test_functions_are_short() -> None:
  for module in LAYERS:
    for node in ast.walk(_tree(module)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
        assert lines <= MAX_FUNCTION_LINES, f"{module}.{node.name}: {lines} lines"
