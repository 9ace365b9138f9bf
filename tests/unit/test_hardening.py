"""Hardening (issue 18): checkpoints are data, not code; one run per checkpoint directory;
corrupt checkpoints are named and skipped; bad config fails before anything starts; the job's
own sockets listen on loopback.

Everything here is bounded in time and stays on 127.0.0.1. The signal tests (SIGINT/SIGTERM
give a checkpoint and exit 130/143) are in tests/e2e/test_checkpoint_e2e.py next to the other
stop tests; a resume from a crafted checkpoint, the command line's exit on a bad config and the
addresses Ray binds: tests/e2e/test_hardening_e2e.py."""

from __future__ import annotations

import json
import os
import pickle
import re
import threading

import psutil
import pytest
import ray
import torch

from checkpoints import save_earlier_layout, save_one_rank
from runs import lock_holder, run_config
from verl_digen.config.schema import ConfigError
from verl_digen.config.verl_keys import VerlTrainerKeys
from verl_digen.trainer.checkpoint import CheckpointError, RootLock, find_latest_intact, select_resume
from verl_digen.workers.sharded_state import load_pt


def _save(root, step):
    return save_one_rank(
        root, step,
        controller_state={"step": step, "sampler": {"epoch": 0, "position": step}, "metrics": [{"step": step}]},
        meta={"strategy": "colocated"},
    )


DATA = "state/__0_0.distcp"  # the rank's tensors (DCP)


def _rewrite_checksums(ckpt) -> None:
    """What an attacker who edits a checkpoint can also do: make meta.json match the files."""
    import hashlib

    meta = ckpt.meta()
    for name in meta["files"]:
        data = open(os.path.join(ckpt.path, name), "rb").read()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with open(os.path.join(ckpt.path, "meta.json"), "w") as f:
        json.dump(meta, f)


class _Payload:
    """A pickle that runs code when loaded: creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ----------------------------------------------------------------------------- safe loading


def test_a_crafted_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    ckpt = _save(tmp_path / "ck", 1)
    marker = tmp_path / "pwned"
    with open(os.path.join(ckpt.path, "controller.pt"), "wb") as f:
        pickle.dump({"step": 1, "sampler": _Payload(str(marker))}, f)
    _rewrite_checksums(ckpt)
    ckpt.verify()  # the checksums match: only the safe loader stands between the file and the code
    with pytest.raises(CheckpointError, match=r"controller\.pt: refused or unreadable"):
        ckpt.controller_state()
    assert not marker.exists()
    # Plain checkpoints still load (tensors, numbers, strings, containers).
    good = _save(tmp_path / "ok", 2)
    assert good.controller_state()["sampler"]["position"] == 2
    assert load_pt(os.path.join(good.path, "trainer_rank0.pt"))["version"] == 2


# ----------------------------------------------------------------------------- integrity


def test_every_file_is_checksummed_in_the_completion_marker(tmp_path):
    ckpt = _save(tmp_path, 1)
    files = ckpt.meta()["files"]
    assert set(files) == {DATA, "state/.metadata", "trainer_rank0.pt", "controller.pt"}
    for name, entry in files.items():
        assert entry["bytes"] == os.path.getsize(os.path.join(ckpt.path, name))
    ckpt.verify()


def test_a_bit_flip_in_the_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    path = os.path.join(bad.path, DATA)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x10  # same size, different bytes: DCP would load it silently
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"global_step_2/state/__0_0\.distcp: SHA-256 does not match"):
        bad.verify()
    chosen = select_resume(VerlTrainerKeys(resume_mode="auto"), str(tmp_path))
    assert chosen.step == 1
    out = capsys.readouterr().out
    assert "skipping damaged checkpoint" in out and f"global_step_2/{DATA}" in out
    # Asked for by path, the corrupt one is refused with the file named.
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp"):
        select_resume(VerlTrainerKeys(resume_mode="resume_path", resume_from_path=bad.path), str(tmp_path))


@pytest.mark.parametrize("layout", ["sharded", "earlier"])
def test_a_truncated_weights_file_is_named(tmp_path, layout):
    if layout == "sharded":
        ckpt, name, unreadable = _save(tmp_path, 1), DATA, "state"
    else:  # the driver-written layout, which export still reads
        ckpt, name = save_earlier_layout(tmp_path, 1, {"w": torch.ones(64)}), "weights.safetensors"
        unreadable = name
    path = os.path.join(ckpt.path, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: \d+ bytes, meta\.json says \d+"):
        ckpt.verify()
    with pytest.raises(CheckpointError, match=rf"{re.escape(unreadable)}: cannot be read"):
        ckpt.weights()
    assert find_latest_intact(str(tmp_path)) is None


# ----------------------------------------------------------------------------- one run per directory


def test_a_second_run_on_the_same_checkpoint_directory_is_refused_naming_the_first(tmp_path, tiny_flux):
    from verl_digen.trainer.loop import run_training

    ck = tmp_path / "ck"
    with lock_holder(str(ck), {"output_dir": "first-run"}) as holder:
        with pytest.raises(CheckpointError, match=rf"in use by another run .*\"pid\": {holder.pid}.*first-run"):
            RootLock(str(ck)).acquire({})
        with pytest.raises(CheckpointError, match="trainer.default_local_dir"):
            run_training(run_config(tmp_path, "b", "trainer.total_training_steps=1", f"trainer.default_local_dir={ck}"))
        assert not ray.is_initialized()  # refused before Ray or any worker started
    lock = RootLock(str(ck))
    lock.acquire({})  # the OS released the dead holder's lock
    lock.release()


# ----------------------------------------------------------------------------- bad input, up front


@pytest.mark.parametrize("override, key", [
    ("digen.sampling.noise_level=nan", "digen.sampling.noise_level"),
    ("digen.algo.lr=nan", "digen.algo.lr"),
    ("digen.task_timeout_s=nan", "digen.task_timeout_s"),
    ("digen.algo.max_grad_norm=inf", "digen.algo.max_grad_norm"),
    ("digen.ema.decay=nan", "digen.ema.decay"),
    ("digen.algo.clip_range=-inf", "digen.algo.clip_range"),
])
def test_nan_and_inf_are_refused_naming_the_key(tmp_path, override, key):
    from verl_digen.trainer.loop import DigenTrainer

    with pytest.raises(ConfigError, match=rf"{key}=(nan|inf|-inf)"):
        DigenTrainer(run_config(tmp_path, "x", override))


def test_unknown_logger_is_refused_with_verls_list(tmp_path):
    from verl_digen.trainer.loop import DigenTrainer

    with pytest.raises(ConfigError, match=r"trainer.logger=\['nonexistent'\].*valid: .*wandb.*console"):
        DigenTrainer(run_config(tmp_path, "x", "trainer.logger=[nonexistent]"))


def test_a_size_the_model_cannot_take_is_refused_at_config_time(tmp_path, tiny_flux):
    from verl_digen.trainer.loop import DigenTrainer

    with pytest.raises(ConfigError, match=r"digen.sampling.height=30.*FLUX needs height and width divisible by"):
        DigenTrainer(run_config(tmp_path, "x", f"digen.model.path={tiny_flux}", "digen.sampling.height=30"))


def test_a_size_beyond_sd3s_position_embedding_is_refused_at_config_time(tmp_path, tiny_sd3):
    """SD3's position embedding covers pos_embed_max_size patches a side (the tiny model's 32:
    128 pixels; SD3.5-M's 384): a larger image was a diffusers error deep inside the first forward."""
    from verl_digen.trainer.loop import DigenTrainer

    with pytest.raises(ConfigError, match=r"digen.sampling.height=384.*SD3's position embedding covers 32 patches "
                                          r"per side \(transformer pos_embed_max_size\): at most 128 x 128 pixels"):
        DigenTrainer(run_config(tmp_path, "x", f"digen.model.path={tiny_sd3}", "digen.sampling.height=384",
                                "digen.sampling.width=384"))
    from verl_digen.models.base import SampleSpec
    from verl_digen.models.registry import ADAPTERS

    ADAPTERS["sd3"].check_sample_size(tiny_sd3, SampleSpec(128, 128, 1))  # the largest it covers


def test_a_truncated_model_file_is_named_before_workers_start(tmp_path, tiny_flux):
    import shutil

    from verl_digen.trainer.loop import DigenTrainer

    model = tmp_path / "model"
    shutil.copytree(tiny_flux, model)
    weights = next((model / "transformer").glob("*.safetensors"))
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 100)
    with pytest.raises(ConfigError, match=rf"{weights.name} is not a whole safetensors file .*truncated"):
        DigenTrainer(run_config(tmp_path, "x", f"digen.model.path={model}"))


def test_a_very_long_prompt_is_refused_naming_the_file_and_prompt(tmp_path):
    from verl_digen.trainer.loop import DigenTrainer

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n" + "x" * 20000 + "\n")
    with pytest.raises(ConfigError, match=r"prompt 1 has 20000 characters.*digen.data.max_prompt_chars=16384"):
        DigenTrainer(run_config(tmp_path, "x", f"digen.data.prompts={prompts}"))


def test_prompts_over_the_token_limit_are_refused_or_dropped_as_veRL_does(tmp_path, tiny_flux, capsys):
    """veRL's data.max_prompt_length (digen.data.max_prompt_tokens), counted by the model's T5
    tokenizer: the first over-long prompt is named; with data.filter_overlong_prompts the run
    starts without them and says how many it dropped."""
    from verl_digen.models.flux import FluxAdapter
    from verl_digen.trainer.loop import DigenTrainer

    short, long = "a cat", "a red cube on a table beside a green sphere under a lamp"
    counts = FluxAdapter.prompt_token_counts(tiny_flux, [short, long])
    assert counts[0] < counts[1]
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join([short, long, short, short]) + "\n")
    base = [f"digen.model.path={tiny_flux}", f"digen.data.prompts={prompts}", "digen.batch.groups_per_step=1",
            f"data.max_prompt_length={counts[0]}"]
    with pytest.raises(ConfigError, match=rf"digen.data.prompts: prompt 1 \('a red cube.*has {counts[1]} tokens "
                                          rf"\(as the flux model's tokenizer_2 reads it\), more than data.max_prompt_length={counts[0]}; 1 of 4"):
        DigenTrainer(run_config(tmp_path, "refused", *base))
    trainer = DigenTrainer(run_config(tmp_path, "dropped", *base, "data.filter_overlong_prompts=true"))
    assert [r["prompt"] for r in trainer.job.prompt_records] == [short] * 3
    assert "dropped 1 of 4 prompts longer than digen.data.max_prompt_tokens" in capsys.readouterr().out


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1")


def test_the_weight_channel_store_listens_on_its_address_only():
    from verl_digen.sync import find_free_port
    from verl_digen.sync.transport import WeightChannel

    port = find_free_port("127.0.0.1")
    channels: dict[int, WeightChannel] = {}

    def join(rank: int) -> None:
        channels[rank] = WeightChannel("gloo", rank, 2, "127.0.0.1", port, timeout_s=60)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    try:
        assert set(channels) == {0, 1}
        on_port = [c for c in psutil.Process().net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert on_port and all(_loopback(c.laddr.ip) for c in on_port), on_port
    finally:
        for ch in channels.values():
            ch.close()
