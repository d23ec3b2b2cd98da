"""Every notebook in ``notebooks/`` runs top to bottom and is committed without outputs.

Each notebook runs in its own kernel process, so the device configuration it sets (8 CPU
devices, ``jax_platforms``) never meets the one of the test process.
"""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
# Notebooks that need an optional extra (installed by `make test`): skipped without it.
NEEDS = {"04_tunix_grpo.ipynb": "tunix"}


def test_there_are_notebooks() -> None:
  assert NOTEBOOKS, f"no notebooks in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: pathlib.Path) -> None:
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, f"{path.name} has no code cells"
  dirty = [i for i, c in enumerate(nb.cells) if c.get("outputs") or c.get("execution_count")]
  assert not dirty, (
    f"{path.name}: cells {dirty} have outputs or execution counts; clear them with "
    f"jupyter nbconvert --clear-output --inplace {path}"
  )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  if path.name in NEEDS:
    pytest.importorskip(NEEDS[path.name])
  # Inline figures are rendered to PNG in the kernel: headless, and every plot is drawn.
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    timeout=CELL_TIMEOUT_S,
    kernel_name="python3",
    resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
  )
  client.execute()  # raises CellExecutionError naming the cell on any error
  ran = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") for c in ran), "some code cells did not run"
  errors = [o for c in ran for o in c.outputs if o.output_type == "error"]
  assert not errors
