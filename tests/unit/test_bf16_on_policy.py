"""bf16 on-policy exactness: with the weights that sampled a batch, the trainer's recomputed
log-probs equal the rollout's behaviour log-probs (within 1e-6, in practice bit for bit) for
every family, in bf16 on CPU, unsharded and FSDP2-sharded (gloo, 2 ranks), with CFG where the
family uses it, at two training micro-batch sizes. Unsharded here; sharded, a short bf16 run and
a full fine-tune across a sync in tests/e2e/test_bf16_on_policy_e2e.py, on this module's helpers.

How: weights load in bf16 (LoRA in fp32), no autocast, FSDP gathers parameters in their own
dtypes without casting inputs, and rollout and trainer make the same transformer calls: chunks
of ``forward_rows`` rows of one group (a kernel's result for a row can depend on how many rows
it is computed with; without the chunks, HunyuanVideo's recomputation at 1 row per call differs
from a rollout at 4 rows per call)."""

from __future__ import annotations

import pytest
import torch

from runs import SPECS

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ("flux", "sd3", "qwen_image", "wan", "hunyuan_video")
# True CFG where the family's pipeline uses it (FLUX and HunyuanVideo use distilled guidance).
CFG_SCALE = {"flux": 1.0, "sd3": 4.5, "qwen_image": 4.0, "wan": 5.0, "hunyuan_video": 1.0}
GROUP_SIZE = 2
GROUPS = 2  # one rollout batch: 2 groups of 2
TOL = 1e-6


def _settings(arch: str, micro_batch_groups: int, ranks: int):
    import dataclasses

    from verl_digen.algos.window import SdeWindowConfig
    from verl_digen.workers.sampling import SamplingSettings, forward_rows

    return SamplingSettings(
        spec=dataclasses.replace(SPECS[arch], guidance_scale=CFG_SCALE[arch]),
        num_steps=3,
        noise_level=0.7,
        sde_type="sde",
        window=SdeWindowConfig(mode="fixed", start=0, size=2),
        timestep_fraction=1.0,
        negative_prompt="blurry",
        forward_rows=forward_rows(GROUP_SIZE, micro_batch_groups, ranks),
    )


def _bf16_lora_adapter(path: str):
    from verl_digen.config.schema import LoraConfigSpec
    from verl_digen.models.registry import load_adapter
    from verl_digen.workers.training import add_lora

    adapter = load_adapter(path, dtype=torch.bfloat16)
    add_lora(adapter, LoraConfigSpec(rank=4, init_seed=3))
    # A non-zero LoRA update, so the fp32 LoRA branch takes part in the velocity.
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return adapter


def _rollout(adapter, settings):
    from verl_digen.workers.sampling import sample_groups

    return sample_groups(
        adapter, ["a red apple", "a blue car on a long road"], [0, 1], [0, 1], group_size=GROUP_SIZE,
        settings=settings, training_step=0, seed=11, policy_version=0,
    )


def _updater(adapter, settings):
    from verl_digen.config.schema import AlgoConfig
    from verl_digen.workers.training import PolicyUpdater, TrainSettings

    return PolicyUpdater(
        adapter,
        TrainSettings(algo=AlgoConfig(), sampling=settings, lora_only=True, images_per_step=GROUPS * GROUP_SIZE),
    )


def _on_policy(updater, data, advantages) -> dict[str, float]:
    """Recompute and train one micro-batch: |logp - logp_old| over the SDE window, and the
    loss's ratio and clip fraction."""
    window = data.batch["sde_mask"][0]
    diff = (updater.recompute_log_probs(data)[:, window] - data.batch["log_probs"][:, window]).abs()
    metrics = updater.train_micro_batch(data, advantages)
    return {
        "max": float(diff.max()),
        "median": float(diff.median()),
        "ratio_mean": metrics["actor/ratio_mean"],
        "clip_frac": metrics["actor/clip_frac"],
        "diffs": diff.flatten().tolist(),
    }


ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.mark.parametrize("arch", ARCHS)
def test_unsharded_bf16_recompute_is_exact_at_two_micro_batch_sizes(arch, tiny_dirs):
    adapter = _bf16_lora_adapter(tiny_dirs[arch])
    assert {p.dtype for n, p in adapter.transformer.named_parameters() if "lora_" in n} == {torch.float32}
    assert torch.bfloat16 in {p.dtype for p in adapter.transformer.parameters()}
    report = {}
    for micro_batch_groups in (1, 2):
        settings = _settings(arch, micro_batch_groups, ranks=1)
        data = _rollout(adapter, settings)
        updater = _updater(adapter, settings)
        rows = micro_batch_groups * GROUP_SIZE
        for start in range(0, len(data), rows):
            idx = list(range(start, start + rows))
            out = _on_policy(updater, data.select_idxs(idx), ADVANTAGES[idx])
            report[(micro_batch_groups, start)] = out
            assert out["max"] <= TOL, (arch, micro_batch_groups, out["max"])
            assert out["clip_frac"] == 0.0 and abs(out["ratio_mean"] - 1.0) <= TOL, out
        updater.optimizer.zero_grad(set_to_none=True)
    print(arch, "unsharded |logp - logp_old|:", {k: (v["max"], v["median"]) for k, v in report.items()})
