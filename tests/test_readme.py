"""Every ```python block of README.md runs as written, in order, in one namespace, on the 8 CPU
devices of conftest; a block whose first line is a ``# not run: <reason>`` comment is skipped."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest
from helpers import flax_config_kept

import jax_reshard

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[str]:
  return BLOCK.findall(README.read_text())


def test_readme_has_runnable_blocks() -> None:
  blocks = _blocks()
  runnable = [b for b in blocks if not b.startswith("# not run:")]
  assert len(runnable) >= 6, f"{len(runnable)} runnable blocks of {len(blocks)}"


def test_readme_python_blocks_run(capsys: pytest.CaptureFixture[str]) -> None:
  """The Tunix block runs with Flax's ``flax_always_shard_variable`` off, as importing Tunix's
  models leaves it in a fresh process; later tests get it back as it was."""
  namespace: dict[str, object] = {"__name__": "readme"}
  for i, block in enumerate(_blocks()):
    if block.startswith("# not run:"):
      continue
    code = compile(block, f"README.md python block {i}", "exec")
    with flax_config_kept(tunix="from tunix" in block):
      exec(code, namespace)
  out = capsys.readouterr().out
  assert "bytes moved" in out and "predicted" in out


def test_readme_api_table_names_every_public_name() -> None:
  text = README.read_text()
  start = text.index("\n## API\n")
  table = text[start : text.index("\n## ", start + 1)]
  names = [f"jr.{n}" for n in _public_names("jax_reshard")]
  for extra in ("flax", "tunix"):
    pytest.importorskip(extra)
    names += [f"jax_reshard.{extra}.{n}" for n in _public_names(f"jax_reshard.{extra}")]
  missing = [n for n in names if not re.search(rf"`{re.escape(n)}\b", table)]
  assert len(names) > 20 and not missing, missing


def _public_names(module_name: str) -> list[str]:
  """The public functions and classes of a module (of the package: those it exports)."""
  module = importlib.import_module(module_name)
  return [
    n
    for n, v in vars(module).items()
    if not n.startswith("_")
    and (inspect.isfunction(v) or inspect.isclass(v))
    and (module is jax_reshard or v.__module__ == module_name)
  ]
