"""``python -m verl_digen.export --ckpt CKPT_DIR --out OUT_DIR``: trained weights for diffusers.

- LoRA runs export a LoRA that loads with the pipeline's ``load_lora_weights(OUT_DIR)``
  (``pytorch_lora_weights.safetensors``, diffusers/PEFT key format).
- Full fine-tunes export a complete diffusers directory: the base model's components with
  the trained ``transformer/`` in place, loadable with ``<Pipeline>.from_pretrained(OUT_DIR)``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from verl_digen.trainer.checkpoint import Checkpoint, CheckpointError, checkpoint_at, damage


def _pipeline_class(model_path: str):
    import diffusers

    from verl_digen.models.base import read_model_index

    name = read_model_index(model_path)["_class_name"]
    return getattr(diffusers, name)


def export_checkpoint(ckpt: Checkpoint, out_dir: str, *, model_path: str | None = None) -> str:
    from peft.utils import get_peft_model_state_dict

    from verl_digen.config.schema import LoraConfigSpec
    from verl_digen.models.registry import load_adapter
    from verl_digen.sync.state import load_trainable_state
    from verl_digen.workers.training import add_lora

    why = damage(ckpt)  # the checksums and the DCP metadata, as a resume checks them
    if why is not None:
        raise CheckpointError(f"not exported: {why}")
    meta = ckpt.meta()
    model_path = model_path or meta["model_path"]
    adapter = load_adapter(model_path, meta.get("arch"))
    lora_only = bool(meta["lora_only"])
    if lora_only:
        add_lora(adapter, LoraConfigSpec(**meta["lora"]))
    load_trainable_state(adapter.transformer, ckpt.weights(), lora_only=lora_only)
    os.makedirs(out_dir, exist_ok=True)
    if lora_only:
        layers = get_peft_model_state_dict(adapter.transformer)
        # The adapter metadata carries rank and alpha, so the loaded LoRA keeps our scaling.
        config = adapter.transformer.peft_config["default"].to_dict()
        config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
        _pipeline_class(model_path).save_lora_weights(
            out_dir, transformer_lora_layers=layers, transformer_lora_adapter_metadata=config
        )
    else:
        for name in os.listdir(model_path):
            src = os.path.join(model_path, name)
            if name == "transformer":
                continue
            dst = os.path.join(out_dir, name)
            if os.path.isdir(src):
                shutil.copytree(src, dst, dirs_exist_ok=True)
            else:
                shutil.copy2(src, dst)
        adapter.transformer.save_pretrained(os.path.join(out_dir, "transformer"))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="a global_step_<k> checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--model-path", default=None, help="base model directory (default: the one trained)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(checkpoint_at(args.ckpt), args.out, model_path=args.model_path)
    except CheckpointError as e:
        print(f"[verl-digen] export: {e}", file=sys.stderr)
        return 2
    print(f"[verl-digen] exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
