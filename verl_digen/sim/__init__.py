"""Cost model, discrete-event simulator and emulated cluster for verl-digen plans.

- :mod:`~verl_digen.sim.cost_model`: seconds per task from FLOPs, bytes and bandwidths,
  with profiles as data files (``verl_digen/sim/profiles/*.yaml``), and the zero-bubble bound;
- :mod:`~verl_digen.sim.simulator`: the plans the Ray executor runs, in virtual time;
- :mod:`~verl_digen.sim.emulated`: the real Ray executor on workers that sleep for the cost
  model's durations (the orchestration measured at 16-32 devices on one machine);
- :mod:`~verl_digen.sim.profile`: measure this machine and write a profile.

The planner CLI built on these is ``python -m verl_digen.plan``.
"""

from verl_digen.sim.cost_model import (  # noqa: F401
    Catalog,
    Cluster,
    CostModel,
    DeviceProfile,
    ModelProfile,
    PoolPlacement,
    ProfileError,
    SystemProfile,
    TableCostModel,
    Workload,
    load_catalog,
)
from verl_digen.sim.simulator import SimResult, SimulatedExecutor, simulate, simulate_plan  # noqa: F401
