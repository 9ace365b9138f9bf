# Qwen-Image, full fine-tuning, OCR reward from an external scorer server, written with veRL-Omni's
# multi-reward manager keys as its run_qwen_image_ocr_reward_server.sh writes them (its HTTP
# scorer client reward file, veRL-Omni installed; or point the path at any file with that
# signature). Disaggregated: FSDP2 over the trainer pool, parameters and optimizer state on the
# host (veRL's offload keys), two nodes.
# The server: python -m verl_digen.rewards.serve --reward ocr --port 19082 (the OCR scorer service's
# pickle protocol), or veRL-Omni's OCR scorer service.
# Data: veRL-Omni's data_process/qwenimage_ocr_http_service.py parquet (system prompt, negative prompt).
# GAP trains each group as it arrives, so advantages use the group's std (algorithm.global_std=false).
set -x

WORKSPACE=${WORKSPACE:-$HOME}
ocr_train_path=${TRAIN_FILES:-$WORKSPACE/data/ocr_http/train.parquet}
ocr_test_path=${VAL_FILES:-$WORKSPACE/data/ocr_http/test.parquet}
model_name=${MODEL_PATH:-Qwen/Qwen-Image}
OCR_REWARD_SERVER_URL=${OCR_REWARD_SERVER_URL:-http://localhost:19082}
REWARD_CLIENT=${REWARD_CLIENT:-pkg://verl_omni.utils.reward_score.http_scorer_client}
NUM_GPUS=${NUM_GPUS:-8}
NNODES=${NNODES:-2}

python3 -m verl.trainer.main_ppo \
    trainer.v1.trainer_mode=digen \
    algorithm.adv_estimator=flow_grpo \
    algorithm.global_std=false \
    data.train_files=$ocr_train_path \
    data.val_files=$ocr_test_path \
    data.train_batch_size=18 \
    data.max_prompt_length=290 \
    actor_rollout_ref.model.path=$model_name \
    +digen.model.arch=qwen_image \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.optim.weight_decay=0.0001 \
    actor_rollout_ref.actor.ppo_mini_batch_size=18 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=24 \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.pipeline.true_cfg_scale=4.0 \
    actor_rollout_ref.rollout.pipeline.height=512 \
    actor_rollout_ref.rollout.pipeline.width=512 \
    actor_rollout_ref.rollout.pipeline.num_inference_steps=16 \
    actor_rollout_ref.rollout.pipeline.max_sequence_length=256 \
    actor_rollout_ref.rollout.algo.noise_level=1.2 \
    actor_rollout_ref.rollout.algo.sde_type="sde" \
    actor_rollout_ref.rollout.algo.sde_window_size=2 \
    actor_rollout_ref.rollout.algo.sde_window_range="[0,8]" \
    reward.custom_reward_function.path=pkg://verl_omni.reward_loop.reward_manager.multi \
    reward.custom_reward_function.name=_multi_reward_placeholder \
    reward.reward_manager.name=MultiVisualRewardManager \
    reward.reward_manager.module.path=pkg://verl_omni.reward_loop.reward_manager \
    "+reward.reward_functions.ocr.path=$REWARD_CLIENT" \
    '+reward.reward_functions.ocr.name=compute_score' \
    '+reward.reward_functions.ocr.weight=1.0' \
    "+reward.reward_functions.ocr.server_url=$OCR_REWARD_SERVER_URL" \
    +digen.placement=disaggregated \
    +digen.pools.rollout.devices=2 \
    +digen.pools.rollout.nodes=$NNODES \
    +digen.pools.trainer.devices=6 \
    +digen.pools.trainer.nodes=$NNODES \
    +digen.gap.enable=true \
    +digen.async.max_staleness=1 \
    trainer.logger='["console", "wandb"]' \
    trainer.project_name=flow_grpo \
    trainer.experiment_name=qwen_image_ocr_reward_server_full \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node=$NUM_GPUS \
    trainer.nnodes=$NNODES \
    trainer.save_freq=50 \
    trainer.test_freq=25 \
    trainer.total_training_steps=300 "$@"
