"""jax_reshard: exact minimal-traffic resharding between any two JAX layouts."""

from jax_reshard._api import ReshardPlan as ReshardPlan
from jax_reshard._api import TransformPlan as TransformPlan
from jax_reshard._api import make_plan as make_plan
from jax_reshard._api import plan_cache_clear as plan_cache_clear
from jax_reshard._cost import Estimate as Estimate
from jax_reshard._cost import estimate as estimate
from jax_reshard._distributed import ReshardPeerError as ReshardPeerError
from jax_reshard._distributed import ReshardPlanMismatchError as ReshardPlanMismatchError
from jax_reshard._errors import ReshardError as ReshardError
from jax_reshard._errors import ReshardTypeError as ReshardTypeError
from jax_reshard._layout import Layout as Layout
from jax_reshard._options import Options as Options
from jax_reshard._plan import LayoutPlan as LayoutPlan
from jax_reshard._plan import PlanStats as PlanStats
from jax_reshard._plan import plan_layouts as plan_layouts
from jax_reshard._reshard import reshard as reshard
from jax_reshard._schedule import BucketBoundError as BucketBoundError
from jax_reshard._topology import Link as Link
from jax_reshard._topology import Topology as Topology
from jax_reshard._viz import plot_rounds as plot_rounds
from jax_reshard._viz import plot_traffic as plot_traffic
from jax_reshard._viz import traffic_matrix as traffic_matrix

__version__ = "0.1.0"
