"""OCR reward for text rendering (Flow-GRPO's text task), offline with RapidOCR.

``rapidocr-onnxruntime`` (``pip install 'verl-digen[ocr]'``) ships the PP-OCRv4 detection and
recognition models inside its wheel (ONNX, run by onnxruntime on CPU): the same model family
as the PaddleOCR reward Flow-GRPO trains with, and no download at run time.

Score, exactly Flow-GRPO's definition (``flow_grpo/ocr.py``):

1. recognise the image: detected text boxes in reading order, concatenated without separator.
   As Flow-GRPO runs it: the image goes to the recogniser as the RGB array it is (PaddleOCR,
   like RapidOCR, reads arrays as OpenCV BGR, so Flow-GRPO's reward sees red and blue swapped),
   and a box whose recognition confidence is below 0.5 is dropped (PaddleOCR's ``drop_score``)
   before Flow-GRPO's own ``> 0`` filter. ``input_order="bgr"`` hands the recogniser the order it
   expects instead, and ``drop_score`` sets the threshold;
2. normalise both the recognised text and the ground truth: remove every space (``" "``) and
   lower-case (no other normalisation: punctuation and accents count);
3. distance = 0 when the normalised ground truth is a substring of the normalised recognised
   text, else the Levenshtein edit distance (insertions, deletions, substitutions, each 1)
   between the two, capped at the ground truth's length;
4. reward = ``1 - distance / len(ground_truth)``, in ``[0, 1]``.

An image in which nothing is recognised scores 0 (distance = the ground truth's length).

``engine="vlm"`` reads the text with a VLM behind an OpenAI-compatible endpoint instead
(``vllm serve Qwen/Qwen2.5-VL-7B-Instruct``, say; the transport of the ``vlm_judge`` reward,
``vlm={"base_url": ..., "model": ..., ...}`` are its arguments): the VLM is asked to transcribe
the image's text, and its reply is the recognised text of step 1.

The ground truth of a sample is its prompt record's ``ground_truth_key`` field (default
``"ground_truth"``; see :func:`verl_digen.data.load_prompt_records`); without one, the text
between the first pair of double quotes in the prompt (Flow-GRPO's prompts read
``... a sign that says "OPEN"``). A sample with neither, or an empty ground truth, is an error
naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verl_digen.rewards.base import RewardFn, register_reward
from verl_digen.rewards.jpeg import to_uint8_hwc

__all__ = ["OcrReward", "ocr_score", "ground_truth_text", "VLM_OCR_QUESTION"]

VLM_OCR_QUESTION = (
    "Transcribe all the text visible in this image, exactly as written, in reading order. "
    "Answer with the text only; answer with nothing if there is no text."
)
ENGINES = ("rapidocr", "vlm")

_INSTALL_HINT = "pip install 'verl-digen[ocr]' (rapidocr-onnxruntime, rapidfuzz)"


def ocr_score(recognised: str, ground_truth: str) -> float:
    """Flow-GRPO's OCR reward of ``recognised`` text against ``ground_truth`` (module docstring)."""
    from rapidfuzz.distance import Levenshtein

    truth = ground_truth.replace(" ", "").lower()
    text = recognised.replace(" ", "").lower()
    if not truth:
        raise ValueError("the OCR ground truth is empty once spaces are removed")
    distance = 0 if truth in text else Levenshtein.distance(text, truth)
    return 1.0 - min(distance, len(truth)) / len(truth)


def ground_truth_text(prompt: str, record: Mapping[str, Any], key: str) -> str | None:
    """The sample's ground truth: ``record[key]``, else the first double-quoted span of ``prompt``."""
    value = record.get(key)
    if value is not None:
        return str(value)
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


@register_reward("ocr")
class OcrReward(RewardFn):
    """1 - normalised edit distance between the OCR'd text and the sample's ground truth.

    Args:
        ground_truth_key: the prompt record field holding the text to render.
        engine: ``"rapidocr"`` (PP-OCRv4, offline, the default) or ``"vlm"``.
        vlm: the VLM's arguments for ``engine="vlm"`` (those of ``vlm_judge``: ``base_url``,
            ``model``, ``api_key``, ``timeout_s``, ...); the question defaults to
            :data:`VLM_OCR_QUESTION`.
        det_model_path / rec_model_path: other PP-OCR ONNX models than the wheel's (optional).
        use_det: detect text boxes first (default; set False for images that are one text line).
        drop_score: recognitions below this confidence are dropped (Flow-GRPO's PaddleOCR: 0.5).
        input_order: ``"rgb"``: the RGB array as it is, as Flow-GRPO hands it over (the default);
            ``"bgr"``: converted to the colour order the recogniser expects.
        intra_op_threads: onnxruntime threads per model (default 1: rewards run next to training).
    """

    def __init__(
        self,
        ground_truth_key: str = "ground_truth",
        det_model_path: str | None = None,
        rec_model_path: str | None = None,
        use_det: bool = True,
        intra_op_threads: int = 1,
        engine: str = "rapidocr",
        vlm: Mapping[str, Any] | None = None,
        drop_score: float = 0.5,
        input_order: str = "rgb",
    ) -> None:
        if input_order not in ("rgb", "bgr"):
            raise ValueError(f"reward 'ocr': input_order must be 'rgb' (Flow-GRPO's) or 'bgr', got {input_order!r}")
        if isinstance(drop_score, bool) or not isinstance(drop_score, (int, float)) or not 0.0 <= drop_score <= 1.0:
            raise ValueError(f"reward 'ocr': drop_score must be a number in [0, 1], got {drop_score!r}")
        self.drop_score, self.input_order = float(drop_score), input_order
        if engine not in ENGINES:
            raise ValueError(f"reward 'ocr': engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.engine_name = engine
        self.ground_truth_key = ground_truth_key
        self.use_det = use_det
        if engine == "vlm":
            from verl_digen.rewards.vlm_judge import VlmJudgeReward

            # The prompt is never sent (it quotes the answer): "{prompt}" is filled with "".
            options = {"question_template": VLM_OCR_QUESTION + "{prompt}", "max_tokens": 64, **dict(vlm or {})}
            if "base_url" not in options or "model" not in options:
                raise ValueError("reward 'ocr': engine='vlm' needs vlm={'base_url': ..., 'model': ...}")
            self.vlm = VlmJudgeReward(**options)
            self.engine = None
            return
        if vlm:
            raise ValueError("reward 'ocr': vlm arguments are only used with engine='vlm'")
        try:
            from rapidocr_onnxruntime import RapidOCR
            import rapidfuzz  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"reward 'ocr' needs rapidocr-onnxruntime and rapidfuzz: {_INSTALL_HINT} ({exc})") from None
        if not isinstance(ground_truth_key, str) or not ground_truth_key:
            raise ValueError(f"reward 'ocr': ground_truth_key must be a non-empty string, got {ground_truth_key!r}")
        if not isinstance(intra_op_threads, int) or intra_op_threads < 1:
            raise ValueError(f"reward 'ocr': intra_op_threads must be an int >= 1, got {intra_op_threads!r}")
        # PaddleOCR 2.x's detection defaults (what Flow-GRPO's reward ran with): longest side
        # limited to 960, DB box threshold 0.6, unclip ratio 1.5. RapidOCR's own defaults
        # (shortest side raised to 736) upscale a 512x512 image 1.4x and a thin banner ~10x.
        kwargs: dict[str, Any] = {
            "intra_op_num_threads": intra_op_threads,
            "inter_op_num_threads": 1,
            "det_limit_side_len": 960,
            "det_limit_type": "max",
            "det_box_thresh": 0.6,
            "det_unclip_ratio": 1.5,
        }
        if det_model_path:
            kwargs["det_model_path"] = det_model_path
        if rec_model_path:
            kwargs["rec_model_path"] = rec_model_path
        self.engine = RapidOCR(**kwargs)
        self.ground_truth_key = ground_truth_key
        self.use_det = use_det

    def recognise(self, image_hwc_rgb: np.ndarray) -> str:
        """The text of one uint8 ``[H, W, 3]`` RGB image: the boxes recognised with confidence at
        least ``drop_score`` (and > 0), concatenated (module docstring, step 1)."""
        # RapidOCR takes arrays as OpenCV BGR; Flow-GRPO hands PaddleOCR the RGB array unchanged
        array = image_hwc_rgb if self.input_order == "rgb" else image_hwc_rgb[..., ::-1]
        result, _ = self.engine(
            np.ascontiguousarray(array), use_det=self.use_det, use_cls=False, use_rec=True, text_score=0.0,
            box_thresh=0.6, unclip_ratio=1.5,
        )
        if not result:
            return ""
        # with detection: [box, text, score] per box; without: [text, score]
        return "".join(str(item[-2]) for item in result if float(item[-1]) >= self.drop_score and float(item[-1]) > 0)

    def score_images(
        self, images: torch.Tensor, prompts: list[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        truths = []
        for index, (prompt, record) in enumerate(zip(prompts, metadata, strict=True)):
            truth = ground_truth_text(prompt, record, self.ground_truth_key)
            if truth is None or not truth.replace(" ", ""):
                raise ValueError(
                    f"reward 'ocr': sample {index} (prompt {prompt[:80]!r}) has no ground truth: give its prompt "
                    f"record a non-empty {self.ground_truth_key!r} field, or quote the text in the prompt"
                )
            truths.append(truth)
        if self.engine_name == "vlm":
            texts = self.vlm.replies(images, [""] * len(truths))
        else:
            texts = [self.recognise(array) for array in to_uint8_hwc(images).numpy()]
        return torch.tensor([ocr_score(text, truth) for text, truth in zip(texts, truths)], dtype=torch.float32)

    def __repr__(self) -> str:
        return f"OcrReward(engine={self.engine_name!r}, ground_truth_key={self.ground_truth_key!r})"
