"""Exception types raised by jax_reshard.

Every error is raised before any device work starts and leaves the source untouched.
"""

from __future__ import annotations


class ReshardError(ValueError):
  """A reshard request that cannot be carried out as given.

  The message names the offending leaf (``jax.tree_util.keystr`` of its path), shows the source
  and destination layouts, and says how to fix the call.
  """


class ReshardTypeError(ReshardError, TypeError):
  """A source or destination leaf of the wrong type (e.g. a destination that is no Sharding)."""
