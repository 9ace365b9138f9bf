"""The OCR reward (verl_digen.rewards.ocr): Flow-GRPO's score, and the real PP-OCRv4 models that
ship inside the rapidocr-onnxruntime wheel, on text rendered with PIL (its bundled font)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from verl_digen.rewards import build_reward, ocr_score
from verl_digen.rewards.ocr import ground_truth_text


def render(text: str, width: int = 256, height: int = 64) -> torch.Tensor:
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((8, 10), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0


def test_score_is_flow_grpo_normalised_edit_distance() -> None:
    assert ocr_score("HELLO", "hello") == 1.0  # case is ignored
    assert ocr_score("he llo", "hel lo") == 1.0  # so are spaces
    assert ocr_score("big HELLO sign", "hello") == 1.0  # contained: distance 0
    assert ocr_score("HELP", "hello") == pytest.approx(1 - 2 / 5)  # 1 substitution + 1 insertion
    assert ocr_score("", "hello") == 0.0  # nothing read: the whole length
    assert ocr_score("completely different text", "abc") == 0.0  # capped at len(ground truth)
    assert ocr_score("Hel-o", "hello") == pytest.approx(1 - 1 / 5)  # punctuation counts
    assert ocr_score("Hello!", "hello") == 1.0  # ... but the ground truth is contained
    with pytest.raises(ValueError, match="empty"):
        ocr_score("x", "  ")


def test_ground_truth_from_the_record_or_the_quoted_prompt() -> None:
    assert ground_truth_text('a sign that says "OPEN"', {}, "ground_truth") == "OPEN"
    assert ground_truth_text('a sign that says "OPEN"', {"ground_truth": "SHUT"}, "ground_truth") == "SHUT"
    assert ground_truth_text("no quotes", {"text": 12}, "text") == "12"
    assert ground_truth_text("no quotes", {}, "ground_truth") is None


@pytest.fixture(scope="module")
def ocr():
    return build_reward("ocr")


def test_real_ocr_right_text_high_wrong_and_blank_low(ocr) -> None:
    images = torch.stack([render("HELLO"), render("HELLO"), torch.ones(3, 64, 256), render("WORLD")])
    prompts = ['a sign that says "HELLO"', "a sign", "a sign", "a sign"]
    metadata = [{}, {"ground_truth": "hello"}, {"ground_truth": "HELLO"}, {"ground_truth": "HELLO"}]
    scores = ocr(images, prompts, metadata)
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    assert scores[0] >= 0.9 and scores[1] >= 0.9  # from the quoted prompt and from the record
    assert scores[2] == 0.0  # blank: nothing recognised
    assert scores[3] <= 0.4  # WORLD vs HELLO: 4 of 5 letters differ... except the shared L/O
    assert ocr.recognise((render("HELLO").permute(1, 2, 0) * 255).round().byte().numpy()).upper() == "HELLO"


def test_missing_ground_truth_is_a_named_error(ocr) -> None:
    with pytest.raises(ValueError, match=r"sample 1 .*has no ground truth.*'ground_truth'"):
        ocr(torch.ones(2, 3, 32, 32), ['"A"', "no quotes"], [{}, {}])


def test_vlm_engine_scores_the_transcript_and_never_sends_the_prompt(loopback_no_proxy) -> None:
    """The VLM engine over the OpenAI protocol; a local server stands in for vLLM (no VLM runs
    here) and transcribes by a fixed table."""
    import base64
    import io

    from runs import JsonHandler, serve

    seen: list[str] = []

    class Transcriber(JsonHandler):
        def do_POST(self) -> None:
            request = self.read_json()
            text, image = request["messages"][0]["content"]
            seen.append(text["text"])
            raw = base64.b64decode(image["image_url"]["url"].split(",", 1)[1])
            with Image.open(io.BytesIO(raw)) as picture:
                bright = np.asarray(picture).mean() > 128
            self.reply(200, {"choices": [{"message": {"content": "Open 24 h" if bright else "Open 2 h"}}]})

    with serve(Transcriber, None) as url:
        reward = build_reward("ocr", engine="vlm", vlm={"base_url": url, "model": "qwen-vl", "timeout_s": 10})
        images = torch.stack([torch.ones(3, 8, 8), torch.zeros(3, 8, 8)])
        scores = reward(images, ['a sign "OPEN 24H"', 'a sign "OPEN 24H"'])
    assert scores[0] == 1.0  # "open24h" == "open24h"
    assert scores[1] == pytest.approx(1 - 1 / 7)  # "open2h" vs "open24h": one insertion
    assert all("OPEN" not in q and "sign" not in q for q in seen)  # the answer never goes to the VLM
    with pytest.raises(ValueError, match="engine='vlm' needs vlm="):
        build_reward("ocr", engine="vlm")


def test_recognition_follows_flow_grpos_rule_by_default_with_knobs_for_the_other(ocr) -> None:
    """Flow-GRPO hands PaddleOCR the RGB array (which it reads as BGR) and PaddleOCR drops
    recognitions below 0.5 before Flow-GRPO's ``> 0`` filter: the default does both, on clean,
    blurred and noisy renders, coloured text included (where the channel order matters);
    ``input_order="bgr", drop_score=0`` is the other reading."""
    from PIL import ImageFilter

    rng = np.random.default_rng(0)
    arrays = []
    for text, colour in [("OPEN 24", "black"), ("Flow", (200, 30, 30)), ("ocr ok", (20, 40, 220)), ("GRPO", "green")]:
        image = Image.new("RGB", (256, 64), "white")
        ImageDraw.Draw(image).text((8, 10), text, fill=colour, font=ImageFont.load_default(size=36))
        for radius in (0.0, 1.5, 2.5):
            blurred = np.array(image.filter(ImageFilter.GaussianBlur(radius)) if radius else image).astype(np.float32)
            noisy = np.clip(blurred + rng.normal(0, 40, blurred.shape), 0, 255).astype(np.uint8)
            arrays += [blurred.astype(np.uint8), noisy]

    def reference(array: np.ndarray, order: str, drop: float) -> str:
        fed = array if order == "rgb" else array[..., ::-1]
        result, _ = ocr.engine(np.ascontiguousarray(fed), use_det=True, use_cls=False, use_rec=True, text_score=0.0,
                               box_thresh=0.6, unclip_ratio=1.5)
        return "".join(str(r[1]) for r in (result or []) if float(r[2]) >= drop and float(r[2]) > 0)

    assert (ocr.input_order, ocr.drop_score) == ("rgb", 0.5)
    other = build_reward("ocr", input_order="bgr", drop_score=0.0)
    for array in arrays:
        assert ocr.recognise(array) == reference(array, "rgb", 0.5)
        assert other.recognise(array) == reference(array, "bgr", 0.0)
    with pytest.raises(ValueError, match="input_order"):
        build_reward("ocr", input_order="hsv")
    with pytest.raises(ValueError, match="drop_score"):
        build_reward("ocr", drop_score=1.5)
