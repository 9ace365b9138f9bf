"""The pure performance layer: cost model, discrete-event simulator, planner search.

It imports only :mod:`verl_digen.schedule` (plans, the step driver), its own profiles and the
device table (:mod:`verl_digen.platform.devices`, data shared with the memory planner), never
the runtime (trainer, workers, sync, placement), so it runs anywhere without Ray or torch.

- :mod:`~verl_digen.sim.cost_model`: seconds per task from FLOPs, bytes and bandwidths,
  with profiles as data files (``verl_digen/sim/profiles/*.yaml``: systems, rewards, models;
  ``verl_digen/platform/devices.yaml``: devices), and the zero-bubble bound (a linear
  program, :mod:`~verl_digen.sim.bound`);
- :mod:`~verl_digen.sim.calibrate`: the free constants fitted to veRL-Omni's published runs
  (``python -m verl_digen.sim.calibrate``);
- :mod:`~verl_digen.sim.simulator`: the loop's step driver over plans in virtual time;
- :mod:`~verl_digen.sim.planner`: the pool-split search and its CLI
  (``python -m verl_digen.sim.planner``).

Runtime tools built on these live next to the runtime they drive: the emulated cluster
(:mod:`verl_digen.workers.emulated`, ``python -m verl_digen.emulate``) and the device profiler
(``python -m verl_digen.profile``).
"""

from verl_digen.sim.cost_model import (  # noqa: F401
    Catalog,
    Cluster,
    CostModel,
    DeviceProfile,
    ModelProfile,
    PoolPlacement,
    ProfileError,
    RewardProfile,
    SystemProfile,
    TableCostModel,
    Workload,
    load_catalog,
)
from verl_digen.sim.simulator import SimResult, SimulatedExecutor, simulate, simulate_plan  # noqa: F401
