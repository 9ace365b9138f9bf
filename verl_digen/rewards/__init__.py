"""Reward functions for diffusion RL:
``reward(images [B,3,H,W] | videos [B,3,F,H,W], prompts, metadata=None) -> [B]``.

Importing this package registers the built-in rewards:

* ``jpeg_compressibility`` / ``jpeg_incompressibility`` (DDPO),
* ``brightness`` / ``colorfulness`` (weight-free image statistics),
* ``temporal_smoothness`` (weight-free, video only),
* ``digit_classifier`` (probability of the prompt's digit; the toy digits model's reward),
* ``clip_score`` (local ``transformers`` CLIP checkpoint; transformers is imported lazily),
* ``http`` (remote reward server: our JSON protocol or the flow_grpo / veRL-Omni pickle one),
* ``ocr`` (text rendering: 1 - normalised edit distance to the ground truth; ``[ocr]`` extra),
* ``pickscore``, ``hpsv2``, ``aesthetic`` (preference models, local transformers checkpoints; HPSv2.1
  also from its open_clip ``.pt``), ``imagereward`` (ImageReward's ``.pt`` on transformers' BLIP),
* ``vlm_judge`` (a VLM behind an OpenAI-compatible endpoint; UnifiedReward template),
* ``weighted`` (weighted sum of other rewards),
* ``custom`` (a ``compute_score`` function from a user's file, veRL's ``reward.custom_reward_function``).

Build one with :func:`build_reward` or :func:`build_reward_from_config`.
"""

from verl_digen.rewards.base import (
    RewardFn,
    UnknownRewardError,
    build_reward,
    build_reward_from_config,
    register_reward,
    registered_rewards,
    reward_class,
)
from verl_digen.rewards.custom import CustomFunctionReward, CustomRewardError
from verl_digen.rewards.factory import RewardFactoryReward
from verl_digen.rewards.clip_score import ClipScoreReward, build_tiny_clip
from verl_digen.rewards.digits import DigitClassifierReward, requested_digit
from verl_digen.rewards.http_client import (
    HttpReward,
    RewardServerError,
    decode_images_png_b64,
    encode_images_png_b64,
)
from verl_digen.rewards.ocr import OcrReward, ocr_score
from verl_digen.rewards.preference import AestheticReward, HpsV2Reward, PickScoreReward
from verl_digen.rewards.image_reward import ImageRewardReward
from verl_digen.rewards.safe_pickle import UnsafePickleError, safe_dumps, safe_loads
from verl_digen.rewards.image_stats import BrightnessReward, ColorfulnessReward, colorfulness
from verl_digen.rewards.jpeg import JpegCompressibilityReward, JpegIncompressibilityReward, jpeg_size_kb
from verl_digen.rewards.video import TemporalSmoothnessReward, temporal_smoothness
from verl_digen.rewards.vlm_judge import VlmJudgeReward
from verl_digen.rewards.weighted import WeightedReward

__all__ = [
    "RewardFn",
    "UnknownRewardError",
    "build_reward",
    "build_reward_from_config",
    "register_reward",
    "registered_rewards",
    "reward_class",
    "BrightnessReward",
    "ColorfulnessReward",
    "colorfulness",
    "JpegCompressibilityReward",
    "JpegIncompressibilityReward",
    "jpeg_size_kb",
    "TemporalSmoothnessReward",
    "temporal_smoothness",
    "ClipScoreReward",
    "DigitClassifierReward",
    "requested_digit",
    "build_tiny_clip",
    "HttpReward",
    "RewardServerError",
    "encode_images_png_b64",
    "decode_images_png_b64",
    "OcrReward",
    "PickScoreReward",
    "HpsV2Reward",
    "AestheticReward",
    "ImageRewardReward",
    "ocr_score",
    "UnsafePickleError",
    "safe_loads",
    "safe_dumps",
    "WeightedReward",
    "VlmJudgeReward",
    "CustomFunctionReward",
    "RewardFactoryReward",
    "CustomRewardError",
]
