"""``python -m verl_digen.main [hydra overrides]``: FlowGRPO training of a diffusion model.

With no overrides it builds a tiny FLUX model, trains it colocated on 2 devices (CPU slots
on a CPU machine) with the brightness reward, and prints the run directory.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from verl_digen.config.compose import CONFIG_DIR, CONFIG_NAME


@hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base=None)
def main(config: DictConfig) -> None:
    from verl_digen.trainer.loop import RunStopped, run_training
    from verl_digen.trainer.resolve import one_line_errors
    from verl_digen.trainer.runtime import RunInterrupted

    try:
        run_training(config)
    except one_line_errors() as e:
        print(f"[verl-digen] error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunStopped:
        sys.exit(1)  # the message (what failed, the checkpoint, how to resume) is already printed
    except RunInterrupted as e:  # SIGINT -> 130, SIGTERM -> 143, after a checkpoint of completed steps
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    from verl_digen.config.omni_keys import plain_overrides

    sys.argv[1:] = plain_overrides(sys.argv[1:])  # veRL-Omni's diffusion keys without '+', as under main_ppo
    main()
