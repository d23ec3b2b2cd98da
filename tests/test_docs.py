"""Every docstring example in the package runs (doctest), on the 8 devices of conftest."""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import pkgutil
from collections.abc import Iterator

import pytest

import jax_reshard

MODULES = sorted(m.name for m in pkgutil.iter_modules(jax_reshard.__path__, "jax_reshard."))
WITH_EXAMPLES = {
  "jax_reshard._api",
  "jax_reshard._cost",
  "jax_reshard._distributed",
  "jax_reshard._errors",
  "jax_reshard._layout",
  "jax_reshard._pieces",
  "jax_reshard._plan",
  "jax_reshard._reshard",
  "jax_reshard._schedule",
  "jax_reshard._tapi",
  "jax_reshard._topology",
  "jax_reshard._tplan",
  "jax_reshard._tprogram",
  "jax_reshard._transform",
  "jax_reshard._viz",
  "jax_reshard.flax",
  "jax_reshard.tunix",
}

# Modules of an optional extra (installed by `make test`): skipped without it.
OPTIONAL = {"jax_reshard.tunix": "tunix", "jax_reshard._viz": "matplotlib"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
  """Importing Tunix's models (the Tunix examples) turns Flax's ``flax_always_shard_variable``
  off for the whole process: later tests get it back as it was."""
  if name in OPTIONAL:
    pytest.importorskip(OPTIONAL[name])
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  out = io.StringIO()
  with _flax_config_kept():
    for test in doctest.DocTestFinder().find(module):
      runner.run(test, out=out.write)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, out.getvalue()
  assert (result.attempted > 0) == (name in WITH_EXAMPLES), result


@contextlib.contextmanager
def _flax_config_kept() -> Iterator[None]:
  try:
    from flax import config
  except ImportError:  # nothing to keep
    yield
    return
  before = config.flax_always_shard_variable
  try:
    yield
  finally:
    config.update("flax_always_shard_variable", before)
