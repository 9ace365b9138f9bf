"""Paper-scale benchmark, simulated with the calibrated cost model: the four paper models at 16 and 32 H800.

For every model and cluster size, on the same workload and devices:

- **veRL-Omni** (the ``verl-omni`` system profile, calibrated on its published runs by
  ``python -m verl_digen.sim.calibrate``): its colocated FlowGRPO step;
- **ours, colocated** (``verl-digen``): the best colocated configuration;
- **ours, best disaggregated**: the best configuration the planner finds over every
  disaggregated mechanism set (GAP, TSP, TAG, TCSS, FSDP in lockstep) and pool split;

with images/s, seconds per step, the fraction of the zero-bubble bound, the bubble fraction,
the cost per 1,000 images and the speedups. Then:

- **the ladder** of our mechanisms (colocated, disaggregated, +GAP, +TSP, +TAG, +TCSS, +FSDP);
- **where disaggregation wins**: the workload veRL-Omni itself published (Qwen-Image OCR with a
  Qwen3-VL-8B judge) at 4-16 H800, and heterogeneous pools (cheaper inference GPUs for rollout);
- **sensitivity**: each constant halved and doubled, the best disaggregated configuration's
  speedup over our colocated one recomputed;
- **emulated runtime** (``--emulate``): the best colocated and +TCSS plans of FLUX at 16 and 32
  devices run on the real Ray executor with emulated devices; the gap to the simulator on the
  same plan is the runtime's own overhead;
- **tiny model** (``--tiny``): ``python -m verl_digen.profile --check``.

Writes ``docs/benchmarks_sim.md``::

    python benchmarks/paper_scale.py                 # everything but --emulate / --tiny (~15 minutes on 2 cores)
    python benchmarks/paper_scale.py --quick         # the tables, no sensitivity
    python benchmarks/paper_scale.py --emulate --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Any

from verl_digen.sim.calibrate import load_runs
from verl_digen.sim.cost_model import CostModel, ProfileError, load_catalog
from verl_digen.sim.planner import MECHANISMS, Evaluation, Inventory, search

MODELS = ("hunyuanvideo-13b", "wan2.1-14b", "flux-12b", "qwen-image-20b")
OMNI, OURS = "verl-omni", "verl-digen"
COLOCATED = [m for m in MECHANISMS if MECHANISMS[m]["placement"] == "colocated"]  # with and without FSDP
DISAGGREGATED = [m for m in MECHANISMS if m not in COLOCATED]
LADDER = (
    ("colocated", COLOCATED),
    ("disaggregated", ["disaggregated"]),
    ("+GAP", ["disaggregated+gap"]),
    ("+TSP", ["disaggregated+gap+tsp"]),
    ("+TAG", ["disaggregated+gap+tag"]),
    ("+TCSS", ["disaggregated+gap+tcss"]),
    ("+FSDP lockstep", ["disaggregated+gap+fsdp", "disaggregated+gap+fsdp+tcss"]),
    ("+TAG on FSDP", ["disaggregated+gap+tag+fsdp", "disaggregated+gap+tag+fsdp+tcss"]),
)
MIXES = ({"H800": 8, "L40S": 16}, {"H800": 16, "L40S": 16})
JUDGE_SIZES = (4, 8, 16, 32)
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks_sim.md")


# Settings a run of the model needs to fit, applied to every system and configuration alike.
# Qwen-Image at 1328 x 1328 decodes a generate call's 12 samples in one VAE call by default
# (digen.model.vae_decode_chunk=0: 64.6 GiB of activations), which no disaggregated rollout
# worker's 80 GiB holds beside the transformer; one sample per decode call fits, and costs the same
# time in this model (the memory planner's knob, docs/cost_model.md "Memory").
MODEL_WORKLOAD: dict[str, dict[str, Any]] = {"qwen-image-20b": {"vae_decode_chunk": 1}}


def costs_of(catalog: Any, model: str, devices: list[str], system: str, **workload: Any) -> CostModel:
    return CostModel.from_catalog(catalog, model, devices=devices, system=system,
                                  **{**MODEL_WORKLOAD.get(model, {}), **workload})


def summary(ev: Evaluation | None, costs: CostModel) -> dict[str, Any] | None:
    if ev is None or not ev.feasible:
        return None
    r, spec = ev.result, ev.candidate.spec
    row = ev.row(None, costs)
    busy = 1 - r.bubble_fraction
    split = "-" if spec.placement == "colocated" else "+".join(
        f"{p.size}{'x' + p.device if len({q.device for q in ev.candidate.pools.values()}) > 1 else ''}"
        for p in (ev.candidate.pools["rollout"], ev.candidate.pools["trainer"]))
    if spec.reward_workers:
        split += f" (+{spec.reward_workers} reward)"
    return {
        "strategy": spec.name,
        "split": split,
        "reward_devices": spec.reward_workers,
        "micro": f"{spec.groups_per_task}/{spec.train_micro_batch_groups}",
        "images_per_s": r.images_per_s,
        "step_s": r.step_time_s,
        "fraction_of_bound": r.fraction_of_bound,
        "bubble": r.bubble_fraction,
        # busy device time beyond the bound's ideal work: efficiency, collectives, switches, syncs, fixed costs
        "overhead": 1 - r.fraction_of_bound / busy if busy > 0 else 0.0,
        "usd_per_1000_images": row["usd_per_1000_images"],
    }


def best(costs: CostModel, inventory: Inventory, mechanisms: list[str], *, micro=(1, 2), steps=5, warmup=2,
         reward_devices: list[int] | None = None) -> Evaluation | None:
    """The best configuration; ``reward_devices`` as the planner's (None: its default sizes).
    Two warm-up steps, as the planner's default: TAG under TCSS fills its pipeline in two."""
    try:
        result = search(costs, inventory, mechanisms=mechanisms, micro_batches=micro, steps=steps, warmup=warmup,
                        reward_devices=reward_devices)
    except ProfileError:
        return None
    return result.best if result.evaluated else None


def compare(catalog: Any, model: str, inventory: Inventory, workload: dict[str, Any] | None = None) -> dict[str, Any]:
    """veRL-Omni colocated vs ours colocated vs ours best disaggregated on one cluster."""
    workload = workload or {}
    types = list(inventory.devices)
    out: dict[str, Any] = {"model": model, "devices": inventory.total, "inventory": dict(inventory.devices)}
    if len(types) == 1:
        omni_costs = costs_of(catalog, model, types, OMNI, **workload)
        out["omni"] = summary(best(omni_costs, inventory, ["colocated"]), omni_costs)  # its FSDP engine always shards
    ours = costs_of(catalog, model, types, OURS, **workload)
    if len(types) == 1:
        out["colocated"] = summary(best(ours, inventory, COLOCATED), ours)
    ev = best(ours, inventory, DISAGGREGATED)
    out["disaggregated"] = summary(ev, ours)
    out["bound"] = ev.result.bound_images_per_s if ev else None
    return out


def ladder(catalog: Any, model: str, inventory: Inventory) -> list[dict[str, Any]]:
    ours = costs_of(catalog, model, list(inventory.devices), OURS)
    rows = []
    for label, mechs in LADDER:
        s = summary(best(ours, inventory, mechs, reward_devices=[0]), ours)  # the mechanisms alone
        rows.append({"row": label, **s} if s else {"row": label, "note": "does not fit in memory"})
    return rows


# ---------------------------------------------------------------------------- sensitivity

# (label, where, field, low factor, high factor, upper clamp)
CONSTANTS = (
    ("mfu_forward", "device", "mfu_forward", 0.5, 1.5, 0.6),
    ("mfu_train", "device", "mfu_train", 0.5, 2.0, 0.6),
    ("mfu_half_tokens", "device", "mfu_half_tokens", 0.5, 2.0, None),
    ("inter_node_gbps", "device", "inter_node_gbps", 0.5, 2.0, None),
    ("intra_node_gbps", "device", "intra_node_gbps", 0.5, 2.0, None),
    ("host_link_gbps", "device", "host_link_gbps", 0.5, 2.0, None),
    ("nccl_efficiency", "system", "nccl_efficiency", 0.5, 1.25, 1.0),
    ("comm_overlap", "system", "comm_overlap", 0.0, 2.0, 1.0),
    ("activation_bytes", "system", "activation_bytes", 0.5, 2.0, None),
    ("collective_step_latency_s", "system", "collective_step_latency_s", 0.5, 2.0, None),
    ("switch_fixed_s", "system", "switch_fixed_s", 0.5, 2.0, None),
    ("step_fixed_s", "system", "step_fixed_s", 0.5, 2.0, None),
    ("sync_fixed_s", "system", "sync_fixed_s", 0.5, 2.0, None),
    ("optimizer_fixed_s", "system", "optimizer_fixed_s", 0.5, 2.0, None),
)


def scaled(costs: CostModel, where: str, field: str, factor: float, clamp: float | None) -> CostModel:
    def value(v: float) -> float:
        x = v * factor
        return min(x, clamp) if clamp is not None else x

    if where == "device":
        devs = {n: dataclasses.replace(d, **{field: value(getattr(d, field))}) for n, d in costs.devices.items()}
        return dataclasses.replace(costs, devices=devs)
    return dataclasses.replace(costs, system=dataclasses.replace(costs.system, **{field: value(getattr(costs.system, field))}))


def disagg_speedup(costs: CostModel, inventory: Inventory) -> float:
    col = best(costs, inventory, COLOCATED, micro=(1, 2), reward_devices=[0])
    dis = best(costs, inventory, ["disaggregated+gap+tcss", "disaggregated+gap+fsdp+tcss"], micro=(1, 2), reward_devices=[0])
    return dis.images_per_s / col.images_per_s if col and dis else math.nan


def sensitivity(catalog: Any, cases: list[tuple[str, int]], device_type: str) -> list[dict[str, Any]]:
    rows = []
    for model, devices in cases:
        inv = Inventory({device_type: devices})
        base_costs = costs_of(catalog, model, [device_type], OURS)
        base = disagg_speedup(base_costs, inv)
        for label, where, field, lo, hi, clamp in CONSTANTS:
            low = disagg_speedup(scaled(base_costs, where, field, lo, clamp), inv)
            high = disagg_speedup(scaled(base_costs, where, field, hi, clamp), inv)
            # nan when no disaggregated configuration fits at the base or either end
            swing = max((abs(math.log(x / base)) for x in (low, high) if x == x and x > 0 and base == base),
                        default=math.nan)
            rows.append({"case": f"{model} @ {devices}", "constant": label, "base": base, "low": low, "high": high,
                         "lo_factor": lo, "hi_factor": hi, "swing": swing})
        print(f"  sensitivity {model} @ {devices} done", flush=True)
    return rows


# ---------------------------------------------------------------------------- calibration basis

# (label, call-size curve, training efficiency, our step_fixed_s, our train_efficiency): every
# measured-vs-fitted choice of the basis, one at a time, then the earlier basis whole. "fitted"
# curve / training: fitted to veRL-Omni's generation phases / whole steps, applied to every
# system alike; "borrowed": our step_fixed_s set to veRL-Omni's fitted one.
BASES = (
    ("shipped: measured curve, measured training, our measured per-step cost", "measured", "measured", "measured", 1.0),
    ("fitted curve (veRL-Omni's generation phases)", "fitted", "measured", "measured", 1.0),
    ("fitted training efficiency (veRL-Omni's steps)", "measured", "fitted", "measured", 1.0),
    ("both fitted", "fitted", "fitted", "measured", 1.0),
    ("our per-step cost borrowed from veRL-Omni", "measured", "measured", "borrowed", 1.0),
    ("the earlier basis: both fitted, ours at 1.99x training, veRL-Omni's per-step cost charged to ours",
     "fitted", "fitted", "borrowed", 1.99),
)
BASIS_CASES = (("flux-12b", 32), ("qwen-image-20b", 32))


def basis_catalog(curve: str, train: str, ours_fixed: str, ours_train: float) -> tuple[Any, Any]:
    """The catalog of one calibration basis and its calibration (veRL-Omni's terms refitted on it)."""
    from verl_digen.sim.calibrate import apply, calibrate

    base = load_catalog(overrides=False)
    cal = calibrate(base=base, curve=curve, train=train)
    cat = apply(base, cal.constants)
    ours = cat.systems[OURS]
    fixed = cal.constants.step_fixed_s if ours_fixed == "borrowed" else ours.step_fixed_s
    cat.systems = {**cat.systems, OURS: dataclasses.replace(ours, step_fixed_s=fixed, train_efficiency=ours_train)}
    return cat, cal


def basis_sensitivity(device_type: str, cases=BASIS_CASES) -> list[dict[str, Any]]:
    """Every headline figure of ``cases`` under each basis of BASES, with that basis's calibration
    errors (step RMS, worst leave-one-out)."""
    return [basis_row(i, device_type, cases) for i in range(len(BASES))]


def basis_row(i: int, device_type: str, cases=BASIS_CASES) -> dict[str, Any]:
    """The headline figures of ``cases`` under basis ``BASES[i]``."""
    for label, curve, train, ours_fixed, ours_train in BASES[i:i + 1]:
        cat, cal = basis_catalog(curve, train, ours_fixed, ours_train)
        row = {"basis": label, "rms": cal.rms, "loo": max(abs(r["error"]) for r in cal.loo),
               "omni_fixed": cal.constants.step_fixed_s, "ours_fixed": cat.systems[OURS].step_fixed_s,
               "mfu_train": cal.constants.mfu_train, "half_tokens": cal.constants.mfu_half_tokens, "cases": {}}
        for model, n in cases:
            c = compare(cat, model, Inventory({device_type: n}))
            row["cases"][f"{model} @ {n}"] = {"coloc_vs_omni": ratio(c["colocated"], c["omni"]),
                                              "disagg_vs_coloc": ratio(c["disaggregated"], c["colocated"]),
                                              "disagg_vs_omni": ratio(c["disaggregated"], c["omni"])}
        print(f"  basis {label}: " + ", ".join(f"{k}: coloc/omni {fmt(v['coloc_vs_omni'], '.2f')}x, disagg/coloc "
                                               f"{fmt(v['disagg_vs_coloc'], '.2f')}x" for k, v in row["cases"].items()), flush=True)
        return row


def basis_md(rows: list[dict[str, Any]]) -> list[str]:
    cases = list(rows[0]["cases"]) if rows else []
    head = "| basis | veRL-Omni step RMS, worst leave-one-out | mfu_train, half-point | per-step s (veRL-Omni, ours) | " + " | ".join(
        f"{c}: coloc. / veRL-Omni, disagg. / coloc." for c in cases) + " |"
    L = [head, "|---|---:|---:|---:|" + "---:|" * len(cases)]
    for r in rows:
        L.append(f"| {r['basis']} | {100 * r['rms']:.1f}%, {100 * r['loo']:.1f}% | {r['mfu_train']:.3f}, {r['half_tokens']:,.0f} | "
                 f"{r['omni_fixed']:.1f}, {r['ours_fixed']:.2f} | "
                 + " | ".join(f"{fmt(v['coloc_vs_omni'], '.2f')}x, {fmt(v['disagg_vs_coloc'], '.2f')}x" for v in r["cases"].values()) + " |")
    return L


# ---------------------------------------------------------------------------- emulation


def emulate(
    catalog: Any, device_type: str, cases: list[tuple[str, int]], steps: int = 3, generate_ms: float = 200.0
) -> list[dict[str, Any]]:
    import ray

    from verl_digen.emulate import run_emulated_plan
    from verl_digen.schedule.strategies import StepPlanner
    from verl_digen.sim.simulator import simulate_plan

    out = []
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for model, devices in cases:
            costs = costs_of(catalog, model, [device_type], OURS)
            for mechs in (COLOCATED, ["disaggregated+gap+tcss", "disaggregated+gap+fsdp+tcss"]):
                ev = search(costs, Inventory({device_type: devices}), mechanisms=mechs, micro_batches=(1,), steps=4).best
                spec, cluster = ev.candidate.spec, ev.candidate.cluster
                costs_s = costs.for_spec(spec)  # the strategy's calls and sharding, as search costed it
                planner = StepPlanner(spec)
                for s in range(steps):
                    planner.plan_step(s, has_next=s + 1 < steps)
                sim = simulate_plan(planner.plan, costs_s, cluster)
                sim_opt = max(r.end for r in sim.timeline.records if r.kind == "optimizer_step")
                gens = [r.end - r.start for r in sim.timeline.records if r.kind == "generate"]
                scale = generate_ms / 1000 / statistics.mean(gens)  # the mean generate task sleeps this long
                run = run_emulated_plan(planner.plan, costs_s, cluster, group_size=spec.group_size, time_scale=scale, timeout_s=300)
                emu_opt = run.opt_end[max(run.opt_end)]
                n = len(planner.plan.tasks)
                out.append({
                    "case": f"{model} @ {devices}", "strategy": spec.name, "tasks": n, "time_scale": scale,
                    "simulated_s": sim_opt * scale, "emulated_s": emu_opt * scale, "gap": emu_opt / sim_opt - 1,
                    "overhead_ms_per_task": 1000 * (emu_opt - sim_opt) * scale / n,
                })
                print(f"  emulated {out[-1]['case']} {spec.name}: {out[-1]['emulated_s']:.2f}s vs simulated "
                      f"{out[-1]['simulated_s']:.2f}s ({100 * out[-1]['gap']:+.1f}%)", flush=True)
    finally:
        ray.shutdown()
    return out


def tiny_check() -> list[dict[str, Any]]:
    """``python -m verl_digen.profile --check``: the tiny model's tasks measured alone and by
    two processes at once, three real runs, their prediction and the schedule-only replay."""
    import platform

    from verl_digen.profile import check_against_real_runs, measure_tiny, profile_document, write_profile

    device = f"cpu-{platform.node() or 'local'}"
    raw = measure_tiny([], threads=1, repeats=5)
    contended = measure_tiny([], threads=1, repeats=5, concurrency=2, links=False)
    paths = {"simulated": "/tmp/verl_digen_tiny_profile.yaml", "no_contention": "/tmp/verl_digen_tiny_profile.isolated.yaml"}
    write_profile(profile_document(raw, "tiny-flux", device, contended), paths["simulated"])
    write_profile(profile_document(raw, "tiny-flux", device), paths["no_contention"])
    return check_against_real_runs(paths, "tiny-flux", device, [], steps=6)


# ---------------------------------------------------------------------------- output


def fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def ratio(a: dict | None, b: dict | None) -> float | None:
    return a["images_per_s"] / b["images_per_s"] if a and b else None


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def headline_md(cases: list[dict[str, Any]]) -> list[str]:
    L = ["| model | H800 | veRL-Omni img/s (% bound) | ours colocated img/s (% bound) | ours best disaggregated | img/s (% bound, bubble) "
         "| disagg. vs veRL-Omni | disagg. vs ours coloc. | ours coloc. vs veRL-Omni | $ / 1k images (veRL-Omni, coloc., disagg.) |",
         "|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for c in cases:
        o, col, d = c["omni"], c["colocated"], c["disaggregated"]
        L.append(
            f"| {c['model']} | {c['devices']} | {fmt(o and o['images_per_s'], '.4g')} ({pct(o and o['fraction_of_bound'])}) | "
            f"{fmt(col and col['images_per_s'], '.4g')} ({pct(col and col['fraction_of_bound'])}) | "
            f"{d['strategy'] if d else '-'} {d['split'] if d else ''} | "
            f"{fmt(d and d['images_per_s'], '.4g')} ({pct(d and d['fraction_of_bound'])}, {fmt(d and d['bubble'], '.2f')}) | "
            f"{fmt(ratio(d, o), '.2f')}x | {fmt(ratio(d, col), '.2f')}x | {fmt(ratio(col, o), '.2f')}x | "
            f"{fmt(o and o['usd_per_1000_images'], '.2f')}, {fmt(col and col['usd_per_1000_images'], '.2f')}, "
            f"{fmt(d and d['usd_per_1000_images'], '.2f')} |")
    return L


def ladder_md(ladders: dict[tuple[str, int], list[dict]]) -> list[str]:
    L = ["| model | H800 | row | best configuration | split (R+T) | g/task, g/mb | images/s | step s | % of bound | bubble |",
         "|---|---:|---|---|---|---|---:|---:|---:|---:|"]
    for (model, n), rows in ladders.items():
        for r in rows:
            if "note" in r:
                L.append(f"| {model} | {n} | {r['row']} | {r['note']} | | | | | | |")
                continue
            L.append(f"| {model} | {n} | {r['row']} | {r['strategy']} | {r['split']} | {r['micro']} | {r['images_per_s']:.4g} | "
                     f"{r['step_s']:.1f} | {100 * r['fraction_of_bound']:.1f}% | {r['bubble']:.3f} |")
    return L


def deciding_term(c: dict[str, Any]) -> str:
    col, d, o = c["colocated"], c["disaggregated"], c["omni"]
    if not (col and d):
        return "-"
    if d["images_per_s"] >= col["images_per_s"]:
        return "disaggregation wins"
    return (f"idle time: the disaggregated pools sit idle {100 * d['bubble']:.0f}% of the time (and spend "
            f"{100 * d['overhead']:.0f}% of their busy time beyond the bound's work), while our colocated workers never idle "
            f"and spend {100 * col['overhead']:.0f}% beyond it (veRL-Omni: {100 * o['overhead']:.0f}%)" if o else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device-type", default="H800")
    p.add_argument("--devices", default="16,32")
    p.add_argument("--quick", action="store_true", help="the tables only (no sensitivity)")
    p.add_argument("--emulate", action="store_true", help="also run the emulated runtime against the simulator")
    p.add_argument("--emulate-ms", type=float, default=200.0, help="real milliseconds of the mean emulated generate task")
    p.add_argument("--tiny", action="store_true", help="also run the tiny-model prediction check (real runs)")
    p.add_argument("--no-basis", action="store_true", help="leave out the table of every measured-vs-fitted basis")
    p.add_argument("--jobs", type=int, default=1, help="processes for the independent searches (the results are the same)")
    p.add_argument("--out", default=DOC)
    args = p.parse_args(argv)

    t0 = time.time()
    catalog = load_catalog()
    sizes = [int(x) for x in args.devices.split(",")]
    judge_run = next(r for r in load_runs() if r.name == "lora-4xH800")
    # every independent search as a job: --jobs N runs them in N processes (the results are the same)
    jobs: dict[Any, tuple] = {}
    for model in MODELS:
        for n in sizes:
            jobs[("case", model, n)] = (_case, catalog, model, args.device_type, n)
    for n in JUDGE_SIZES:
        jobs[("judge", n)] = (compare, catalog, judge_run.model, Inventory({"H800": n}), judge_run.workload)
    for model in MODELS:
        if 16 not in sizes:
            jobs[("case", model, 16)] = (_case, catalog, model, args.device_type, 16)
        for k, mix in enumerate(MIXES):
            jobs[("hetero", model, k)] = (compare, catalog, model, Inventory(dict(mix)))
    if not args.no_basis:
        for i in range(len(BASES)):
            jobs[("basis", i)] = (basis_row, i, args.device_type)
    done = _run_jobs(jobs, args.jobs)
    cases, ladders = [], {}
    for model in MODELS:
        for n in sizes:
            c, ladders[(model, n)] = done[("case", model, n)]
            cases.append(c)
            print(f"{model} @ {n}: veRL-Omni {fmt(c['omni'] and c['omni']['images_per_s'], '.4g')}, colocated "
                  f"{fmt(c['colocated'] and c['colocated']['images_per_s'], '.4g')}, disaggregated "
                  f"{fmt(c['disaggregated'] and c['disaggregated']['images_per_s'], '.4g')} "
                  f"({c['disaggregated']['strategy'] if c['disaggregated'] else '-'})", flush=True)
    judge = [done[("judge", n)] for n in JUDGE_SIZES]
    print("judge workload: " + ", ".join(f"{c['devices']}: {fmt(ratio(c['disaggregated'], c['omni']), '.2f')}x" for c in judge), flush=True)
    hetero = []
    for model in MODELS:
        base = done[("case", model, 16)][0]  # veRL-Omni on 16 of the cluster's device type
        for k in range(len(MIXES)):
            h = done[("hetero", model, k)]
            h["omni16"] = base["omni"]
            hetero.append(h)
    basis = [] if args.no_basis else [done[("basis", i)] for i in range(len(BASES))]
    sens = [] if args.quick else sensitivity(catalog, [(m, max(sizes)) for m in MODELS], args.device_type)
    emu = emulate(catalog, args.device_type, [("flux-12b", d) for d in sizes], generate_ms=args.emulate_ms) if args.emulate else []
    tiny = tiny_check() if args.tiny else []

    md = write_doc(args, catalog, cases, ladders, judge, hetero, sens, emu, tiny, time.time() - t0, basis)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(md)
    print("\n".join(headline_md(cases)))
    if basis:
        print("\n".join(basis_md(basis)))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


def _case(catalog: Any, model: str, device_type: str, n: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    inv = Inventory({device_type: n})
    return compare(catalog, model, inv), ladder(catalog, model, inv)


def _call(job: tuple) -> Any:
    fn, *a = job
    return fn(*a)


def _run_jobs(jobs: dict[Any, tuple], n: int) -> dict[Any, Any]:
    """Each job's result, by key; ``n`` > 1: in that many processes (each search is deterministic)."""
    if n <= 1:
        return {k: _call(j) for k, j in jobs.items()}
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=n) as ex:
        futures = {k: ex.submit(_call, j) for k, j in jobs.items()}
        out = {}
        for k, f in futures.items():
            out[k] = f.result()
            print(f"  done {k}", flush=True)
        return out


def _commit() -> str:
    """The checkout's commit (``+local changes`` when the package differs from it), for the doc's header."""
    import subprocess

    root = os.path.dirname(DOC)
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", "../verl_digen"],
                               capture_output=True, text=True).stdout.strip()
        return head + (" + local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_doc(args, catalog, cases, ladders, judge, hetero, sens, emu, tiny, elapsed, basis=()) -> str:
    from verl_digen.sim.calibrate import check

    from verl_digen.sim.calibrate import calibrate

    cal = calibrate()  # the shipped basis: veRL-Omni's terms as calibrated.yaml holds them
    band = max(abs(r["error"]) for r in check(catalog=catalog))
    loo = max(abs(r["error"]) for r in cal.loo)
    dev = catalog.devices[args.device_type]
    omni = catalog.systems[OMNI]
    ours = catalog.systems[OURS]
    L = [
        "# Paper-scale benchmark (simulated)",
        "",
        f"Generated by `python benchmarks/paper_scale.py` in {elapsed:.0f} s{' (--emulate)' if emu else ''}, at commit {_commit()}. Every number below is a",
        "simulation: the plans `StepPlanner` builds, executed in virtual time with the cost model of",
        "[cost_model.md](cost_model.md). Its kernel efficiencies (forward, training pass, decode, encode)",
        "are the device's, measured on our GPU checks and shared by every system; what differs between",
        "the systems is structural and modelled per system; veRL-Omni's own per-step and engine terms are",
        f"fitted to its published runs (`python -m verl_digen.sim.calibrate`: each within +-{100 * band:.1f}%, step",
        f"RMS {100 * cal.rms:.1f}%, leave-one-out errors up to {100 * loo:.1f}%: the calibration section there). A ratio",
        "against veRL-Omni is only as good as that out-of-sample error; the calibration basis section below",
        "says how each headline figure moves with every measured-vs-fitted choice.",
        "",
        f"Cluster: {args.device_type} ({dev.peak_tflops:g} TFLOP/s bf16 dense; measured efficiency {dev.mfu_forward:.2f} forward and "
        f"{dev.mfu_train:.2f} training at large forwards, half of it at {dev.mfu_half_tokens:,.0f} tokens per forward; "
        f"NVLink {dev.intra_node_gbps:g} GB/s, {dev.devices_per_node} x {dev.inter_node_gbps:g} GB/s NICs per node, "
        f"${dev.usd_per_hour:.2f} per device-hour), full fine-tuning with FSDP over the training ranks, the workloads below.",
        "",
        "Systems, on the same workload and devices (profiles in `verl_digen/sim/profiles/systems.yaml`):",
        "",
        f"- **veRL-Omni**: its colocated FlowGRPO step as its Qwen-Image examples run it: recomputes the old",
        f"  log-probs, offloads parameters ({omni.param_offload_roundtrips} round trips) and optimizer state, re-exports fp32-gathered",
        f"  weights into its vLLM-Omni rollout engine ({omni.engine_call_s:.3f} s per engine call, fitted), wakes and sleeps its",
        f"  reward model every step ({omni.engine_wake_s:g} s each way), {omni.step_fixed_s:.1f} s of fitted per-step overhead;",
        "- **ours, colocated**: fused workers, behaviour log-probs recorded at rollout (no recompute), optimizer",
        f"  state parked while generating, our measured per-step overhead ({ours.step_fixed_s:.2f} s: `python benchmarks/step_overhead.py`)",
        f"  and sampler cost per denoising step ({ours.denoise_step_s:.3f} s, measured on the GPU checks);",
        "- **ours, best disaggregated**: the best of every disaggregated configuration the planner knows",
        "  (every pool split, pools sharing nodes, GAP, TSP, TAG, TCSS, FSDP in lockstep, 1 or 2 groups per call",
        "  and, under FSDP, the smallest micro-batch of every transformer-call size the ranks allow, as for colocated,",
        "  a reward pool of its own for a reward model: none, or 1, 2, 4, ... devices up to a quarter of the cluster);",
        "  veRL-Omni may give its reward model a pool as its async-reward recipe does. The mechanism ladder",
        "  below places no reward pool, to show the mechanisms alone.",
        "",
        "% of bound is images/s over the zero-bubble bound (devices / device-seconds of generation + reward",
        "+ training per image at the best efficiency, no overheads); bubble is the idle fraction of device",
        "time. Steady state: 4 steps simulated, the first excluded. $ / 1k images uses the device price",
        "table of cost_model.md.",
        "",
        "## Workloads",
        "",
        "| model | tokens/sample | TFLOP/forward (1 branch) | CFG | steps | trained steps | images/step | ckpt | reward |",
        "|---|---:|---:|---|---:|---:|---:|---|---|",
    ]
    for model in MODELS:
        c = costs_of(catalog, model, [args.device_type], OURS)
        w = c.workload
        frames = f", {w.frames} frames" if c.model.video else ""
        L.append(f"| {model} ({w.height}x{w.width}{frames}) | {c.tokens()[1]:,} | {c.forward_flops() / 1e12:.0f} | "
                 f"{'true' if w.cfg else 'distilled'} | {w.num_steps} | {w.trained_steps} | "
                 f"{w.images_per_step} ({w.groups_per_step}x{w.group_size}) | {dict([(True, 'yes'), (False, 'no')]).get(c.gradient_checkpointing, 'when a pass needs it')} | "
                 f"{c.reward.name if c.reward else '-'} |")
    for model, settings in MODEL_WORKLOAD.items():
        if model in MODELS:
            L += ["", f"{model} runs with {', '.join(f'`{k}={v}`' for k, v in settings.items())} on every side "
                      "(`MODEL_WORKLOAD` in `benchmarks/paper_scale.py`): the default decodes a generate call's "
                      "samples in one VAE call, which a disaggregated rollout worker does not hold; the same time "
                      "in this model."]
    L += ["", "## Headline: veRL-Omni vs ours", ""]
    L += headline_md(cases)
    if basis:
        L += ["", "## Calibration basis: each headline figure under every measured-vs-fitted choice", "",
              "One rule for single-device measurements: the call-size curve (FLUX.1 forwards of 1 to 24 rows on an",
              "H200) and the training efficiency (training passes on an H100 and an H200) are adopted together, as",
              "every system's kernel efficiencies. Each row below changes one choice (or, last, restores the earlier",
              "basis whole), refits veRL-Omni's own terms on it (`python -m verl_digen.sim.calibrate --curve fitted",
              "--train fitted` prints the same fits) and recomputes the headline at the largest cluster. A fitted",
              "curve or training efficiency is fitted to veRL-Omni's runs and applied to every system alike.", ""]
        L += basis_md(list(basis))
    L += ["", "Deciding term, per case (the bound's work is each image's FLOPs at the best efficiency; beyond it: small",
          "forwards and passes, exposed collectives, switches, syncs, recomputation, per-step costs):", ""]
    for c in cases:
        L.append(f"- {c['model']} @ {c['devices']}: {deciding_term(c)}")
    L += ["", "## Our mechanisms, rung by rung", "",
          "Each row is the best configuration within that rung (rungs are cumulative: +TCSS is disaggregated +",
          "GAP + TCSS; +FSDP lockstep runs every micro-batch on all trainer ranks at once, with or without TCSS;",
          "+TAG on FSDP adds TAG to that, with the rollout generating in TAG's sample slices).", ""]
    L += ladder_md(ladders)
    L += ["", "## Where disaggregation wins", "",
          "### A reward that takes time: veRL-Omni's own OCR recipe", "",
          "The workload of veRL-Omni's published LoRA run (Qwen-Image, 512^2, 10 steps, true CFG, LoRA r64,",
          "32 x 16 images, two PPO mini-batches, a Qwen3-VL-8B judge whose answer decoding keeps a call open for",
          "a fitted ~70 s), on 4 to 32 H800. A colocated step waits for the judge on every device; a disaggregated",
          "pipeline scores each group while the trainers train. Both systems may give the judge devices of its own",
          "(`--reward-devices`: none, or 1, 2, 4, ... up to a quarter of the cluster): veRL-Omni as its async-reward",
          "recipe does (colocated actor and rollout, samples streamed to the judge), ours beside the rollout and",
          "trainer pools; the split column says how many (\"+k reward\").", ""]
    L += headline_md(judge)
    L += ["", "### Heterogeneous pools: cheaper inference GPUs for rollout", "",
          "Rollout on L40S (362 TFLOP/s, $0.90/h), training on H800 ($3.00/h); the planner tries both",
          "assignments. Compared with veRL-Omni on 16 H800, by throughput and by cost per 1,000 images.", "",
          "| model | cluster | ours best disaggregated | img/s (% bound) | vs veRL-Omni on 16 H800 | $ / 1k images | vs veRL-Omni's $ / 1k |",
          "|---|---|---|---:|---:|---:|---:|"]
    for h in hetero:
        d, o = h["disaggregated"], h["omni16"]
        mix = " + ".join(f"{n} {t}" for t, n in h["inventory"].items())
        if d is None:
            L.append(f"| {h['model']} | {mix} | does not fit | | | | |")
            continue
        L.append(f"| {h['model']} | {mix} | {d['strategy']} {d['split']} | {d['images_per_s']:.4g} ({pct(d['fraction_of_bound'])}) | "
                 f"{fmt(ratio(d, o), '.2f')}x | {fmt(d['usd_per_1000_images'], '.2f')} | "
                 f"{fmt(d['usd_per_1000_images'] / o['usd_per_1000_images'] if o else None, '.2f')}x |")
    if sens:
        L += ["", "## Sensitivity", "",
              "Speedup of the best disaggregated configuration (GAP + TCSS, sample or lockstep FSDP) over our best",
              "colocated one at the largest cluster, with one constant scaled (efficiencies clamped at 0.6).",
              "Sorted by the largest relative move; moves under 1% omitted.", "",
              "| case | constant | x low | x high | speedup (base) | speedup at low | speedup at high |",
              "|---|---|---:|---:|---:|---:|---:|"]
        for r in sorted(sens, key=lambda r: -r["swing"]):
            if r["swing"] < 0.01:
                continue
            L.append(f"| {r['case']} | {r['constant']} | {r['lo_factor']:g} | {r['hi_factor']:g} | {r['base']:.2f}x | "
                     f"{fmt(r['low'], '.2f')}x | {fmt(r['high'], '.2f')}x |")
        moved = {r["constant"] for r in sens if r["swing"] >= 0.01}
        flat = sorted({r["constant"] for r in sens} - moved)
        L += ["", f"Moves every case by less than 1%: {', '.join(flat) or 'none'}."]
    if emu:
        L += ["", "## Emulated runtime vs simulator", "",
              "The real `RayPlanExecutor` drives emulated devices (Ray actors that sleep for the cost",
              f"model's task time, scaled so the mean generate task takes {args.emulate_ms:g} ms) through the same plan",
              "(3 steps) the simulator runs. The gap is the runtime's own overhead (dispatch, `ray.wait`,",
              "object refs, the driver's advantages) on this 2-core machine, shared with other jobs.", "",
              "| case | strategy | tasks | simulated s | emulated s | gap | overhead per task |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in emu:
            L.append(f"| {r['case']} | {r['strategy']} | {r['tasks']} | {r['simulated_s']:.2f} | {r['emulated_s']:.2f} | "
                     f"{100 * r['gap']:+.1f}% | {r['overhead_ms_per_task']:.2f} ms |")
    if tiny:
        L += ["", "## Tiny model: profile measured here vs real runs", "",
              "`python -m verl_digen.profile --out FILE --check`: the tiny FLUX model's tasks timed",
              "in-process on this machine predict the real training loop's steady-state step time.", "",
              "| run | real step s | simulated | no contention | replayed | load avg |", "|---|---:|---:|---:|---:|---:|"]
        for r in tiny:
            L.append(f"| {r['run']} | {r['real_step_s']:.3f} | {r['simulated_step_s']:.3f} ({100 * r['simulated_error']:+.0f}%) | "
                     f"{r['no_contention_step_s']:.3f} ({100 * r['no_contention_error']:+.0f}%) | "
                     f"{r['replayed_step_s']:.3f} ({100 * r['replay_error']:+.0f}%) | {r['load_average']:.1f} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
