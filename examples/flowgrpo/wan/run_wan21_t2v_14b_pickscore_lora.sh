# Wan2.1-T2V-14B, LoRA, text-to-video: PickScore on every frame (averaged) plus temporal smoothness,
# disaggregated with GAP and one-step-off async training (TCSS), 33 frames at 480x832.
# Data: Flow-GRPO's dataset/pickscore/{train,test}.txt (or any prompt file: txt, jsonl, parquet).
# GAP trains each group as it arrives, so advantages use the group's std (algorithm.global_std=false).
set -x

WORKSPACE=${WORKSPACE:-$HOME}
train_path=${TRAIN_FILES:-$WORKSPACE/flow_grpo/dataset/pickscore/train.txt}
test_path=${VAL_FILES:-$WORKSPACE/flow_grpo/dataset/pickscore/test.txt}
model_name=${MODEL_PATH:-Wan-AI/Wan2.1-T2V-14B-Diffusers}
pickscore=${PICKSCORE_PATH:-yuvalkirstain/PickScore_v1}
clip_processor=${CLIP_PROCESSOR_PATH:-laion/CLIP-ViT-H-14-laion2B-s32B-b79K}
NUM_GPUS=${NUM_GPUS:-8}

python3 -m verl.trainer.main_ppo \
    trainer.v1.trainer_mode=digen \
    algorithm.adv_estimator=flow_grpo \
    algorithm.global_std=false \
    data.train_files=$train_path \
    data.val_files=$test_path \
    data.train_batch_size=16 \
    actor_rollout_ref.model.path=$model_name \
    +digen.model.arch=wan \
    actor_rollout_ref.model.lora_rank=32 \
    actor_rollout_ref.model.lora_alpha=64 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.optim.weight_decay=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-4 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.pipeline.height=480 \
    actor_rollout_ref.rollout.pipeline.width=832 \
    +digen.sampling.num_frames=33 \
    actor_rollout_ref.rollout.pipeline.num_inference_steps=16 \
    actor_rollout_ref.rollout.pipeline.guidance_scale=5.0 \
    actor_rollout_ref.rollout.algo.noise_level=0.7 \
    actor_rollout_ref.rollout.algo.sde_window_size=2 \
    actor_rollout_ref.rollout.algo.sde_window_range="[0,8]" \
    +digen.model.vae_decode_chunk=1 \
    +digen.reward.name=weighted \
    "+digen.reward.components=[{name: pickscore, weight: 1.0, kwargs: {model_path: $pickscore, processor_path: $clip_processor}}, {name: temporal_smoothness, weight: 0.5}]" \
    +digen.placement=disaggregated \
    +digen.pools.rollout.devices=$((NUM_GPUS / 2)) \
    +digen.pools.trainer.devices=$((NUM_GPUS / 2)) \
    +digen.fsdp.enable=true \
    +digen.gap.enable=true \
    +digen.async.max_staleness=1 \
    trainer.logger='["console", "wandb"]' \
    trainer.project_name=flow_grpo \
    trainer.experiment_name=wan21_t2v_14b_pickscore_lora \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node=$NUM_GPUS \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=25 \
    trainer.total_training_steps=500 "$@"
