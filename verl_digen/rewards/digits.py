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

``python -m verl_digen.rewards.digits RUN_DIR [--png OUT]`` checks a digits run for reward
hacking: it re-scores the run's validation grids with two classifiers of other kinds and
measures the distance to the nearest real digit (see :func:`check_images`).
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import torch

from verl_digen.rewards.base import RewardFn, register_reward

__all__ = ["DigitClassifierReward", "requested_digit", "fit_digit_classifier", "grid_cells", "check_images"]

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


# ---------------------------------------------------------------------------- checking a run
#
# The reward model is one logistic regression; a policy trained against it could learn to please
# that classifier without drawing better digits (reward hacking). `python -m
# verl_digen.rewards.digits RUN_DIR` re-scores a digits run's validation grids with classifiers
# of other kinds, fitted on all the digits (k-nearest neighbours and an RBF support-vector
# machine), and measures how far the images are from the nearest real digit: agreement of the
# independent classifiers, at a steady distance to the data, says the digits really got better.


def grid_cells(path: str) -> tuple[torch.Tensor, list[str]]:
    """The images ``[N, 3, 8, 8]`` in [0, 1] and prompts of a validation grid PNG of 8x8 images
    (``verl_digen.trainer.validation.save_grid_png``: 2-pixel padding, prompts in the metadata)."""
    import json
    import math

    from PIL import Image

    with Image.open(path) as image:
        prompts = json.loads(image.info["prompts"]) if "prompts" in image.info else None
        grid = np.asarray(image.convert("RGB"))
    if prompts is None:
        raise ValueError(f"validation grid {path!r} has no 'prompts' metadata")
    n, pad, size = len(prompts), 2, 8
    nrow = math.ceil(math.sqrt(n))
    cols, rows = min(nrow, n), math.ceil(n / nrow)
    if grid.shape[:2] != (rows * (size + pad) + pad, cols * (size + pad) + pad):
        raise ValueError(f"validation grid {path!r} is {grid.shape[1]}x{grid.shape[0]} pixels; "
                         f"expected {n} 8x8 images in {cols} columns")
    cells = []
    for k in range(n):
        r, c = divmod(k, nrow)
        y, x = pad + r * (size + pad), pad + c * (size + pad)
        cells.append(grid[y : y + size, x : x + size])
    images = torch.from_numpy(np.stack(cells)).permute(0, 3, 1, 2).float() / 255.0
    return images, prompts


@functools.lru_cache(maxsize=1)
def _independent_classifiers():
    from sklearn.datasets import load_digits
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.svm import SVC

    data = load_digits()
    x = data.data / 16.0
    knn = KNeighborsClassifier(n_neighbors=10, weights="distance").fit(x, data.target)
    svc = SVC(probability=True, random_state=0).fit(x, data.target)
    return {"knn": knn, "svc": svc}


def check_images(images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """Mean probability of the requested digit under the reward's classifier (``reward``) and two
    independent ones (``knn``, ``svc``), and the mean distance to the nearest real digit
    (``nearest_real``, pixels in [0, 1])."""
    wanted = np.array([requested_digit(p) for p in prompts])
    features = DigitClassifierReward.features(images)
    out = {"reward": float(DigitClassifierReward().score_images(images, list(prompts)).mean())}
    for name, classifier in _independent_classifiers().items():
        out[name] = float(classifier.predict_proba(features)[np.arange(len(wanted)), wanted].mean())
    distance, _ = _independent_classifiers()["knn"].kneighbors(features, n_neighbors=1)
    out["nearest_real"] = float(distance.mean())
    return out


def _sheet(grids: list[tuple[str, torch.Tensor]], path: str, scale: int = 6) -> None:
    """Grids side by side (one row of ten digits per line of prompts), upscaled, with titles."""
    from PIL import Image, ImageDraw

    tiles = []
    for title, images in grids:
        n = images.shape[0]
        rows = math.ceil(n / 10)
        canvas = np.full((rows * 10 + 2, 10 * 10 + 2), 64, dtype=np.uint8)
        for k in range(n):
            r, c = divmod(k, 10)
            canvas[2 + r * 10 : 10 + r * 10, 2 + c * 10 : 10 + c * 10] = (images[k].mean(0).numpy() * 255).round()
        tile = Image.fromarray(canvas).resize((canvas.shape[1] * scale, canvas.shape[0] * scale), Image.NEAREST)
        framed = Image.new("L", (tile.width, tile.height + 18), 255)
        framed.paste(tile, (0, 18))
        ImageDraw.Draw(framed).text((2, 3), title, fill=0)
        tiles.append(framed)
    sheet = Image.new("L", (sum(t.width for t in tiles) + 8 * (len(tiles) - 1), max(t.height for t in tiles)), 255)
    x = 0
    for t in tiles:
        sheet.paste(t, (x, 0))
        x += t.width + 8
    sheet.save(path)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import glob
    import os

    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.rewards.digits",
        description="Re-score a digits run's validation grids with independent classifiers; "
        "optionally save the first and last grids side by side.",
    )
    parser.add_argument("run_dir", help="a run directory of the digits preset (with val/val_step*.png)")
    parser.add_argument("--png", help="write the first and last validation grids side by side here")
    args = parser.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.run_dir, "val", "val_step*.png")))
    if not paths:
        parser.error(f"no validation grids in {os.path.join(args.run_dir, 'val')} (run with trainer.test_freq > 0)")
    print(f"{'step':>6} {'reward':>7} {'knn':>7} {'svc':>7} {'nearest_real':>12}")
    first_last = []
    for path in paths:
        step = int(os.path.basename(path)[len("val_step") : -len(".png")])
        images, prompts = grid_cells(path)
        scores = check_images(images, prompts)
        print(f"{step:>6} {scores['reward']:>7.3f} {scores['knn']:>7.3f} {scores['svc']:>7.3f} "
              f"{scores['nearest_real']:>12.3f}")
        if path in (paths[0], paths[-1]):
            first_last.append((f"step {step}: reward {scores['reward']:.3f}", images))
    if args.png:
        _sheet(first_last, args.png)
        print(f"[verl-digen] grids: {os.path.abspath(args.png)}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
