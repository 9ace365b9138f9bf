# Qwen-Image, LoRA, PickScore reward, colocated (every GPU generates, scores and trains).
# Data: Flow-GRPO's dataset/pickscore/{train,test}.txt.
set -x

WORKSPACE=${WORKSPACE:-$HOME}
train_path=${TRAIN_FILES:-$WORKSPACE/flow_grpo/dataset/pickscore/train.txt}
test_path=${VAL_FILES:-$WORKSPACE/flow_grpo/dataset/pickscore/test.txt}
model_name=${MODEL_PATH:-Qwen/Qwen-Image}
pickscore=${PICKSCORE_PATH:-yuvalkirstain/PickScore_v1}
clip_processor=${CLIP_PROCESSOR_PATH:-laion/CLIP-ViT-H-14-laion2B-s32B-b79K}
NUM_GPUS=${NUM_GPUS:-8}

python3 -m verl.trainer.main_ppo \
    trainer.v1.trainer_mode=digen \
    algorithm.adv_estimator=flow_grpo \
    data.train_files=$train_path \
    data.val_files=$test_path \
    data.train_batch_size=16 \
    actor_rollout_ref.model.path=$model_name \
    +digen.model.arch=qwen_image \
    actor_rollout_ref.model.lora_rank=64 \
    actor_rollout_ref.model.lora_alpha=128 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.optim.weight_decay=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-4 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.pipeline.true_cfg_scale=4.0 \
    actor_rollout_ref.rollout.pipeline.height=512 \
    actor_rollout_ref.rollout.pipeline.width=512 \
    actor_rollout_ref.rollout.pipeline.num_inference_steps=16 \
    actor_rollout_ref.rollout.algo.noise_level=0.7 \
    actor_rollout_ref.rollout.algo.sde_window_size=2 \
    actor_rollout_ref.rollout.algo.sde_window_range="[0,8]" \
    +digen.reward.name=pickscore \
    +digen.reward.kwargs.model_path=$pickscore \
    +digen.reward.kwargs.processor_path=$clip_processor \
    trainer.logger='["console", "wandb"]' \
    trainer.project_name=flow_grpo \
    trainer.experiment_name=qwen_image_pickscore_lora \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node=$NUM_GPUS \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=25 \
    trainer.total_training_steps=500 "$@"
