"""Hardening, round two (issue 25), checkpoints: DCP's own pickles are read without running
code, a resume never silently continues a different run or trains over damaged checkpoints,
export verifies checksums, one run per output directory, stale temporaries are cleaned, and
paths that cannot be directories or models without weights are named before Ray starts.

The in-process checkpoints here are written by the same ``save_rank_state`` a trainer rank
runs (one rank, no process group), so no Ray is needed; the resume tests, which share one real
one-step run, are in tests/e2e/test_checkpoint_trust_e2e.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil

import pytest
import ray
import torch
from torch.distributed.checkpoint.api import CheckpointException

from runs import lock_holder, run_config
from verl_digen.config.schema import ConfigError
from verl_digen.config.verl_keys import VerlTrainerKeys
from verl_digen.trainer.checkpoint import Checkpoint, CheckpointError, damage, save_checkpoint, select_resume
from verl_digen.workers import sharded_state
from verl_digen.workers.sharded_state import load_rank_state, read_full_weights, save_rank_state


class _Payload:
    """A pickle that runs code when loaded: creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_checksums(ckpt: Checkpoint) -> None:
    """What whoever can write a checkpoint's files can also do: make meta.json match them."""
    meta = ckpt.meta()
    for name in meta["files"]:
        data = open(os.path.join(ckpt.path, name), "rb").read()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with open(os.path.join(ckpt.path, "meta.json"), "w") as f:
        json.dump(meta, f)


def _module():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    return m, opt


def _sharded(root, step: int = 1) -> Checkpoint:
    """A one-rank sharded checkpoint (DCP ``state/`` + rank file + controller + marker)."""
    m, opt = _module()
    return save_checkpoint(
        str(root), step,
        write_state=lambda tmp: save_rank_state(tmp, module=m, optimizer=opt, ema=None, lora_only=False,
                                                version=step, rank=0, group=None),
        controller_state={"step": step, "sampler": {}, "metrics": []},
        meta={"model_path": "unused", "lora_only": False, "layout": "sharded"},
    )


def _load_into_fresh(ckpt: Checkpoint, out_features: int = 4) -> torch.nn.Module:
    m = torch.nn.Linear(3, out_features)
    load_rank_state(ckpt.path, module=m, optimizer=torch.optim.AdamW(m.parameters()), ema=None,
                    lora_only=False, rank=0, group=None)
    return m


def _craft_metadata(ckpt: Checkpoint, marker) -> str:
    """Replace DCP's ``.metadata`` with a pickle that runs code, checksums rewritten."""
    path = os.path.join(ckpt.path, "state", ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own file, written just now
    metadata.planner_data = _Payload(str(marker))
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_checksums(ckpt)
    return path


def _craft_item(ckpt: Checkpoint, marker, fqn: str = "optimizer.param_groups.0.lr") -> None:
    """Point one non-tensor item of the ``.distcp`` file at a ``torch.save`` of a payload (what
    DCP's default planner would ``torch.load(weights_only=False)``); checksums rewritten."""
    state = os.path.join(ckpt.path, "state")
    with open(os.path.join(state, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    blob = io.BytesIO()
    torch.save(_Payload(str(marker)), blob)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    data_file = os.path.join(state, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(blob.getvalue())
    info.offset, info.length = offset, len(blob.getvalue())
    with open(os.path.join(state, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_checksums(ckpt)


# ----------------------------------------------------------------------------- DCP pickles


def test_a_plain_sharded_checkpoint_loads_through_the_safe_reader(tmp_path):
    ckpt = _sharded(tmp_path)
    assert damage(ckpt) is None
    m = _load_into_fresh(ckpt)
    original, _ = _module()
    assert torch.equal(m.weight, original.weight) and torch.equal(m.bias, original.bias)
    assert torch.equal(read_full_weights(ckpt.path)["weight"], original.weight)


def test_a_crafted_dcp_metadata_is_refused_by_the_rank_the_resume_check_and_export(tmp_path):
    from verl_digen.export import main as export_main

    ckpt = _sharded(tmp_path / "ck")
    marker = tmp_path / "pwned"
    path = _craft_metadata(ckpt, marker)
    ckpt.verify()  # the checksums match: only the safe reader stands between the file and the code
    with pytest.raises(CheckpointError, match=rf"{path}: refused .*io\.open"):
        _load_into_fresh(ckpt)  # a trainer or rollout rank loading the checkpoint
    with pytest.raises(CheckpointError, match=rf"{path}: refused"):
        read_full_weights(ckpt.path)
    assert path in damage(ckpt)  # what resume (auto and resume_path) checks before any worker
    with pytest.raises(CheckpointError, match=rf"{path}: refused"):
        select_resume(VerlTrainerKeys(resume_mode="resume_path", resume_from_path=ckpt.path), str(tmp_path / "ck"))
    assert export_main(["--ckpt", ckpt.path, "--out", str(tmp_path / "out")]) == 2
    assert not marker.exists()


def test_a_crafted_non_tensor_item_in_a_distcp_file_is_refused(tmp_path):
    ckpt = _sharded(tmp_path)
    marker = tmp_path / "pwned"
    _craft_item(ckpt, marker)
    ckpt.verify()
    with pytest.raises(CheckpointError, match=r"state/__0_0\.distcp \(item optimizer\.param_groups\.0\.lr\): refused"):
        _load_into_fresh(ckpt)
    assert not marker.exists()


def test_dcp_failures_raised_as_checkpoint_exception_are_named(tmp_path, monkeypatch):
    """torch's CheckpointException derives from BaseException: caught and named, with the
    failing rank's own reason."""
    ckpt = _sharded(tmp_path)
    with pytest.raises(CheckpointError, match=r"state: cannot be loaded into this model .*Size mismatch"):
        _load_into_fresh(ckpt, out_features=5)  # another architecture

    def failing_load(*args, **kwargs):
        raise CheckpointException("load failed", {1: (ValueError("missing key model.lora_A"), None)})

    monkeypatch.setattr(sharded_state.dcp, "load", failing_load)
    with pytest.raises(CheckpointError, match=r"global_step_1/state: cannot be loaded .*missing key model\.lora_A"):
        _load_into_fresh(ckpt)


# ----------------------------------------------------------------------------- damaged checkpoints


def _flip_a_bit(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


def test_auto_resume_with_every_checkpoint_damaged_stops_listing_each(tmp_path, capsys):
    root = tmp_path / "ck"
    one, two = _sharded(root, 1), _sharded(root, 2)
    _flip_a_bit(os.path.join(one.path, "state", "__0_0.distcp"))
    with open(os.path.join(two.path, "meta.json"), "r+") as f:
        f.truncate(40)  # a truncated marker
    with pytest.raises(CheckpointError) as e:
        select_resume(VerlTrainerKeys(resume_mode="auto"), str(root))
    msg = str(e.value)
    assert "holds 2 checkpoint(s) and none is intact" in msg
    assert f"{two.path}/meta.json: unreadable" in msg and f"{one.path}/state/__0_0.distcp: SHA-256" in msg
    assert "digen.resume.fresh_if_damaged=true" in msg
    out = capsys.readouterr().out
    assert out.count("skipping damaged checkpoint") == 2  # every skip is logged, the truncated marker too
    # Starting fresh anyway: the damaged ones are never written over, only moved aside.
    assert select_resume(VerlTrainerKeys(resume_mode="auto"), str(root), fresh_if_damaged=True) is None
    damaged_bytes = open(os.path.join(one.path, "state", "__0_0.distcp"), "rb").read()
    fresh = _sharded(root, 1)
    assert damage(fresh) is None
    kept = f"{one.path}.damaged"
    assert open(os.path.join(kept, "state", "__0_0.distcp"), "rb").read() == damaged_bytes
    assert "is damaged" in capsys.readouterr().out
    # Resume now picks the fresh step 1, skipping (and saying so) the damaged step 2.
    assert select_resume(VerlTrainerKeys(resume_mode="auto"), str(root)).path == fresh.path


def test_a_damaged_newer_marker_is_skipped_with_a_message(tmp_path, capsys):
    root = tmp_path / "ck"
    one = _sharded(root, 1)
    two = _sharded(root, 2)
    open(os.path.join(two.path, "meta.json"), "w").write("{\"step\": 2, \"comp")
    assert select_resume(VerlTrainerKeys(resume_mode="auto"), str(root)).path == one.path
    assert f"skipping damaged checkpoint {two.path}: {two.path}/meta.json: unreadable" in capsys.readouterr().out


def test_export_verifies_checksums(tmp_path, capsys):
    from verl_digen.export import export_checkpoint, main as export_main

    ckpt = _sharded(tmp_path / "ck")
    _flip_a_bit(os.path.join(ckpt.path, "state", "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"not exported: .*__0_0\.distcp: SHA-256 does not match"):
        export_checkpoint(ckpt, str(tmp_path / "out"))
    assert export_main(["--ckpt", ckpt.path, "--out", str(tmp_path / "out2")]) == 2
    assert "SHA-256 does not match" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out2")


# ----------------------------------------------------------------------------- one run per output dir


def test_a_second_run_on_the_same_output_dir_is_refused(tmp_path, tiny_flux):
    from verl_digen.trainer.loop import run_training

    out = tmp_path / "shared"
    with lock_holder(str(out), {"output_dir": str(out)}, "digen.output_dir", "two runs would interleave") as holder:
        # Another checkpoint directory, the same output directory: refused, naming the holder.
        cfg = run_config(tmp_path, "unused", "trainer.total_training_steps=1", f"digen.output_dir={out}",
                         f"trainer.default_local_dir={tmp_path}/ck2")
        with pytest.raises(CheckpointError, match=rf"digen.output_dir={out} is in use by another run .*{holder.pid}"):
            run_training(cfg)
        assert not ray.is_initialized()
        assert not os.path.exists(out / "metrics.jsonl")


# ----------------------------------------------------------------------------- named before Ray


def test_paths_under_a_regular_file_are_named(tmp_path, tiny_flux):
    from verl_digen.trainer.loop import DigenTrainer

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=rf"digen.output_dir={blocker}/run cannot be a directory: {blocker} is a file"):
        DigenTrainer(run_config(tmp_path, "x", f"digen.output_dir={blocker}/run"))
    with pytest.raises(ConfigError, match=rf"trainer.default_local_dir={blocker}/ck/deeper cannot be a directory"):
        DigenTrainer(run_config(tmp_path, "y", f"trainer.default_local_dir={blocker}/ck/deeper"))
    assert not ray.is_initialized()


def test_a_model_folder_missing_its_transformer_weights_is_named_before_ray(tmp_path, tiny_flux):
    from verl_digen.trainer.loop import DigenTrainer

    model = tmp_path / "model"
    shutil.copytree(tiny_flux, model)
    removed = [f for f in os.listdir(model / "transformer") if f.endswith(".safetensors")]
    assert removed
    for f in removed:
        os.remove(model / "transformer" / f)
    with pytest.raises(ConfigError, match=rf"component 'transformer' \({model}/transformer\) has a config.json but no "
                                          "weights file"):
        DigenTrainer(run_config(tmp_path, "x", f"digen.model.path={model}"))
    assert not ray.is_initialized()
