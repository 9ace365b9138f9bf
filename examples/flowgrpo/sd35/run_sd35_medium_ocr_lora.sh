# SD3.5-Medium, LoRA, OCR reward: veRL-Omni's flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora.sh
# with verl-digen's built-in OCR reward (RapidOCR: pip install 'verl-digen[ocr]') in place of its
# vLLM judge, colocated. veRL-Omni's data (data_process/sd3_ocr.py parquet) or Flow-GRPO's txt.
set -x

WORKSPACE=${WORKSPACE:-$HOME}
ocr_train_path=${TRAIN_FILES:-$WORKSPACE/flow_grpo/dataset/ocr/train.txt}
ocr_test_path=${VAL_FILES:-$WORKSPACE/flow_grpo/dataset/ocr/test.txt}
model_name=${MODEL_PATH:-stabilityai/stable-diffusion-3.5-medium}
NUM_GPUS=${NUM_GPUS:-2}

python3 -m verl.trainer.main_ppo \
    trainer.v1.trainer_mode=digen \
    algorithm.adv_estimator=flow_grpo \
    data.train_files=$ocr_train_path \
    data.val_files=$ocr_test_path \
    data.train_batch_size=8 \
    data.val_max_samples=32 \
    actor_rollout_ref.model.path=$model_name \
    +digen.model.arch=sd3 \
    actor_rollout_ref.model.lora_rank=32 \
    actor_rollout_ref.model.lora_alpha=64 \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.optim.weight_decay=0.0001 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16 \
    actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-5 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.pipeline.height=384 \
    actor_rollout_ref.rollout.pipeline.width=384 \
    actor_rollout_ref.rollout.pipeline.num_inference_steps=10 \
    actor_rollout_ref.rollout.pipeline.guidance_scale=1.0 \
    actor_rollout_ref.rollout.algo.noise_level=0.8 \
    actor_rollout_ref.rollout.algo.sde_type="cps" \
    actor_rollout_ref.rollout.algo.sde_window_size=3 \
    actor_rollout_ref.rollout.algo.sde_window_range="[0,5]" \
    actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=28 \
    +digen.reward.name=ocr \
    trainer.logger='["console", "wandb"]' \
    trainer.project_name=flow_grpo \
    trainer.experiment_name=sd35_medium_ocr_lora \
    trainer.log_val_generations=8 \
    trainer.val_before_train=False \
    trainer.n_gpus_per_node=$NUM_GPUS \
    trainer.nnodes=1 \
    trainer.save_freq=100 \
    trainer.test_freq=20 \
    trainer.total_training_steps=100 "$@"
