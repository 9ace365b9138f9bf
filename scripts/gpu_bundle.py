"""Build the wheels a GPU machine without a package index lacks, for ``bash scripts/gpu_bundle.sh``.

The device image (an x86-64 machine with CUDA PyTorch and a long list of packages, but no network)
runs ``scripts/gpu_check.sh``, which installs every wheel of the bundle folder with ``pip install
--no-index --no-deps --target`` and puts that folder on ``PYTHONPATH`` behind the device's own
site-packages' torch (a CUDA torch is never in the bundle). Everything that travels to the device,
the working tree and this folder, must stay under 64 MiB, so:

* only the packages the device lacks are downloaded (``MISSING``: what ``import verl_digen, verl,
  ray, diffusers`` and a run import, checked by ``tests/e2e/test_gpu_bundle_e2e.py`` in a venv
  that has only torch and the device's own packages), at the versions of
  ``scripts/constraints.txt`` (what the suite is run with);
* Ray's wheel (79 MB) is unpacked, the libraries a run never imports (Java jars, RLlib, Tune,
  Train, Serve, Data, LLM, the dashboard's web client) are removed, and it is packed again with
  the ``wheel`` package, which writes a RECORD matching the files left (``python -m wheel
  unpack`` / ``pack`` from the ``wheel`` wheel itself, put on ``sys.path``: no install needed);
* verl-digen itself is built as a wheel from the checkout (veRL finds the plugin through its entry
  point, which needs the installed metadata).

Usage: ``python scripts/gpu_bundle.py [--python-version 3.12] [--out .whl]``; the size of the
bundle is printed as JSON on the last line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the device's image already holds (its package list as last read, 2026-11-17): the CUDA torch
# among them. tests/e2e/test_gpu_bundle_e2e.py stands these in from this venv to check the bundle.
DEVICE_HAS = (
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc",
    "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer", "chex", "click", "cloudpickle",
    "cmake", "colorama", "contourpy", "coverage", "cuda-bindings", "cuda-core", "cuda-pathfinder",
    "cuda-toolkit", "cupy-cuda13x", "cycler", "cython", "diffrax", "e3nn", "einops", "equinox", "etils",
    "execnet", "filelock", "flatbuffers", "flax", "fonttools", "formulaic", "frozenlist", "fsspec",
    "gpytorch", "grpcio", "h11", "h5py", "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize",
    "hypothesis", "idna", "imageio", "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt",
    "jax-cuda13-plugin", "jaxlib", "jaxtyping", "jinja2", "joblib", "kiwisolver", "lazy-loader",
    "lightning", "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml", "markdown",
    "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py", "mpmath",
    "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind", "narwhals", "networkx",
    "ninja", "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas", "nvidia-cuda-cupti",
    "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile",
    "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-ml-py",
    "nvidia-nccl-cu13", "nvidia-nvjitlink", "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir",
    "onnxruntime", "onnxscript", "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx",
    "optimistix", "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip",
    "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow", "pybind11",
    "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions", "pytest",
    "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist", "python-dateutil",
    "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu", "safetensors",
    "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn", "sentencepiece",
    "sentence-transformers", "setuptools", "shellingham", "simplejson", "six", "sortedcontainers",
    "statsmodels", "sympy", "tabulate", "tensorboard", "tensorboard-data-server", "tensorstore",
    "threadpoolctl", "tifffile", "tiktoken", "timm", "tokenizers", "toolz", "torch", "torchaudio",
    "torchdiffeq", "torch-geometric", "torchmetrics", "torchvision", "tqdm", "transformers", "treescope",
    "triton", "typer", "typing-extensions", "typing-inspect", "urllib3", "uvloop", "wadler-lindig",
    "werkzeug", "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
)

# The packages verl-digen needs (its requirements, veRL's verl-core extra, Ray's default extra)
# that the device's image lacks (docs of the device: its package list). Left out on purpose,
# because no import of a run reaches them and they are large: wandb, av, torchcodec, py-spy,
# cryptography, opencensus and opentelemetry (Ray's dashboard metrics; the jobs start Ray with
# include_dashboard=False, so its agent runs in its minimal mode), google-api-core, qwen-vl-utils,
# mathruler, nvtx and veRL's pytest plugins. transformers is the device's own (5.17; the
# constraints pin 5.10.4, 11 MB that the budget cannot spare): `--also transformers` carries it.
MISSING = (
    "verl", "ray", "diffusers", "hydra-core", "omegaconf", "antlr4-python3-runtime", "tensordict", "pyvers",
    "orjson", "importlib-metadata", "codetiming", "dill", "datasets", "multiprocess", "pylatexenc",
    "transferqueue", "pyzmq", "msgspec", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core",
    "annotated-types", "typing-inspection", "jsonschema", "jsonschema-specifications", "referencing",
    "rpds-py", "aiohttp-cors", "colorful", "smart-open", "cachetools", "torchdata",
)

# Published as source only (pure Python): built into a wheel here, which any Python version takes.
SDIST_ONLY = ("antlr4-python3-runtime",)

# Ray's top-level folders that a run (ray.init, actors, placement groups, ray.util.collective)
# never imports.
RAY_DROP = ("ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/serve", "ray/llm", "ray/data",
            "ray/workflow", "ray/dashboard/client/build")

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def pins(path: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file, by canonical name."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                out[canon(name)] = version.strip()
    return out


def canon(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def download(specs: list[str], dest: str, python_version: str) -> None:
    """Binary wheels for the device's interpreter and platform (pure-Python wheels match any)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    try:
        run(cmd + specs)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"gpu_bundle: pip download failed (exit {e.returncode}): is the package index reachable "
                         f"from here? The bundle is downloaded from it ({' '.join(specs[:3])} ...)") from None


def trim_ray(wheel_path: str, tools: str, dest: str) -> str:
    """Ray's wheel without :data:`RAY_DROP`, repacked by the ``wheel`` package (fresh RECORD)."""
    env = {**os.environ, "PYTHONPATH": tools}
    with tempfile.TemporaryDirectory() as tmp:
        run([sys.executable, "-m", "wheel", "unpack", "-d", tmp, wheel_path], env=env)
        (tree,) = glob.glob(os.path.join(tmp, "ray-*"))
        for rel in RAY_DROP:
            shutil.rmtree(os.path.join(tree, rel), ignore_errors=True)
        os.remove(wheel_path)
        run([sys.executable, "-m", "wheel", "pack", "-d", dest, tree], env=env)
    (out,) = glob.glob(os.path.join(dest, "ray-*.whl"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_bundle.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--python-version", default="3.12", help="the device's Python (default 3.12)")
    p.add_argument("--out", default=os.path.join(ROOT, ".whl"), help="the bundle folder (emptied first)")
    p.add_argument("--constraints", default=os.path.join(ROOT, "scripts", "constraints.txt"))
    p.add_argument("--also", action="append", default=[], help="another package to carry (pinned by the constraints)")
    p.add_argument("--limit-mib", type=float, default=64.0, help="what may travel: bundle + working tree")
    args = p.parse_args(argv)

    pinned = pins(args.constraints)
    names = [*MISSING, *args.also]
    unpinned = [n for n in names if canon(n) not in pinned]
    if unpinned:
        raise SystemExit(f"gpu_bundle: no version for {unpinned} in {args.constraints}")
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    exclude = os.path.join(ROOT, ".git", "info", "exclude")
    rel = "/" + os.path.relpath(out, ROOT) + "/"
    if os.path.isdir(os.path.dirname(exclude)) and not rel.startswith("/.."):
        lines = open(exclude, encoding="utf-8").read().split("\n") if os.path.exists(exclude) else []
        if rel not in lines:
            with open(exclude, "a", encoding="utf-8") as f:
                f.write(rel + "\n")

    download([f"{n}=={pinned[canon(n)]}" for n in names if n not in SDIST_ONLY], out, args.python_version)
    for n in SDIST_ONLY:
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, f"{n}=={pinned[canon(n)]}"])
    with tempfile.TemporaryDirectory() as tools:
        download(["wheel>=0.45"], tools, args.python_version)
        (tool,) = glob.glob(os.path.join(tools, "wheel-*.whl"))
        (ray_wheel,) = glob.glob(os.path.join(out, "ray-*.whl"))
        before = os.path.getsize(ray_wheel)
        ray_wheel = trim_ray(ray_wheel, tool, out)
    # verl-digen from the checkout, without its dependencies (they are the wheels above or the device's).
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, ROOT])

    wheels = sorted(glob.glob(os.path.join(out, "*.whl")))
    for w in wheels:  # every wheel readable, RECORD included
        with zipfile.ZipFile(w) as z:
            bad = z.testzip()
            if bad:
                raise SystemExit(f"gpu_bundle: {w}: corrupt member {bad}")
    size = sum(os.path.getsize(w) for w in wheels)
    tracked = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
    tree = sum(os.path.getsize(os.path.join(ROOT, f.decode())) for f in tracked
               if f and os.path.isfile(os.path.join(ROOT, f.decode())))
    report = {"wheels": len(wheels), "bundle_bytes": size, "ray_bytes_before": before,
              "ray_bytes": os.path.getsize(ray_wheel), "tree_bytes": tree,
              "total_mib": round((size + tree) / 2**20, 2), "limit_mib": args.limit_mib, "out": out}
    print(json.dumps(report))
    if size + tree > args.limit_mib * 2**20:
        print(f"gpu_bundle: bundle + tree = {report['total_mib']} MiB, over {args.limit_mib} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
