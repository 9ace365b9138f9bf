"""``digit_classifier``: the probability that an image shows the digit its prompt asks for.

The reward of the toy digits generator (:mod:`verl_digen.models.toy`). A multinomial logistic
regression (scikit-learn) is fitted on scikit-learn's 8x8 handwritten digits, the data the toy
generator was pretrained on; the reward of an image is the classifier's probability of the
digit named in its prompt ("a handwritten digit 7", "the number seven": a numeral or a word).

Fitting takes about a second and is deterministic (lbfgs, fixed split); it is done once per
process. A quarter of the data (stratified, ``random_state=0``) is held out and the accuracy on
it is kept as :attr:`DigitClassifierReward.heldout_accuracy` (about 0.97), so the reward's own
quality is on record.

Images are turned into the data's format: grey (mean of RGB), and average-pooled to 8x8 when
they are larger.

``python -m verl_digen.rewards.digits_check RUN_DIR [--png OUT]`` checks a digits run for
reward hacking (:mod:`verl_digen.rewards.digits_check`).
"""

from __future__ import annotations

import functools
import re

import numpy as np
import torch

from verl_digen.rewards.base import RewardFn, register_reward

__all__ = ["DigitClassifierReward", "requested_digit", "fit_digit_classifier"]

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TOKEN = re.compile(r"[a-z]+|[0-9]+")


def requested_digit(prompt: str) -> int:
    """The digit a prompt asks for: the one numeral 0-9 or number word (zero..nine) in it.

    Raises ``ValueError`` naming the prompt when it names no digit or several different ones.
    """
    found = set()
    for token in _TOKEN.findall(prompt.lower()):
        if token.isdigit() and len(token) == 1:
            found.add(int(token))
        elif token in DIGIT_WORDS:
            found.add(DIGIT_WORDS.index(token))
    if len(found) != 1:
        what = "names no digit" if not found else f"names several digits {sorted(found)}"
        raise ValueError(
            f"reward 'digit_classifier': prompt {prompt!r} {what}; it needs exactly one numeral 0-9 "
            "or number word (zero..nine)"
        )
    return found.pop()


@functools.lru_cache(maxsize=4)
def fit_digit_classifier(c: float = 1.0, holdout: float = 0.25):
    """``(classifier, held-out accuracy)``: logistic regression on scikit-learn's digits in [0, 1],
    fitted on a stratified ``1 - holdout`` split (``random_state=0``)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = data.data / 16.0
    x_fit, x_held, y_fit, y_held = train_test_split(
        x, data.target, test_size=holdout, random_state=0, stratify=data.target
    )
    classifier = LogisticRegression(C=c, max_iter=5000).fit(x_fit, y_fit)
    return classifier, float(classifier.score(x_held, y_held))


@register_reward("digit_classifier")
class DigitClassifierReward(RewardFn):
    """Probability of the requested digit under a logistic-regression classifier of 8x8 digits.

    ``c``: inverse regularisation strength of the classifier (scikit-learn's ``C``).
    """

    def __init__(self, c: float = 1.0) -> None:
        if not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 and np.isfinite(c)):
            raise ValueError(f"reward 'digit_classifier': argument 'c' must be a finite number > 0, got {c!r}")
        self.classifier, self.heldout_accuracy = fit_digit_classifier(float(c))

    @staticmethod
    def features(images: torch.Tensor) -> np.ndarray:
        """``[N, 3, H, W]`` in [0, 1] -> ``[N, 64]``: grey, average-pooled to 8x8 (H, W multiples of 8)."""
        grey = images.float().mean(dim=1, keepdim=True)
        height, width = grey.shape[-2:]
        if height % 8 or width % 8:
            raise ValueError(
                f"reward 'digit_classifier': images must be 8x8 or a multiple of it, got {height}x{width}"
            )
        if (height, width) != (8, 8):
            grey = torch.nn.functional.avg_pool2d(grey, (height // 8, width // 8))
        return grey.flatten(1).cpu().double().numpy()

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``[N, 10]``."""
        proba = self.classifier.predict_proba(self.features(images))
        return torch.from_numpy(proba).float()

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        wanted = torch.tensor([requested_digit(p) for p in prompts], dtype=torch.long)
        return self.probabilities(images).gather(1, wanted[:, None])[:, 0]
