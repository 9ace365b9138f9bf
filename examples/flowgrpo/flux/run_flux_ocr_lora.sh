# FLUX.1-dev, LoRA, OCR reward (text rendering), disaggregated rollout / trainer pools with GAP and
# one-step-off async training (TCSS), under veRL's own entry point.
# Data: Flow-GRPO's dataset/ocr/{train,test}.txt (the text to render is the quoted part of each prompt).
# Plan the pool split for your GPUs first: python -m verl_digen.sim.planner --model flux-12b --devices 8
# GAP trains each group as it arrives, so advantages use the group's std (algorithm.global_std=false).
set -x

WORKSPACE=${WORKSPACE:-$HOME}
ocr_train_path=${TRAIN_FILES:-$WORKSPACE/flow_grpo/dataset/ocr/train.txt}
ocr_test_path=${VAL_FILES:-$WORKSPACE/flow_grpo/dataset/ocr/test.txt}
model_name=${MODEL_PATH:-black-forest-labs/FLUX.1-dev}
NUM_GPUS=${NUM_GPUS:-8}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}

python3 -m verl.trainer.main_ppo \
    trainer.v1.trainer_mode=digen \
    algorithm.adv_estimator=flow_grpo \
    algorithm.global_std=false \
    data.train_files=$ocr_train_path \
    data.val_files=$ocr_test_path \
    data.train_batch_size=16 \
    actor_rollout_ref.model.path=$model_name \
    +digen.model.arch=flux \
    actor_rollout_ref.model.lora_rank=32 \
    actor_rollout_ref.model.lora_alpha=64 \
    actor_rollout_ref.actor.optim.lr=3e-4 \
    actor_rollout_ref.actor.optim.weight_decay=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-4 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.pipeline.height=512 \
    actor_rollout_ref.rollout.pipeline.width=512 \
    actor_rollout_ref.rollout.pipeline.num_inference_steps=16 \
    actor_rollout_ref.rollout.pipeline.guidance_scale=3.5 \
    actor_rollout_ref.rollout.algo.noise_level=0.7 \
    actor_rollout_ref.rollout.algo.sde_window_size=2 \
    actor_rollout_ref.rollout.algo.sde_window_range="[0,8]" \
    +digen.reward.name=ocr \
    +digen.placement=disaggregated \
    +digen.pools.rollout.devices=$ROLLOUT_GPUS \
    +digen.pools.trainer.devices=$((NUM_GPUS - ROLLOUT_GPUS)) \
    +digen.gap.enable=true \
    +digen.async.max_staleness=1 \
    trainer.logger='["console", "wandb"]' \
    trainer.project_name=flow_grpo \
    trainer.experiment_name=flux_ocr_lora \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node=$NUM_GPUS \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=25 \
    trainer.total_training_steps=500 "$@"
