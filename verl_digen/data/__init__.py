"""Prompt data: file loading (prompt records with their ground truth), the built-in prompt set
and a resumable sampler."""

from verl_digen.data.prompts import (
    SUPPORTED_EXTENSIONS,
    PromptSampler,
    builtin_prompt_records,
    builtin_prompt_sets,
    builtin_prompts,
    load_prompt_records,
    load_prompts,
)

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "PromptSampler",
    "builtin_prompt_records",
    "builtin_prompt_sets",
    "builtin_prompts",
    "load_prompt_records",
    "load_prompts",
]
