"""Plans as data: tasks, dependencies and worker assignments, built by a strategy.

Nothing here imports Ray: the Ray executor and the simulator run the same plans.
"""

from verl_digen.schedule.plan import Plan, PlanError, Task, TaskId, TaskKind, WorkerId  # noqa: F401
from verl_digen.schedule.strategies import StepCosts, StrategySpec, StepPlanner  # noqa: F401
