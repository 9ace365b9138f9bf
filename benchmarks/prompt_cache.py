"""What the prompt-embedding cache saves: measured on the tiny models, estimated for the real ones.

Part 1, tiny models (every architecture, CPU, fp32, measured here). A typical run: a prompt set
of 32 prompts, 4 groups (prompts) per step, 20 steps, the negative prompt encoded every step
where the architecture uses true CFG (SD3, Qwen-Image, Wan; FLUX and HunyuanVideo are
guidance-distilled). Per step the rollout calls ``encode_prompts(step_prompts)`` (+
``encode_prompts([negative] * 4)``), as ``begin_groups`` does. Reported:

- encode time per step without the cache (the adapter's encoders every step) and with it (a
  memory lookup), the one-off ``warm`` of the 33 prompts, and a warm start from the disk cache
  (a new cache object on the same directory, as a restarted run sees it);
- encoder calls over the run (20 or 40 without the cache, 1 with it);
- the bytes ``release_text_encoders`` frees (parameters + buffers) and their share of all the
  adapter's parameter bytes;
- exactness: how many of the 20 step batches the cache returns bit for bit as a fresh
  ``encode_prompts`` of that batch, and the largest difference otherwise (see
  ``verl_digen/models/prompt_cache.py``: batch-variant encoders, SD3 and Qwen-Image here).

Part 2, real models (estimate). Text-encoder memory in bf16 = 2 bytes x parameters, from public
parameter counts (the encoders the diffusers pipelines load):

- FLUX.1-dev: T5-XXL v1.1 encoder 4.76B (google/t5-v1_1-xxl, encoder half) + CLIP-L text
  0.123B (openai/clip-vit-large-patch14 text tower);
- SD3.5 Large / Medium: the same T5-XXL 4.76B + CLIP-L 0.123B + OpenCLIP bigG text 0.695B
  (laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text tower);
- Qwen-Image: Qwen2.5-VL-7B-Instruct, 8.29B as loaded (Qwen2_5_VLForConditionalGeneration:
  7.6B language model + 0.67B vision tower, Qwen/Qwen2.5-VL-7B-Instruct model card);
- Wan2.1-T2V-14B: UMT5-XXL encoder 5.7B (models_t5_umt5-xxl-enc-bf16.pth, 11.4 GB);
- HunyuanVideo: llava-llama-3-8b as a LlamaModel, 8.03B Llama-3-8B minus its untied 0.53B
  lm_head = 7.50B (hunyuanvideo-community/HunyuanVideo text_encoder) + CLIP-L text 0.123B.

Encode time comes from the repository's cost model (``verl_digen/sim/cost_model.py`` and the
profiles in ``verl_digen/sim/profiles``, each value with its source there): FLOPs per prompt
``2 x text_encoder_params x text_encoder_tokens`` (x2 with true CFG: the negative prompt is
encoded with every group), at the device's ``peak x mfu_forward``; ``groups_per_step`` prompts
per step. With the cache that per-step cost is zero after a one-off warm of the prompt set
(given per 1,000 unique prompts, each encoded once, the negative prompt once in all). The
step's device time is ``images_per_step`` x the cost model's per-image generate + reward +
train device-seconds (its zero-bubble accounting), the images/s bound is
:meth:`CostModel.zero_bubble_bound` with and without the encoder FLOPs. The
freed memory is also expressed as extra training samples per forward+backward pass (freed bytes
/ the cost model's activation bytes per sample) on a trainer that held the encoders. The cache's
own size (CPU memory or disk, per prompt) is the conditioning the adapters return, in bf16:
``T x D`` (+ pooled vector, + int64 mask), e.g. FLUX 512 x 4096 (T5) + 768 (CLIP).

Usage::

    python benchmarks/prompt_cache.py              # both parts (about a minute on one core)
    python benchmarks/prompt_cache.py --no-tiny    # the estimate only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time

import torch

ARCH_CFG = {"flux": False, "sd3": True, "qwen_image": True, "wan": True, "hunyuan_video": False}
NEGATIVE = "blurry, low quality"
_WORDS = {
    "subject": ["cat", "dog", "bird", "horse", "car", "boat", "house", "tree", "flower", "apple", "cake", "cup"],
    "colour": ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"],
    "place": ["on a table", "on the beach", "in the city", "under the sky", "next to a chair", "in a room"],
}

# Part 2: public parameter counts of the text encoders (see the docstring), bf16 bytes per value.
REAL = {
    # profile name: (label, text-encoder parameters held in memory, conditioning layout per prompt)
    "flux-12b": ("FLUX.1-dev", 4.76e9 + 0.123e9, {"prompt_embeds": (512, 4096, 2), "pooled": (1, 768, 2)}),
    "sd3.5-large": (
        "SD3.5 Large",
        4.76e9 + 0.123e9 + 0.695e9,
        {"prompt_embeds": (77 + 256, 4096, 2), "pooled": (1, 2048, 2)},
    ),
    "sd3.5-medium": (
        "SD3.5 Medium",
        4.76e9 + 0.123e9 + 0.695e9,
        {"prompt_embeds": (77 + 256, 4096, 2), "pooled": (1, 2048, 2)},
    ),
    "qwen-image-20b": ("Qwen-Image", 8.29e9, {"prompt_embeds": (512, 3584, 2), "mask": (512, 1, 8)}),
    "wan2.1-14b": ("Wan2.1-T2V-14B", 5.7e9, {"prompt_embeds": (512, 4096, 2)}),
    "hunyuanvideo-13b": (
        "HunyuanVideo",
        7.50e9 + 0.123e9,
        {"prompt_embeds": (256, 4096, 2), "mask": (256, 1, 8), "pooled": (1, 768, 2)},
    ),
}


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        p = f"a {rng.choice(_WORDS['colour'])} {rng.choice(_WORDS['subject'])} {rng.choice(_WORDS['place'])}"
        if rng.random() < 0.3:
            p = f"a photo of {p}, high quality"
        if p not in out:
            out.append(p)
    return out


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def bench_tiny(arch: str, *, n_prompts: int, groups: int, steps: int, cache_root: str) -> dict:
    from verl_digen.models.prompt_cache import PromptEmbeddingCache, model_cache_key
    from verl_digen.models.registry import load_adapter
    from verl_digen.models.tiny import ensure_tiny

    path = ensure_tiny(arch)
    adapter = load_adapter(path)
    cfg = ARCH_CFG[arch]
    prompts = make_prompts(n_prompts)
    rng = random.Random(1)
    schedule = [[prompts[i] for i in rng.sample(range(n_prompts), groups)] for _ in range(steps)]

    def step_encode(fn, batch):
        out = fn(batch)
        neg = fn([NEGATIVE] * len(batch)) if cfg else None
        return out, neg

    step_encode(adapter.encode_prompts, schedule[0])  # first-call overheads out of the timing
    without = [_timed(step_encode, adapter.encode_prompts, b) for b in schedule]

    key = model_cache_key(path, adapter)
    cache = PromptEmbeddingCache(adapter, model_key=key, cache_dir=os.path.join(cache_root, "disk"))
    warm = _timed(cache.warm, prompts + [NEGATIVE])
    with_cache = [_timed(step_encode, cache.encode, b) for b in schedule]
    stats = cache.stats()

    # Exactness against a fresh encode of each step's batch (before the encoders go).
    equal, max_diff = 0, 0.0
    for b in schedule:
        for got, ref in zip(step_encode(cache.encode, b), step_encode(adapter.encode_prompts, b)):
            if ref is None:
                continue
            same = all(torch.equal(got[k], ref[k]) for k in ref)
            equal += same
            for k in ref:
                max_diff = max(max_diff, (got[k].double() - ref[k].double()).abs().max().item())
    batches = steps * (2 if cfg else 1)

    restart = PromptEmbeddingCache(adapter, model_key=key, cache_dir=os.path.join(cache_root, "disk"))
    disk_warm = _timed(restart.warm, prompts + [NEGATIVE])
    assert restart.stats()["encode_calls"] == 0 and restart.stats()["disk_hits"] == n_prompts + 1

    total = sum(_bytes(m) for m in vars(adapter).values() if isinstance(m, torch.nn.Module))
    freed = cache.release_encoders()
    for b in schedule:  # the run goes on without encoders
        step_encode(cache.encode, b)
    return {
        "arch": arch,
        "cfg": cfg,
        "without_ms": 1e3 * statistics.median(without),
        "with_ms": 1e3 * statistics.median(with_cache),
        "warm_ms": 1e3 * warm,
        "disk_warm_ms": 1e3 * disk_warm,
        "run_without_ms": 1e3 * sum(without),
        "run_with_ms": 1e3 * (warm + sum(with_cache)),
        "calls_without": batches,
        "calls_with": stats["encode_calls"],
        "freed": freed,
        "freed_share": freed / total,
        "exact": f"{equal}/{batches}",
        "max_diff": max_diff,
    }


def print_tiny(rows: list[dict], *, n_prompts: int, groups: int, steps: int) -> None:
    print(f"## Tiny models (CPU, fp32, {torch.get_num_threads()} thread(s)): {n_prompts} prompts, "
          f"{groups} groups/step, {steps} steps\n")
    print("| arch | CFG | encode/step, no cache | with cache | warm (once) | warm from disk | "
          f"{steps}-step total: no cache / cache | encoder calls | freed by release | bitwise = fresh | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arch']} | {'yes' if r['cfg'] else 'no'} | {r['without_ms']:.2f} ms | {r['with_ms']:.3f} ms | "
            f"{r['warm_ms']:.1f} ms | {r['disk_warm_ms']:.1f} ms | "
            f"{r['run_without_ms']:.0f} / {r['run_with_ms']:.0f} ms | "
            f"{r['calls_without']} / {r['calls_with']} | {r['freed'] / 1024:.0f} KiB ({100 * r['freed_share']:.0f}%) | "
            f"{r['exact']} | {r['max_diff']:.1e} |"
        )
    print()


def estimate_real(device: str = "H100", prompts_once: int = 1000) -> list[dict]:
    from verl_digen.sim.cost_model import GB, CostModel, load_catalog

    catalog = load_catalog()
    dev = catalog.device(device)
    rows = []
    for name, (label, te_params, layout) in REAL.items():
        cm = CostModel.from_catalog(catalog, name, devices=[device])
        w, m = cm.workload, cm.model
        encode_step = cm.encode_seconds(w.groups_per_step, dev)
        per_image = cm.device_seconds_per_image(dev)
        step_device_s = w.images_per_step * sum(per_image.values())
        no_encoder = dataclasses.replace(cm, model=dataclasses.replace(m, text_encoder_params=0.0))
        bound, bound_cached = cm.zero_bubble_bound([device]), no_encoder.zero_bubble_bound([device])
        te_bytes = 2.0 * te_params
        cache_bytes = sum(t * d * b for t, d, b in layout.values())
        rows.append({
            "label": label,
            "te_params": te_params,
            "te_gb": te_bytes / GB,
            "hbm_share": te_bytes / (dev.hbm_gb * GB),
            "flops_per_prompt": 2.0 * m.text_encoder_params * m.text_encoder_tokens,
            "cfg": w.cfg,
            "prompts_per_step": w.groups_per_step,
            "encode_step_s": encode_step,
            "step_device_s": step_device_s,
            "encode_share": encode_step / step_device_s,
            # one pass over the prompt set (+ the negative prompt once, negligible): no CFG factor
            "warm_s": prompts_once * 2.0 * m.text_encoder_params * m.text_encoder_tokens
            / (dev.flops * dev.mfu_forward),
            "bound_gain": bound_cached / bound - 1.0,
            "extra_samples": te_bytes / cm.activation_bytes_per_sample(),
            "cache_mb": cache_bytes / 1e6,
        })
    return rows


def print_real(rows: list[dict], device: str, prompts_once: int) -> None:
    print(f"## Real models (estimate; cost model on {device}, bf16)\n")
    print("| model | text encoders | memory freed (share of HBM) | encode FLOPs/prompt | prompts/step (CFG) | "
          "encode s/step, no cache | share of step device-time | images/s bound gain | "
          f"warm {prompts_once} prompts once | + train samples/pass | cache size/prompt |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['te_params'] / 1e9:.2f} B | {r['te_gb']:.1f} GB ({100 * r['hbm_share']:.0f}%) | "
            f"{r['flops_per_prompt'] / 1e12:.1f} TFLOP | {r['prompts_per_step']} ({'x2' if r['cfg'] else 'no'}) | "
            f"{r['encode_step_s']:.2f} s | {100 * r['encode_share']:.3f}% | +{100 * r['bound_gain']:.3f}% | "
            f"{r['warm_s']:.0f} s | {r['extra_samples']:.1f} | {r['cache_mb']:.1f} MB |"
        )
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--groups", type=int, default=4, help="groups (prompts) per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for the tiny timings")
    parser.add_argument("--device", default="H100", help="device profile for the estimate")
    parser.add_argument("--no-tiny", action="store_true")
    args = parser.parse_args(argv)

    if not args.no_tiny:
        from verl_digen.models.tiny import TINY_ARCHS

        torch.set_num_threads(args.threads)
        with tempfile.TemporaryDirectory(prefix="prompt_cache_bench_") as root:
            os.environ.setdefault("VERL_DIGEN_CACHE", os.path.join(root, "models"))
            rows = [
                bench_tiny(
                    a, n_prompts=args.prompts, groups=args.groups, steps=args.steps,
                    cache_root=os.path.join(root, a),
                )
                for a in TINY_ARCHS
            ]
        print_tiny(rows, n_prompts=args.prompts, groups=args.groups, steps=args.steps)
    print_real(estimate_real(args.device, 1000), args.device, 1000)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
