"""``python -m verl_digen.rewards.digits_check RUN_DIR [--png OUT]``: did a digits run draw better
digits, or only please its reward model?

The ``digit_classifier`` reward is one logistic regression; a policy trained against it could
learn to please that classifier without drawing better digits (reward hacking). This command
re-scores a digits run's validation grids (``<run>/val/val_step*.png``: held-out prompts,
deterministic ODE samples) with classifiers of other kinds, fitted on all of scikit-learn's
digits (k-nearest neighbours, and an RBF support-vector machine with calibrated probabilities),
and measures the mean distance from each image to the nearest real digit. Independent
classifiers that agree, at a steady distance to the data, say the digits really got better; a
growing distance says the policy is leaving the data (what a run without the KL term does).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from verl_digen.rewards.digits import DigitClassifierReward, requested_digit

__all__ = ["grid_cells", "check_images", "main"]


def grid_cells(path: str) -> tuple[torch.Tensor, list[str]]:
    """The images ``[N, 3, 8, 8]`` in [0, 1] and prompts of a validation grid PNG of 8x8 images
    (``verl_digen.workers.validation.save_grid_png``: 2-pixel padding, prompts in the metadata)."""
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
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.datasets import load_digits
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.svm import SVC

    data = load_digits()
    x = data.data / 16.0
    knn = KNeighborsClassifier(n_neighbors=10, weights="distance").fit(x, data.target)
    # Probabilities by Platt scaling on cross-validated decision values (deterministic folds).
    svc = CalibratedClassifierCV(SVC(), ensemble=False).fit(x, data.target)
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
    import json
    import os

    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.rewards.digits_check",
        description="Re-score a digits run's validation grids with independent classifiers (next to the "
        "training reward's 10-step moving average); optionally save the first and last grids side by side.",
    )
    parser.add_argument("run_dir", help="a run directory of the digits preset (with val/val_step*.png)")
    parser.add_argument("--png", help="write the first and last validation grids side by side here")
    args = parser.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.run_dir, "val", "val_step*.png")))
    if not paths:
        parser.error(f"no validation grids in {os.path.join(args.run_dir, 'val')} (run with trainer.test_freq > 0)")
    # The training reward (SDE samples of the RL prompts), averaged over the 10 steps up to each
    # validation, when the run's metrics are there.
    rewards: dict[int, float] = {}
    metrics_path = os.path.join(args.run_dir, "metrics.jsonl")
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            for line in f:
                if line.strip():
                    m = json.loads(line)
                    rewards[int(m["step"])] = float(m["reward_mean"])
    print(f"{'step':>6} {'reward':>7} {'knn':>7} {'svc':>7} {'nearest_real':>12} {'train_ma10':>10}")
    first_last = []
    for path in paths:
        step = int(os.path.basename(path)[len("val_step") : -len(".png")])
        images, prompts = grid_cells(path)
        scores = check_images(images, prompts)
        window = [rewards[s] for s in range(step - 9, step + 1) if s in rewards]
        train = f"{sum(window) / len(window):.3f}" if len(window) == 10 else "-"
        print(f"{step:>6} {scores['reward']:>7.3f} {scores['knn']:>7.3f} {scores['svc']:>7.3f} "
              f"{scores['nearest_real']:>12.3f} {train:>10}")
        if path in (paths[0], paths[-1]):
            first_last.append((f"step {step}: reward {scores['reward']:.3f}", images))
    if args.png:
        _sheet(first_last, args.png)
        print(f"[verl-digen] grids: {os.path.abspath(args.png)}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
