"""digen.fault.restarts without Ray runs: the key's validation, and which failures restart the
run's workers (a worker's death) and which stop it as before. The restarts themselves, in real
runs: tests/e2e/test_fault_restarts_e2e.py."""

from __future__ import annotations

import pytest
import ray

from verl_digen.config.compose import compose_config
from verl_digen.config.schema import ConfigError
from verl_digen.schedule.plan import WorkerId
from verl_digen.trainer.faults import dead_workers as _dead_workers
from verl_digen.trainer.ray_executor import WorkerDied, WorkerFailure
from verl_digen.trainer.resolve import check_run_config


def test_restarts_default_to_zero_and_refuse_a_negative_count():
    assert compose_config([]).digen.fault.restarts == 0
    assert check_run_config(compose_config(["digen.fault.restarts=2"])).cfg.fault.restarts == 2
    with pytest.raises(ConfigError, match=r"digen\.fault\.restarts=-1; an integer >= 0"):
        check_run_config(compose_config(["digen.fault.restarts=-1"]))


def _raised(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


def test_a_worker_death_restarts_and_names_the_dead_worker_through_the_stop_chain():
    rollout = WorkerId("rollout", 0)
    died = WorkerDied("worker rollout0 (pool 'rollout') died while running s2/sync: ActorDiedError", [rollout])
    assert _dead_workers(died, {}) == "rollout0 (pool 'rollout')"
    # the death reaches the loop wrapped (a step's error raised from it)
    assert _dead_workers(_raised(RuntimeError("step 3 failed"), died), {}) == "rollout0 (pool 'rollout')"


def test_ray_reports_a_dead_actor_outside_the_plan_named_by_its_actor_id():
    class Handle:  # what the loop reads of an actor handle: its id
        def __init__(self, hex_id):
            self._actor_id = type("Id", (), {"hex": lambda _self: hex_id})()

    actors = {WorkerId("trainer", 0): Handle("aa11"), WorkerId("rollout", 0): Handle("bb22")}
    err = ray.exceptions.ActorDiedError()
    err.actor_id = "bb22"
    assert _dead_workers(err, actors) == "rollout0 (pool 'rollout')"


@pytest.mark.parametrize("error", [
    WorkerFailure("task s2/reward failed on rollout0: ValueError: bad image"),  # a task raised: not a death
    RuntimeError("NonFinite"),
    KeyboardInterrupt(),
    OSError(28, "No space left on device"),
])
def test_other_failures_stop_the_run_as_before(error):
    assert _dead_workers(error, {}) is None
