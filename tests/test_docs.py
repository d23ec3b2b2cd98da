"""Every docstring example in the package runs (doctest), on the 8 devices of conftest."""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

import jax_reshard

MODULES = sorted(m.name for m in pkgutil.iter_modules(jax_reshard.__path__, "jax_reshard."))
WITH_EXAMPLES = {
  "jax_reshard._api",
  "jax_reshard._cost",
  "jax_reshard._distributed",
  "jax_reshard._layout",
  "jax_reshard._pieces",
  "jax_reshard._plan",
  "jax_reshard._reshard",
  "jax_reshard._schedule",
  "jax_reshard._topology",
  "jax_reshard._tplan",
  "jax_reshard._transform",
}

# Modules of an optional extra (installed by `make test`): skipped without it.
OPTIONAL = {"jax_reshard.tunix": "tunix"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
  if name in OPTIONAL:
    pytest.importorskip(OPTIONAL[name])
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  out = io.StringIO()
  for test in doctest.DocTestFinder().find(module):
    runner.run(test, out=out.write)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, out.getvalue()
  assert (result.attempted > 0) == (name in WITH_EXAMPLES), result
