"""Exception types of jax_reshard: raised before any device work, leaving the source untouched."""

from __future__ import annotations


class ReshardError(ValueError):
  """A reshard request that cannot be carried out as given (a ``ValueError``).

  Raised by every entry point before any device work; the message names the offending leaf
  (``jax.tree_util.keystr`` of its path), shows both layouts and says how to fix the call.

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

  Example:
    >>> import jax, numpy as np, jax_reshard as jr
    >>> x = jax.device_put(np.zeros(8, np.float32), jax.devices()[0])
    >>> try:
    ...   jr.make_plan({"w": x}, "tp")
    ... except jr.ReshardTypeError as e:
    ...   print(e)
    destination for leaf ['w'] is str, not a jax.sharding.Sharding ...
  """


class BucketBoundError(ReshardError):
  """``max_bucket_bytes`` is below what one leaf needs even split into its smallest chunks.

  Attributes:
    leaf: position of the leaf in the list given to :func:`make_schedule`.
    minimum_bytes: the staging bytes per device that leaf needs at least.

  Example:
    >>> import jax_reshard as jr
    >>> lay = lambda spec: jr.Layout.from_description(
    ...   (1024, 1024), mesh_shape=(8,), axis_names=("x",), spec=spec)
    >>> try:
    ...   jr.plan_layouts([(lay(("x",)), lay((None, "x")))], [4], max_bucket_bytes=1024)
    ... except jr.BucketBoundError as e:
    ...   print(e.minimum_bytes)
    4096
  """

  def __init__(self, message: str, leaf: int, minimum_bytes: int) -> None:
    super().__init__(message)
    self.leaf, self.minimum_bytes = leaf, minimum_bytes
