"""``python -m verl_digen.sim.calibrate``: fit the cost model's free constants to published runs.

The runs are data (``profiles/published-runs.yaml``: veRL-Omni's Qwen-Image FlowGRPO runs, each
with its source, settings and published seconds). Each is predicted by the same code the
planner uses: a colocated plan of the ``verl-omni`` system profile, simulated step by step
(:func:`verl_digen.sim.simulator.simulate`), or, for a generation phase alone, the cost model's
generate time. Five constants are free, fitted in three stages that each see only the runs
that determine them:

1. **rollout** (two generation-phase times, batched and serial): ``mfu_forward`` and
   ``mfu_half_tokens``, the efficiency curve of a forward against its tokens;
2. **reward** (the same LoRA run with its judge colocated and on one extra GPU): the judge's
   ``decode_tail_s``, the time its longest answer keeps a call open;
3. **step** (three whole-step times): ``mfu_train`` and the system's ``step_fixed_s``, by least
   squares on the relative error (``step_fixed_s >= 0``, MFUs at most 0.6: a fit that needs more
   means a FLOP count is wrong). Leave-one-out: fit on two step runs, predict the third.

The fitted efficiencies apply to every Hopper device profile (H100, H800, H200: the same tensor
cores) and, for lack of a published run, to A100 and L40S; ``step_fixed_s`` to veRL-Omni and to
ours alike (we have no measurement of our own per-step overhead at scale).

    python -m verl_digen.sim.calibrate                    # fit, print predicted vs published, leave-one-out
    python -m verl_digen.sim.calibrate --write            # also write profiles/calibrated.yaml and the doc table
    python -m verl_digen.sim.calibrate --check            # the shipped calibration: predicted vs published only
    python -m verl_digen.sim.calibrate --all-params-per-token   # what the fit needs with 2P FLOPs per token
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from verl_digen.schedule.strategies import StrategySpec
from verl_digen.sim.cost_model import PROFILE_DIR, Catalog, Cluster, CostModel, PoolPlacement, ProfileError, load_catalog
from verl_digen.sim.simulator import simulate

RUNS_FILE = os.path.join(PROFILE_DIR, "published-runs.yaml")
CALIBRATED_FILE = os.path.join(PROFILE_DIR, "calibrated.yaml")
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "cost_model.md")
DOC_BEGIN, DOC_END = "<!-- calibration:begin -->", "<!-- calibration:end -->"
FITTED_DEVICES = ("H100", "H800", "H200")  # the published runs' devices: one silicon
APPLIED_DEVICES = ("A100", "L40S")  # no published run: the Hopper fit applied
SYSTEMS = ("verl-omni", "verl-digen")
JUDGE = "qwen3-vl-8b-ocr"
MFU_CAP = 0.6  # physical ceiling for a bf16 DiT on Hopper-class devices
BAND = 0.25  # the calibrated prediction of every published run stays within +-25%
COMMAND = "python -m verl_digen.sim.calibrate"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    label: str
    published_s: float
    measure: str  # step | generate
    stage: str  # rollout | reward | step
    source: str
    model: str
    system: str
    device: str
    devices: int
    workload: dict[str, Any]
    system_changes: dict[str, Any] = field(default_factory=dict)
    reward_devices: int = 0
    notes: str = ""


def load_runs(path: str = RUNS_FILE) -> list[PublishedRun]:
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    out = []
    for name, data in (doc.get("runs") or {}).items():
        try:
            out.append(PublishedRun(name=name, **data))
        except TypeError as e:
            raise ProfileError(f"{path}: run {name!r}: {e}") from None
    return out


@dataclass(frozen=True)
class Constants:
    mfu_forward: float
    mfu_half_tokens: float
    mfu_train: float
    step_fixed_s: float
    decode_tail_s: float

    @classmethod
    def of(cls, catalog: Catalog) -> "Constants":
        d = catalog.device(FITTED_DEVICES[1])
        return cls(d.mfu_forward, d.mfu_half_tokens, d.mfu_train, catalog.system(SYSTEMS[0]).step_fixed_s,
                   catalog.reward(JUDGE).decode_tail_s)


def apply(catalog: Catalog, c: Constants) -> Catalog:
    """A copy of ``catalog`` with the constants set where calibrated.yaml would set them."""
    devices = dict(catalog.devices)
    for name in FITTED_DEVICES + APPLIED_DEVICES:
        if name in devices:
            devices[name] = replace(devices[name], mfu_forward=c.mfu_forward, mfu_half_tokens=c.mfu_half_tokens,
                                    mfu_train=c.mfu_train)
    systems = dict(catalog.systems)
    for name in SYSTEMS:
        systems[name] = replace(systems[name], step_fixed_s=c.step_fixed_s)
    rewards = dict(catalog.rewards)
    rewards[JUDGE] = replace(rewards[JUDGE], decode_tail_s=c.decode_tail_s)
    return Catalog(models=catalog.models, devices=devices, systems=systems, rewards=rewards, files=catalog.files)


# ---------------------------------------------------------------------------- predictions


def run_costs(run: PublishedRun, catalog: Catalog) -> CostModel:
    costs = CostModel.from_catalog(catalog, run.model, devices=[run.device], system=run.system, **run.workload)
    if run.system_changes:
        costs = costs.with_system(replace(costs.system, **run.system_changes))
    return costs


def run_plan(run: PublishedRun, costs: CostModel) -> tuple[StrategySpec, Cluster]:
    """veRL-Omni's colocated step as a plan: one generate and one train task per worker (its engine
    takes the worker's whole share at once); with a reward pool, one generate task per unit so
    finished samples stream to the judge as they do in its async-reward mode."""
    w, n = costs.workload, run.devices
    if w.groups_per_step % n:
        raise ProfileError(f"run {run.name}: {w.groups_per_step} groups do not divide over {n} devices")
    per = w.groups_per_step // n
    per = 1 if run.reward_devices else per  # streaming: unit tasks (a colocated worker trains what it generated)
    spec = StrategySpec("colocated", n, n, w.groups_per_step, w.group_size, reward_workers=run.reward_devices,
                        groups_per_task=per, train_micro_batch_groups=per)
    return spec, Cluster.for_spec(spec, run.device, costs.device(run.device).devices_per_node)


def predict(run: PublishedRun, catalog: Catalog) -> float:
    """Seconds the cost model predicts for what ``run`` published (a step, or its generation)."""
    costs = run_costs(run, catalog)
    spec, cluster = run_plan(run, costs)
    if run.measure == "generate":
        dev = costs.device(run.device)
        share = math.ceil(costs.workload.images_per_step / run.devices)
        return costs.generate_seconds(share, dev, batch=costs.rollout_batch(cluster, "fused"))
    return simulate(spec, costs, cluster, steps=3, warmup=1).step_time_s


def breakdown(run: PublishedRun, catalog: Catalog) -> dict[str, float]:
    """What one worker spends per step, by term (the colocated plan runs in lockstep, so the
    step is their sum when no reward pool is involved)."""
    costs = run_costs(run, catalog)
    spec, cluster = run_plan(run, costs)
    dev = costs.device(run.device)
    group = costs.train_group(cluster)
    w = costs.workload
    share = w.images_per_step // run.devices
    k = w.trained_steps
    b = costs.pass_batch(dev, group)
    from verl_digen.sim.cost_model import _passes

    train = k * sum(costs.train_pass_seconds(x, dev, group) for x in _passes(share, b))
    recompute = costs.train_seconds(share, dev, group) - train
    out = {
        "generate": costs.generate_seconds(share, dev, batch=costs.rollout_batch(cluster, "fused")),
        "reward": costs.reward_seconds(share, dev, residency=costs.reward_residency(spec.generators[0]), per_worker=share),
        "recompute": recompute,
        "train": train,
        "optimizer": costs.optimizer_seconds(dev, group) - costs.system.step_fixed_s,
        "step_fixed": costs.system.step_fixed_s,
        "switches": costs.switch_seconds("train", dev, group) + costs.switch_seconds("generate", dev, group),
    }
    return out


# ---------------------------------------------------------------------------- fitting


def _bisect(f: Callable[[float], float], lo: float, hi: float, iters: int = 60) -> float:
    """A root of increasing-or-decreasing ``f`` in [lo, hi] (the nearer end when none)."""
    flo, fhi = f(lo), f(hi)
    if flo == 0:
        return lo
    if flo * fhi > 0:
        return lo if abs(flo) < abs(fhi) else hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        fm = f(mid)
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_rollout(base: Catalog, runs: list[PublishedRun], c: Constants) -> Constants:
    batched, serial = sorted([r for r in runs if r.stage == "rollout"], key=lambda r: -(r.system_changes.get("rollout_batch") or 1e9))

    def m_for(h: float) -> float:  # mfu_forward that reproduces the batched phase at half-tokens h
        return _bisect(lambda m: predict(batched, apply(base, replace(c, mfu_forward=m, mfu_half_tokens=h))) - batched.published_s,
                       0.01, 1.0)

    h = _bisect(lambda h: predict(serial, apply(base, replace(c, mfu_forward=m_for(h), mfu_half_tokens=h))) - serial.published_s,
                0.0, 1e5, iters=40)
    return replace(c, mfu_forward=m_for(h), mfu_half_tokens=h)


def fit_reward(base: Catalog, runs: list[PublishedRun], c: Constants) -> Constants:
    (async_run,) = [r for r in runs if r.stage == "reward"]
    (sync_run,) = [r for r in runs if r.stage == "step" and r.workload == async_run.workload and r.device == async_run.device
                   and r.devices == async_run.devices]
    target = sync_run.published_s - async_run.published_s

    def gap(t: float) -> float:
        cat = apply(base, replace(c, decode_tail_s=t))
        return predict(sync_run, cat) - predict(async_run, cat) - target

    return replace(c, decode_tail_s=_bisect(gap, 0.0, 600.0, iters=30))


def fit_step(base: Catalog, runs: list[PublishedRun], c: Constants) -> tuple[Constants, float]:
    """Least squares on the relative error over ``runs`` (stage ``step``): ``mfu_train`` by a
    bounded search, ``step_fixed_s`` in closed form (a colocated step is lockstep: the per-step
    overhead adds to it one for one). Returns the constants and the RMS relative error."""
    ys = [r.published_s for r in runs]

    def solve(m: float) -> tuple[float, float]:
        cat = apply(base, replace(c, mfu_train=m, step_fixed_s=0.0))
        ps = [predict(r, cat) for r in runs]
        w = [1.0 / y**2 for y in ys]
        f = max(0.0, sum(wi * (y - p) for wi, y, p in zip(w, ys, ps)) / sum(w))
        err = math.sqrt(sum(((p + f - y) / y) ** 2 for p, y in zip(ps, ys)) / len(ys))
        return err, f

    lo, hi = math.log(0.02), math.log(MFU_CAP)
    grid = [math.exp(lo + (hi - lo) * i / 24) for i in range(25)]
    errs = [solve(m)[0] for m in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(25):  # golden section on the bracket
        x1, x2 = b - phi * (b - a), a + phi * (b - a)
        if solve(x1)[0] <= solve(x2)[0]:
            b = x2
        else:
            a = x1
    m = 0.5 * (a + b)
    err, f = solve(m)
    return replace(c, mfu_train=m, step_fixed_s=f), err


@dataclass
class Calibration:
    constants: Constants
    rows: list[dict[str, Any]]  # every run: published, predicted, error
    loo: list[dict[str, Any]]  # step runs: fitted on the others, predicted
    rms: float


def calibrate(runs: list[PublishedRun] | None = None, base: Catalog | None = None) -> Calibration:
    runs = runs if runs is not None else load_runs()
    base = base if base is not None else load_catalog(overrides=False)
    c = Constants.of(base)
    c = fit_rollout(base, runs, c)
    steps = [r for r in runs if r.stage == "step"]
    c, _ = fit_step(base, steps, c)  # a first guess for the stages that follow
    c = fit_reward(base, runs, c)
    c, rms = fit_step(base, steps, c)
    cat = apply(base, c)
    rows = [row(r, predict(r, cat)) for r in runs]
    loo = []
    for left in steps:
        ci, _ = fit_step(base, [r for r in steps if r is not left], c)
        loo.append({**row(left, predict(left, apply(base, ci))), "mfu_train": ci.mfu_train, "step_fixed_s": ci.step_fixed_s})
    return Calibration(c, rows, loo, rms)


def row(run: PublishedRun, predicted: float) -> dict[str, Any]:
    return {"run": run.name, "label": run.label, "stage": run.stage, "measure": run.measure,
            "published_s": run.published_s, "predicted_s": predicted, "error": predicted / run.published_s - 1}


def check(runs: Iterable[PublishedRun] | None = None, catalog: Catalog | None = None) -> list[dict[str, Any]]:
    """The shipped (calibrated) profiles' prediction of every published run."""
    catalog = catalog if catalog is not None else load_catalog()
    return [row(r, predict(r, catalog)) for r in (runs if runs is not None else load_runs())]


# ---------------------------------------------------------------------------- output


def _src(text: str) -> str:
    return f"fitted by `{COMMAND} --write` ({text})"


def calibrated_document(cal: Calibration) -> dict[str, Any]:
    c = cal.constants
    when = datetime.date.today().isoformat()
    rollout = "the generation-phase times of veRL-Omni's rollout-batching doc, batched 107.9 s and serial 226.4 s"
    step = "the step times of veRL-Omni's three published Qwen-Image runs (profiles/published-runs.yaml)"
    devices = {}
    for name in FITTED_DEVICES + APPLIED_DEVICES:
        note = "" if name in FITTED_DEVICES else "; no published run on this device: the Hopper fit applied"
        devices[name] = {
            "mfu_forward": round(c.mfu_forward, 4), "mfu_half_tokens": round(c.mfu_half_tokens, 1), "mfu_train": round(c.mfu_train, 4),
            "sources": {
                "mfu_forward": _src(f"{rollout}{note}"),
                "mfu_half_tokens": _src(f"{rollout}: the serial run's forwards hold one sample{note}"),
                "mfu_train": _src(f"{step}, with the generation fit above{note}"),
            },
        }
    systems = {
        "verl-omni": {"step_fixed_s": round(c.step_fixed_s, 2), "sources": {"step_fixed_s": _src(step)}},
        "verl-digen": {"step_fixed_s": round(c.step_fixed_s, 2), "sources": {"step_fixed_s": _src(
            f"veRL-Omni's value, charged to ours as well: we have no measurement of our own per-step overhead at scale")}},
    }
    rewards = {JUDGE: {"decode_tail_s": round(c.decode_tail_s, 2), "sources": {"decode_tail_s": _src(
        "veRL-Omni's LoRA run with the judge colocated (420 s) and on one extra GPU (360 s)")}}}
    return {"_written": when, "overrides": {"devices": devices, "systems": systems, "rewards": rewards}}


def write_calibrated(cal: Calibration, path: str = CALIBRATED_FILE) -> None:
    import yaml

    doc = calibrated_document(cal)
    when = doc.pop("_written")
    with open(path, "w") as f:
        f.write(f"# Written by `{COMMAND} --write` on {when}; do not edit: rerun it.\n"
                "# The cost model's free constants fitted to veRL-Omni's published runs (published-runs.yaml);\n"
                "# load_catalog() applies these overrides after every other profile.\n")
        yaml.safe_dump(doc, f, sort_keys=False, width=110)


def doc_table(cal: Calibration, catalog: Catalog, runs: list[PublishedRun]) -> list[str]:
    c = cal.constants
    by_name = {r.name: r for r in runs}
    L = [f"Generated by `{COMMAND} --write`; the runs, their settings and sources are in",
         "`verl_digen/sim/profiles/published-runs.yaml`.", "",
         "| run | published time of | fit stage | published s | predicted s | error |", "|---|---|---|---:|---:|---:|"]
    for r in cal.rows:
        what = "generation phase" if r["measure"] == "generate" else "step"
        L.append(f"| {r['label']} | {what} | {r['stage']} | {r['published_s']:g} | {r['predicted_s']:.1f} | {100 * r['error']:+.1f}% |")
    L += ["", f"Fitted constants (RMS relative error of the step fit: {100 * cal.rms:.1f}%):", "",
          "| constant | value | fitted on |", "|---|---:|---|",
          f"| `mfu_forward` (H100, H800, H200) | {c.mfu_forward:.3f} | the two generation phases |",
          f"| `mfu_half_tokens` | {c.mfu_half_tokens:,.0f} tokens | the two generation phases |",
          f"| `mfu_train` | {c.mfu_train:.3f} | the three steps |",
          f"| `step_fixed_s` (veRL-Omni; charged to ours too) | {c.step_fixed_s:.1f} s | the three steps |",
          f"| judge `decode_tail_s` (Qwen3-VL-8B, OCR) | {c.decode_tail_s:.1f} s | colocated vs async reward |",
          "", "Leave-one-out (stage 3 refitted on the other two step runs; the rollout and reward stages",
          "do not use these step times, except that the reward stage uses the LoRA run's difference to",
          "its async variant):", "",
          "| left out | published s | predicted s | error | mfu_train | step_fixed_s |", "|---|---:|---:|---:|---:|---:|"]
    for r in cal.loo:
        L.append(f"| {r['label']} | {r['published_s']:g} | {r['predicted_s']:.1f} | {100 * r['error']:+.1f}% | "
                 f"{r['mfu_train']:.3f} | {r['step_fixed_s']:.1f} |")
    L += ["", "Where one worker's step goes, by term (seconds; the calibrated model):", "",
          "| run | generate | reward | recompute | train | optimizer | per-step fixed | switches (offload, reload, engines) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cal.rows:
        run = by_name[r["run"]]
        if run.measure != "step" or run.reward_devices:
            continue
        b = breakdown(run, catalog)
        L.append(f"| {run.label} | {b['generate']:.1f} | {b['reward']:.1f} | {b['recompute']:.1f} | {b['train']:.1f} | "
                 f"{b['optimizer']:.1f} | {b['step_fixed']:.1f} | {b['switches']:.1f} |")
    return L


def update_doc(lines: list[str], path: str = DOC) -> None:
    with open(path) as f:
        text = f.read()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise ProfileError(f"{path} has no {DOC_BEGIN} ... {DOC_END} block to fill")
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    with open(path, "w") as f:
        f.write(head + DOC_BEGIN + "\n" + "\n".join(lines) + "\n" + DOC_END + tail)


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    print(f"  {'run':<46} {'stage':<8} {'published s':>11} {'predicted s':>11} {'error':>8}")
    for r in rows:
        print(f"  {r['label']:<46} {r['stage']:<8} {r['published_s']:>11g} {r['predicted_s']:>11.1f} {100 * r['error']:>+7.1f}%")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="write profiles/calibrated.yaml and the table in docs/cost_model.md")
    p.add_argument("--check", action="store_true", help="only predict the published runs with the shipped profiles")
    p.add_argument("--doc", default=DOC, help="the markdown file whose calibration block --write fills")
    p.add_argument("--all-params-per-token", action="store_true",
                   help="counterfactual: charge every parameter to every token (2P FLOPs per token, the model before "
                        "issue 12) and show what the fit would need; never written")
    args = p.parse_args(argv)
    if args.all_params_per_token and (args.write or args.check):
        p.error("--all-params-per-token is a counterfactual: it cannot be combined with --write or --check")
    runs = load_runs()
    if args.check:
        rows = check(runs)
        print_rows("shipped calibration (profiles/calibrated.yaml):", rows)
        bad = [r for r in rows if abs(r["error"]) > BAND]
        if bad:
            print(f"outside +-{100 * BAND:.0f}%: {', '.join(r['run'] for r in bad)}", file=sys.stderr)
            return 1
        return 0
    base = load_catalog(overrides=False)
    if args.all_params_per_token:
        base.models = {n: replace(m, token_params=0.0) for n, m in base.models.items()}
        print("counterfactual: 2 x params FLOPs per token (every parameter charged to every token)")
    cal = calibrate(runs, base)
    c = cal.constants
    print_rows("calibrated (fitted constants applied):", cal.rows)
    print(f"fitted: mfu_forward {c.mfu_forward:.3f}, mfu_half_tokens {c.mfu_half_tokens:,.0f}, mfu_train {c.mfu_train:.3f}, "
          f"step_fixed_s {c.step_fixed_s:.1f}, judge decode_tail_s {c.decode_tail_s:.1f} (step RMS {100 * cal.rms:.1f}%)")
    print_rows("leave-one-out (step stage refitted without the run):", cal.loo)
    high = [n for n, v in (("mfu_forward", c.mfu_forward), ("mfu_train", c.mfu_train)) if v > MFU_CAP + 1e-6]
    if high:
        print(f"warning: {', '.join(high)} above the physical cap {MFU_CAP}: a FLOP count is likely wrong", file=sys.stderr)
    if args.write:
        write_calibrated(cal)
        catalog = load_catalog()
        update_doc(doc_table(cal, catalog, runs), args.doc)
        print(f"wrote {CALIBRATED_FILE} and the calibration block of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
