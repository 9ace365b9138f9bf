"""The planner: what it evaluates, what it picks, what it tells the user to run."""

from __future__ import annotations

import json

import pytest

from verl_digen.sim.planner import (
    Inventory,
    candidates,
    hydra_overrides,
    main,
    parse_mix,
    search,
    split_shapes,
)
from verl_digen.sim.cost_model import CostModel, ProfileError, load_catalog


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _costs(catalog, model, device="H800", **workload):
    return CostModel.from_catalog(catalog, model, devices=[device], **workload)


@pytest.mark.parametrize(
    "model,devices,workload",
    [
        ("flux-12b", 16, {"groups_per_step": 16}),
        ("sd3.5-medium", 8, {"groups_per_step": 16}),
        ("hunyuanvideo-13b", 16, {"groups_per_step": 16}),
    ],
)
def test_planner_choice_is_never_worse_than_any_configuration_it_evaluated(catalog, model, devices, workload):
    result = search(_costs(catalog, model, **workload), Inventory({"H800": devices}), steps=4, warmup=1)
    assert len(result.evaluated) > 5
    best = result.best
    assert all(best.images_per_s >= e.images_per_s for e in result.evaluated)
    rows = result.rows()
    assert rows[0]["images_per_s"] == best.images_per_s
    assert [r["images_per_s"] for r in rows] == sorted((r["images_per_s"] for r in rows), reverse=True)


def test_configurations_that_do_not_fit_in_memory_are_reported_not_evaluated(catalog):
    result = search(_costs(catalog, "qwen-image-20b", groups_per_step=8), Inventory({"H800": 8}), steps=3, warmup=1)
    skipped = [e for e in result.evaluations if not e.feasible]
    assert skipped and all(e.problems for e in skipped)
    assert all(e.candidate.spec.trainer_workers >= 2 for e in result.evaluated if e.candidate.spec.placement == "disaggregated")
    assert result.best not in skipped


def test_speedups_are_relative_to_the_best_colocated_configuration(catalog):
    result = search(_costs(catalog, "flux-12b", groups_per_step=16), Inventory({"H800": 16}), steps=4, warmup=1)
    base = result.best_of("colocated").images_per_s
    for row in result.rows():
        assert row["speedup_vs_colocated"] == pytest.approx(row["images_per_s"] / base)
        assert row["images_per_s"] <= row["bound_images_per_s"] * (1 + 1e-9)


def test_pool_splits_respect_whole_nodes():
    assert split_shapes(8, 8, per_node=8, nnodes=2) == ((8, 1), (8, 1))
    assert split_shapes(10, 6, per_node=8, nnodes=2) == ((5, 2), (3, 2))  # 6 + 5 do not share one node
    assert split_shapes(9, 7, per_node=8, nnodes=2) is None  # 9 is neither 9x1 nor 3x3 on two nodes
    assert split_shapes(24, 8, per_node=8, nnodes=4) == ((8, 3), (8, 1))
    specs = [c.spec for c in candidates(Inventory({"H800": 16}), groups_per_step=16, group_size=4,
                                        mechanisms=["disaggregated"], micro_batches=(1,))]
    assert all(s.rollout_workers + s.trainer_workers == 16 for s in specs)
    # both pools must be (devices per node) x (nodes): 15, 13, 11 and 9 devices are not, on 2 x 8
    assert {s.rollout_workers for s in specs} == {2, 4, 6, 8, 10, 12, 14}


def test_heterogeneous_mix_puts_each_pool_on_one_device_type(catalog):
    inv = Inventory(parse_mix("H800:8,A100:8"))
    costs = CostModel.from_catalog(catalog, "flux-12b", devices=list(inv.devices), groups_per_step=16)
    result = search(costs, inv, mechanisms=["disaggregated+gap+tcss"], micro_batches=(1,), steps=3, warmup=1)
    layouts = {(e.candidate.pools["rollout"].device, e.candidate.pools["trainer"].device) for e in result.evaluated}
    assert layouts == {("H800", "A100"), ("A100", "H800")}
    with pytest.raises(ProfileError, match="TYPE:COUNT"):
        parse_mix("H800")


def test_hydra_overrides_of_the_best_configuration_build_the_same_strategy(catalog):
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.config.verl_keys import VerlTrainerKeys
    from verl_digen.placement.pools import cluster_from_trainer_keys, pool_layout

    costs = _costs(catalog, "flux-12b", groups_per_step=32)
    inv = Inventory({"H800": 32})
    result = search(costs, inv, mechanisms=["disaggregated+gap+tcss"], micro_batches=(2,), steps=3, warmup=1)
    best = result.best
    cfg = compose_config(hydra_overrides(best.candidate, costs, inv))
    container = OmegaConf.to_container(cfg, resolve=True)
    digen = digen_config_from_dict(container["digen"])
    layout = pool_layout(digen, cluster_from_trainer_keys(VerlTrainerKeys.of(container)))
    spec = best.candidate.spec
    for field in ("placement", "rollout_workers", "trainer_workers", "groups_per_step", "group_size",
                  "groups_per_task", "train_micro_batch_groups", "gap", "max_staleness"):
        assert getattr(layout.spec, field) == getattr(spec, field), field
    assert digen.sampling.height == costs.workload.height and digen.sampling.num_steps == costs.workload.num_steps


def test_cli_prints_a_ranked_table_and_writes_json_rows(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["--model", "sd3.5-medium", "--devices", "8", "--groups-per-step", "16", "--sim-steps", "3",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "hydra overrides" in text and "digen.placement=" in text and "digen.tsp.stages=" in text
    rows = json.loads(out.read_text())["rows"]
    keys = {"strategy", "rollout_devices", "trainer_devices", "images_per_s", "bubble_fraction",
            "bound_images_per_s", "speedup_vs_colocated"}
    assert rows and all(keys <= set(r) for r in rows)
    assert rows[0]["images_per_s"] == max(r["images_per_s"] for r in rows)


def test_cli_names_a_bad_argument(capsys):
    assert main(["--model", "flux-99b", "--devices", "8"]) == 2
    assert "unknown model profile 'flux-99b'" in capsys.readouterr().err


def test_cli_predicts_verl_omni_on_the_same_cluster_with_step_time_and_cost(tmp_path, capsys):
    """--system verl-omni: veRL-Omni's colocated run (its engine takes a worker's whole share of the
    step), costed with the same hardware; rows carry the step time and the cost per 1,000 images."""
    out = tmp_path / "omni.json"
    assert main(["--model", "flux-12b", "--devices", "16", "--groups-per-step", "32", "--sim-steps", "3",
                 "--system", "verl-omni", "--json", str(out)]) == 0
    assert "system verl-omni" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["system"] == "verl-omni"
    (row,) = doc["rows"]
    assert row["strategy"] == "colocated" and row["system"] == "verl-omni"
    assert row["groups_per_task"] == row["train_micro_batch_groups"] == 32 // 16
    assert row["step_s"] == row["step_time_s"] == pytest.approx(32 * 12 / row["images_per_s"])
    assert row["usd_per_hour"] == pytest.approx(16 * load_catalog().devices["H800"].usd_per_hour)
    assert row["usd_per_1000_images"] == pytest.approx(row["usd_per_hour"] / 3600 * 1000 / row["images_per_s"])
    # ours on the same cluster and workload: no recomputation, no parameter offload, no judge swap
    ours = tmp_path / "ours.json"
    assert main(["--model", "flux-12b", "--devices", "16", "--groups-per-step", "32", "--sim-steps", "3",
                 "--mechanisms", "colocated", "--micro-batches", "2", "--json", str(ours)]) == 0
    (mine,) = json.loads(ours.read_text())["rows"][:1]
    assert mine["system"] == "verl-digen" and mine["step_s"] < row["step_s"]
    assert mine["bound_images_per_s"] == pytest.approx(row["bound_images_per_s"])  # one bound for both systems


def test_a_system_that_runs_only_colocated_is_refused_other_placements(catalog):
    costs = CostModel.from_catalog(catalog, "flux-12b", devices=["H800"], system="verl-omni", groups_per_step=16)
    with pytest.raises(ProfileError, match="runs only colocated"):
        search(costs, Inventory({"H800": 8}), mechanisms=["disaggregated+gap"], steps=3, warmup=1)
