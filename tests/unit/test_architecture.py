"""The package's layering (docs/architecture.md), checked on the source, and the one step driver.

- ``sim/`` is pure: it imports only ``schedule/`` and the memory planner (``memory/``, which never
  imports ``sim/``; and itself, and the device table), never the runtime;
- no import circles: the package's module import graph (function-level imports included) is acyclic;
- ``workers/`` never import the controller (``trainer/``);
- a step is driven in one place: only ``schedule/driver.py`` plans steps and runs a plan to a
  step's optimizer step; the loop and the simulator both go through it;
- the controller loop stays readable (under 350 lines) and importing it changes no environment;
- the simulator re-balances TSP stages from measured stage times, as the loop does.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from verl_digen.schedule.plan import TaskKind
from verl_digen.schedule.strategies import StrategySpec
from verl_digen.sim.cost_model import Cluster, TableCostModel
from verl_digen.sim.simulator import simulate

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "verl_digen")


def _modules(sub: str) -> dict[str, ast.Module]:
    root = os.path.join(PKG, sub)
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    out[os.path.relpath(path, PKG)] = ast.parse(f.read(), path)
    return out


def _imports(tree: ast.Module) -> set[str]:
    """Every verl_digen module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl_digen"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("verl_digen"))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# Shared data below every layer: the device table (GPU memory for the memory planner, speeds for
# the simulator). It imports nothing from verl_digen.
DATA_MODULES = {"verl_digen.platform.devices", "verl_digen.platform.nodes"}


def test_sim_imports_only_schedule_and_the_memory_planner():
    for path, tree in _modules("sim").items():
        data = {m for m in _imports(tree) if m in DATA_MODULES or m.rpartition(".")[0] in DATA_MODULES}
        layers = {_layer(m) for m in _imports(tree) - data} - {"sim", "schedule", "memory"}
        assert not layers, (f"{path} imports verl_digen.{sorted(layers)}: sim/ must stay pure (schedule/, the memory "
                            "planner and data only)")


def test_the_memory_planner_does_not_import_the_simulator():
    """One memory model: the simulator asks the memory planner what fits (sim/costs/memory_fit.py:
    CostModel.memory_job), never the reverse."""
    for path, tree in _modules("memory").items():
        bad = sorted(m for m in _imports(tree) if _layer(m) == "sim")
        assert not bad, f"{path} imports {bad}: memory/ is below sim/"


def test_shared_data_modules_import_nothing_of_the_package():
    for module in DATA_MODULES:
        path = os.path.join(PKG, *module.split(".")[1:]) + ".py"
        with open(path) as f:
            found = _imports(ast.parse(f.read(), path))
        assert not found, f"{module} imports {sorted(found)}: it must stay below every layer"


def test_schedule_imports_nothing_above_it():
    for path, tree in _modules("schedule").items():
        layers = {_layer(m) for m in _imports(tree)} - {"schedule"}
        assert not layers, f"{path} imports verl_digen.{sorted(layers)}"


def test_workers_do_not_import_the_controller():
    for path, tree in _modules("workers").items():
        bad = sorted(m for m in _imports(tree) if _layer(m) == "trainer")
        assert not bad, f"{path} imports {bad}: workers must not import trainer/"


def test_the_reward_servers_parts_sit_below_its_app_and_cli():
    """``rewards/serve/``: the wire protocols, images, scoring, limits, connections, auth and errors
    never import the app (FastAPI, RewardServer), the CLI or the package (which re-exports them
    all); the app never imports the CLI."""
    pkg = "verl_digen.rewards.serve"
    for path, tree in _modules(os.path.join("rewards", "serve")).items():
        part = os.path.splitext(os.path.basename(path))[0]
        if part in ("__init__", "__main__", "cli"):
            continue
        above = [f"{pkg}.cli"] + ([f"{pkg}.app"] if part != "app" else [])
        bad = sorted(m for m in _imports(tree) if m == pkg or any(m == a or m.startswith(a + ".") for a in above))
        assert not bad, f"{path} imports {bad}: the server's parts sit below its app, the app below its CLI"


def _calls(tree: ast.Module, attr: str) -> int:
    return sum(
        1 for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
    )


def test_steps_are_planned_and_run_only_by_the_step_driver():
    trees = {**_modules("trainer"), **_modules("sim"), **_modules("schedule")}
    for path, tree in trees.items():
        if path == os.path.join("schedule", "driver.py"):
            assert _calls(tree, "plan_step") == 1 and _calls(tree, "run_until") >= 1
            continue
        assert _calls(tree, "plan_step") == 0, f"{path} plans steps itself; use schedule.driver.StepDriver"
    for path in (os.path.join("trainer", "loop.py"), os.path.join("sim", "simulator.py")):
        names = {n.id for n in ast.walk(trees[path]) if isinstance(n, ast.Name)}
        assert "StepDriver" in names, f"{path} does not drive steps with StepDriver"


def test_one_denoising_loop():
    """Only the rollout sampler steps the denoiser (validation uses its ODE mode); the updater
    recomputes single steps for the loss through the sampler's own transformer calls
    (``velocity_in_chunks``: the same precision path). No second sampler anywhere else."""
    callers = set()
    for sub in ("workers", "trainer", "rewards", "schedule", "sim", "sync", "placement"):
        for path, tree in _modules(sub).items():
            if _calls(tree, "predict_velocity"):
                callers.add(path)
    for path in ("compare.py", "export.py", "profile.py", "emulate.py", "main.py"):
        with open(os.path.join(PKG, path)) as f:
            if _calls(ast.parse(f.read()), "predict_velocity"):
                callers.add(path)
    assert callers == {os.path.join("workers", "sampling.py")}, callers
    training = _modules("workers")[os.path.join("workers", "training.py")]
    assert any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "velocity_in_chunks"
               for n in ast.walk(training))


def test_controller_loop_is_short():
    with open(os.path.join(PKG, "trainer", "loop.py")) as f:
        lines = len(f.readlines())
    assert lines < 350, f"trainer/loop.py has {lines} lines"


def test_importing_the_loop_changes_no_environment_variable():
    code = (
        "import os; before = dict(os.environ); import verl_digen.trainer.loop, verl_digen.main; "
        "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)); "
        "print(changed)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENIZERS_PARALLELISM", "TRANSFORMERS_VERBOSITY",
                                                            "DIFFUSERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    changed = eval(out.stdout.strip().splitlines()[-1])
    ours = [k for k in changed if k in ("TOKENIZERS_PARALLELISM", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY",
                                        "HF_HUB_DISABLE_PROGRESS_BARS", "OMP_NUM_THREADS")]
    assert ours == [], f"importing the loop set {ours}"


def test_reading_a_config_planning_and_emulating_import_no_torch():
    """An emulated worker (``digen.emulate``: one process per emulated device) reads the run's
    config and the cost model and sleeps; importing torch for that cost each of them about a
    second of CPU (``algos/`` and ``sync/`` re-export their submodules lazily, ``lazy.py``)."""
    code = ("import sys, verl_digen.config.schema, verl_digen.memory.plan, verl_digen.sim.cost_model, "
            "verl_digen.workers.emulated, verl_digen.algos, verl_digen.sync; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'verl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_lazily_exported_names_are_the_submodules_own_and_an_unknown_one_is_named(monkeypatch):
    import verl_digen.algos as algos
    import verl_digen.sync as sync
    from verl_digen.algos.loss import flow_grpo_loss
    from verl_digen.sync.transport import find_free_port

    assert algos.flow_grpo_loss is flow_grpo_loss and sync.find_free_port is find_free_port
    assert set(algos.__all__) <= set(dir(algos)) and "WeightChannel" in dir(sync)
    for name in algos.__all__:
        assert name.isupper() or getattr(algos, name).__module__.startswith("verl_digen.algos."), name
    with pytest.raises(AttributeError, match="module 'verl_digen.algos' has no attribute 'nope'"):
        algos.nope  # noqa: B018
    # a submodule is an attribute of its package, as when the package imported it eagerly (the
    # import system sets it when the submodule is first imported; here it is taken away first)
    import verl_digen.algos.sde

    monkeypatch.delattr(algos, "sde")
    assert algos.sde is verl_digen.algos.sde and sync.buckets.DEFAULT_BUCKET_BYTES > 0


# ---------------------------------------------------------------------------- the simulator mirrors the loop


@dataclass
class _StepCostTable(TableCostModel):
    """Generation costs the sum of its denoising steps' costs: the last steps are 4x dearer."""

    step_s: tuple[float, ...] = (1, 1, 1, 1, 1, 1, 4, 4)

    def task_seconds(self, task, worker, cluster=None, *, switch_from=None):
        if task.kind == TaskKind.GENERATE:
            lo, hi = task.denoise or (0, len(self.step_s))
            return sum(self.step_s[lo:hi])
        return super().task_seconds(task, worker, cluster, switch_from=switch_from)


def test_simulator_rebalances_tsp_stages_from_measured_stage_times_like_the_loop():
    spec = StrategySpec(
        placement="disaggregated", rollout_workers=2, trainer_workers=1, groups_per_step=4, group_size=2,
        tsp_stages=2, num_steps=8, gap=True,
    )
    costs = _StepCostTable(seconds={"reward": 0.1, "train": 0.5, "optimizer_step": 0.1, "sync": 0.1})
    cluster = Cluster.for_spec(spec, "any")
    fixed = simulate(spec, costs, cluster, steps=5, warmup=2)
    balanced = simulate(spec, costs, cluster, steps=5, warmup=2, tsp_balance=True)
    assert fixed.spec.bounds == (0, 4, 8)
    # Even split: stages of 4 s and 10 s; measured per-step means move the boundary towards
    # the expensive tail until the slowest stage stops improving by 10%: (0, 6, 8) -> 6 s and 8 s.
    assert balanced.spec.bounds == (0, 6, 8)
    assert balanced.step_time_s < fixed.step_time_s
    # Every generate record says which TSP stage it was (no parsing of task ids).
    gens = [r for r in balanced.timeline.records if r.kind == "generate"]
    assert {r.stage for r in gens} == {0, 1}
    assert all(r.task.endswith(f":s{r.stage}") for r in gens)


def test_simulated_steps_report_the_loops_timing_and_tag_metrics():
    spec = StrategySpec(
        placement="disaggregated", rollout_workers=1, trainer_workers=1, groups_per_step=4, group_size=2,
        gap=True, tag=True,
    )
    costs = TableCostModel(seconds={"generate": 2.0, "reward": 0.1, "train": 0.5, "optimizer_step": 0.1, "sync": 0.1})
    r = simulate(spec, costs, Cluster.for_spec(spec, "any"), steps=4, warmup=1, tag_switch_s=0.0, mirror_loop=True)
    first, later = r.step_metrics[0], r.step_metrics[1:]
    assert first["tag/groups"] == 0.0  # nothing measured yet, as in the loop
    # Trainers wait for groups: from step 2 on they generate part of the batch themselves.
    assert all(m["tag/groups"] > 0 for m in later)
    # the steady state decides from the model's costs until a step is measured, then as the loop
    steady = simulate(spec, costs, Cluster.for_spec(spec, "any"), steps=4, warmup=1, tag_switch_s=0.0)
    assert steady.step_metrics[0]["tag/groups"] == later[0]["tag/groups"] > 0
    assert steady.step_metrics[0]["tag/train_per_group"] == pytest.approx(later[0]["tag/train_per_group"])
    for key in ("images_per_s", "step_time_s", "bubble_fraction", "bubble/head_trainer", "bubble/drain_rollout",
                "weight_sync_s", "strategy", "devices"):
        assert key in first


# ---------------------------------------------------------------------------- no import circles


def _module_name(path: str) -> str:
    """``verl_digen/a/b.py`` -> ``verl_digen.a.b``; a package's ``__init__.py`` -> the package."""
    name = os.path.relpath(path, os.path.dirname(PKG))[: -len(".py")].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _import_targets(module: str, is_package: bool, node: ast.AST, known: set[str]) -> set[str]:
    """The package modules one import statement loads: ``from a import b`` names module ``a.b``
    when there is one, else module ``a``; relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    found = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            found.add(f"{base}.{alias.name}")
        elif base in known:
            found.add(base)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at module level or inside functions."""
    paths = {_module_name(os.path.join(d, f)): os.path.join(d, f)
             for d, _, files in os.walk(PKG) for f in files if f.endswith(".py")}
    known = set(paths)
    graph = {}
    for module, path in paths.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        graph[module] = set().union(*(_import_targets(module, is_package, n, known) for n in ast.walk(tree))) - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_has_no_import_circles():
    graph = import_graph()
    assert "verl_digen.memory.plan" in graph["verl_digen.memory.__main__"]  # the graph sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_names_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
