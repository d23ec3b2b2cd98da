"""Every docstring example in the package runs (doctest), on the 8 devices of conftest, and the
docstrings of the public names follow one style."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import io
import pkgutil
import re
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import flax_config_kept

import jax_reshard

MODULES = sorted(m.name for m in pkgutil.iter_modules(jax_reshard.__path__, "jax_reshard."))
WITH_EXAMPLES = {
  "jax_reshard._api",
  "jax_reshard._chunks",
  "jax_reshard._cost",
  "jax_reshard._distributed",
  "jax_reshard._errors",
  "jax_reshard._layout",
  "jax_reshard._options",
  "jax_reshard._pieces",
  "jax_reshard._plan",
  "jax_reshard._reshard",
  "jax_reshard._rounds",
  "jax_reshard._topology",
  "jax_reshard._transform",
  "jax_reshard._viz",
  "jax_reshard.flax",
  "jax_reshard.tunix",
}

# Modules of an optional extra (installed by `make test`): skipped without it.
OPTIONAL = {"jax_reshard.tunix": "tunix", "jax_reshard._viz": "matplotlib"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
  """Tunix's examples run with Flax's ``flax_always_shard_variable`` off, as Tunix code does;
  later tests get it back as it was."""
  if name in OPTIONAL:
    pytest.importorskip(OPTIONAL[name])
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  out = io.StringIO()
  with flax_config_kept(tunix=name == "jax_reshard.tunix"):
    for test in doctest.DocTestFinder().find(module):
      runner.run(test, out=out.write)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, out.getvalue()
  assert (result.attempted > 0) == (name in WITH_EXAMPLES), result


# --- One docstring style for the public names --------------------------------------------------

# Public modules and the classes whose public methods and properties are checked too.
PUBLIC_MODULES = {"jax_reshard": None, "jax_reshard.flax": "flax", "jax_reshard.tunix": "tunix"}
CLASSES_WITH_MEMBERS = (
  "ReshardPlan",
  "TransformPlan",
  "Layout",
  "Topology",
  "Estimate",
  "PlanStats",
)
SECTIONS = ("Attributes", "Args", "Returns", "Raises", "Example")
_HEADER = re.compile(r"^(\w+):$")
_ENTRY = re.compile(r"^  (\*{0,2}\w+)(?: \([^)]*\))?:")


def public_names(module: Any) -> Iterator[tuple[str, Any]]:
  """The module's public functions and classes (the package: what it exports), then the public
  methods and properties (and ``__call__``) of :data:`CLASSES_WITH_MEMBERS`."""
  own = module.__name__ != "jax_reshard"
  for name, obj in sorted(vars(module).items()):
    if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
      continue
    if own and obj.__module__ != module.__name__:
      continue  # imported, not defined here
    yield f"{module.__name__}.{name}", obj
    if name in CLASSES_WITH_MEMBERS:
      for member, value in vars(obj).items():
        if member == "__call__" or not member.startswith("_"):
          if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
          if inspect.isfunction(value) or isinstance(value, property):
            yield f"{module.__name__}.{name}.{member}", value


def _sections(doc: str) -> dict[str, list[str]]:
  """The body lines of each ``Header:`` line at the docstring's own indentation."""
  out: dict[str, list[str]] = {}
  current: list[str] | None = None
  for line in doc.splitlines():
    m = _HEADER.match(line)
    if m:
      current = out.setdefault(m.group(1), [])
    elif current is not None and (line.startswith("  ") or not line.strip()):
      current.append(line)
    else:
      current = None
  return out


def style_problems(obj: Any) -> list[str]:
  """What the docstring of ``obj`` (a function, class or property) lacks of the style: a
  one-line summary ending in a full stop, then a blank line; sections in the order of
  :data:`SECTIONS`, the last an ``Example:`` with a ``>>>`` line that runs (no ``+SKIP``);
  for a function taking parameters, ``Args:`` with one entry per parameter; for a dataclass,
  ``Attributes:`` with one entry per field."""
  raw = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
  if not raw or not raw.strip():
    return ["no docstring"]
  doc = inspect.cleandoc(raw)
  lines = doc.splitlines()
  problems = []
  if not lines[0].endswith(".") or (len(lines) > 1 and lines[1].strip()):
    problems.append(f"summary is not one line ending in '.': {lines[0]!r}")
  sections = _sections(doc)
  order = [h for h in (m.group(1) for m in map(_HEADER.match, lines) if m) if h in SECTIONS]
  if order != sorted(order, key=SECTIONS.index) or len(set(order)) != len(order):
    problems.append(f"sections {order} not in the order {SECTIONS}")
  if not order or order[-1] != "Example":
    problems.append("no Example: section, last")
  elif not any(">>>" in ln and "+SKIP" not in ln for ln in sections["Example"]):
    problems.append("the Example: section has no example that runs")
  params: list[str] = []
  documented: list[str] = []
  if inspect.isfunction(obj):
    sig = inspect.signature(obj)
    for p in sig.parameters.values():
      if p.name in ("self", "cls"):
        continue
      stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
      params.append(stars + p.name)
    documented = _entries(sections.get("Args", []))
  elif dataclasses.is_dataclass(obj):
    params = [f.name for f in dataclasses.fields(obj)]
    documented = _entries(sections.get("Attributes", []))
  if params:
    missing = [p for p in params if p not in documented]
    if missing:
      problems.append(f"parameters or fields without an entry: {missing}")
  return problems


def _entries(body: list[str]) -> list[str]:
  return [m.group(1) for m in map(_ENTRY.match, body) if m]


@pytest.mark.parametrize("module_name", sorted(PUBLIC_MODULES))
def test_public_docstrings_follow_one_style(module_name: str) -> None:
  extra = PUBLIC_MODULES[module_name]
  if extra is not None:
    pytest.importorskip(extra)
  module = importlib.import_module(module_name)
  names = list(public_names(module))
  if module_name == "jax_reshard":
    exported = {n for n in vars(jax_reshard) if not n.startswith("_")} - {"flax", "tunix"}
    assert {n.split(".")[1] for n, _ in names} == exported, "every export is checked"
    # The exports and the members of the six classes (TransformPlan's inherited ones counted
    # on ReshardPlan).
    assert len(names) >= 45, names
  problems = {name: p for name, obj in names if (p := style_problems(obj))}
  assert not problems, "\n".join(f"{n}: {'; '.join(p)}" for n, p in problems.items())


def test_style_check_finds_what_a_docstring_lacks() -> None:
  def bare(x: int, *, y: int = 0) -> int:
    """adds y to x
    and more."""
    return x + y

  def skipped(x: int, **kwargs: Any) -> int:
    """Adds one.

    Args:
      x: a number.

    Example:
      >>> skipped(1)  # doctest: +SKIP
      2
    """
    return x + 1

  def unordered(x: int) -> int:
    """Adds one.

    Example:
      >>> unordered(1)
      2

    Args:
      x: a number.
    """
    return x + 1

  def good(x: int, **kwargs: Any) -> int:
    """Adds one.

    Args:
      x: a number.
      **kwargs: ignored.

    Returns:
      ``x + 1``.

    Example:
      >>> good(1)
      2
    """
    return x + 1

  assert style_problems(bare) == [
    "summary is not one line ending in '.': 'adds y to x'",
    "no Example: section, last",
    "parameters or fields without an entry: ['x', 'y']",
  ]
  assert style_problems(skipped) == [
    "the Example: section has no example that runs",
    "parameters or fields without an entry: ['**kwargs']",
  ]
  assert style_problems(unordered) == [
    "sections ['Example', 'Args'] not in the order " + str(SECTIONS),
    "no Example: section, last",
  ]
  assert style_problems(good) == []

  @dataclasses.dataclass
  class Point:
    """A point.

    Attributes:
      x: across.

    Example:
      >>> Point(1, 2).y
      2
    """

    x: int
    y: int

  assert style_problems(Point) == ["parameters or fields without an entry: ['y']"]
  assert style_problems(property(lambda self: 1)) == ["no docstring"]
