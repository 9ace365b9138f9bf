# SD3.5-Medium, LoRA, GenEval-style reward (object, count, colour and position correctness) from
# GenEval's scorer server (reward-server's GenEval app, in its own environment with mmdetection;
# pickle protocol), disaggregated with GAP.
# Data: Flow-GRPO's dataset/geneval/{train,test}_metadata.jsonl (each record goes to the server).
# GAP trains each group as it arrives, so advantages use the group's std (algorithm.global_std=false).
set -x

WORKSPACE=${WORKSPACE:-$HOME}
train_path=${TRAIN_FILES:-$WORKSPACE/flow_grpo/dataset/geneval/train_metadata.jsonl}
test_path=${VAL_FILES:-$WORKSPACE/flow_grpo/dataset/geneval/test_metadata.jsonl}
model_name=${MODEL_PATH:-stabilityai/stable-diffusion-3.5-medium}
GENEVAL_SERVER_URL=${GENEVAL_SERVER_URL:-http://localhost:18085}
NUM_GPUS=${NUM_GPUS:-8}

python3 -m verl.trainer.main_ppo \
    trainer.v1.trainer_mode=digen \
    algorithm.adv_estimator=flow_grpo \
    algorithm.global_std=false \
    data.train_files=$train_path \
    data.val_files=$test_path \
    data.train_batch_size=24 \
    actor_rollout_ref.model.path=$model_name \
    +digen.model.arch=sd3 \
    actor_rollout_ref.model.lora_rank=32 \
    actor_rollout_ref.model.lora_alpha=64 \
    actor_rollout_ref.actor.optim.lr=3e-4 \
    actor_rollout_ref.actor.optim.weight_decay=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=12 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-4 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.pipeline.height=512 \
    actor_rollout_ref.rollout.pipeline.width=512 \
    actor_rollout_ref.rollout.pipeline.num_inference_steps=10 \
    actor_rollout_ref.rollout.pipeline.guidance_scale=4.5 \
    actor_rollout_ref.rollout.algo.noise_level=0.7 \
    actor_rollout_ref.rollout.algo.sde_window_size=2 \
    actor_rollout_ref.rollout.algo.sde_window_range="[0,5]" \
    +digen.reward.name=http \
    +digen.reward.kwargs.url=$GENEVAL_SERVER_URL \
    +digen.reward.kwargs.protocol=pickle \
    +digen.reward.kwargs.extra_fields.only_strict=false \
    +digen.placement=disaggregated \
    +digen.pools.rollout.devices=$((NUM_GPUS / 2)) \
    +digen.pools.trainer.devices=$((NUM_GPUS / 2)) \
    +digen.gap.enable=true \
    trainer.logger='["console", "wandb"]' \
    trainer.project_name=flow_grpo \
    trainer.experiment_name=sd35_medium_geneval_lora \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node=$NUM_GPUS \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=25 \
    trainer.total_training_steps=500 "$@"
