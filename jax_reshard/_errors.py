"""Exception types of jax_reshard: raised before any device work, leaving the source untouched."""

from __future__ import annotations


class ReshardError(ValueError):
  """A reshard request that cannot be carried out as given.

  Raised by every entry point (``reshard``, ``make_plan``, a plan's call, ``plan_layouts``,
  ``Layout``) before any device work; the message names the offending leaf
  (``jax.tree_util.keystr`` of its path), shows both layouts and says how to fix the call. A
  ``ValueError``, so code that catches those keeps working.

  Example:
    >>> import jax_reshard as jr
    >>> try:
    ...   jr.Layout.from_description((6,), mesh_shape=(4,), axis_names=("x",), spec=("x",))
    ... except jr.ReshardError as e:
    ...   print(e)
    spec ('x',) splits array axis 0 into 4 parts, but the dimension size is 6 ...
  """


class ReshardTypeError(ReshardError, TypeError):
  """A source or destination leaf of the wrong type (e.g. a destination that is no Sharding).

  Both a :class:`ReshardError` and a ``TypeError``; raised before any device work.

  Example:
    >>> import jax, numpy as np, jax_reshard as jr
    >>> x = jax.device_put(np.zeros(8, np.float32), jax.devices()[0])
    >>> try:
    ...   jr.make_plan({"w": x}, "tp")
    ... except jr.ReshardTypeError as e:
    ...   print(e)
    destination for leaf ['w'] is str, not a jax.sharding.Sharding ...
  """
