"""The device bundle (``bash scripts/gpu_bundle.sh``): built from the package index, under the size
that may travel beside the working tree, and enough, installed as ``scripts/gpu_check.sh`` installs
it, for verl-digen, veRL, Ray (trimmed) and diffusers to import and for Ray to run a task and an
actor, in a fresh venv that holds only torch and the device's own packages (stood in from this
venv). Built for this interpreter's Python: the device's is another, and the pure-Python wheels
are the same for both; the binary ones differ only in their tag."""

from __future__ import annotations

import glob
import importlib.metadata as md
import json
import os
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_bundle  # noqa: E402

LIMIT = 64 * 2**20


def _stand_in(dest: str) -> list[str]:
    """Links to this venv's copies of the device's packages (torch among them), by top-level name."""
    os.makedirs(dest)
    linked = []
    for name in gpu_bundle.DEVICE_HAS:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        base = str(dist.locate_file(""))
        tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            src, dst = os.path.join(base, top), os.path.join(dest, top)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
        linked.append(name)
    return linked


CHECK = r"""
import importlib.metadata as md, json, os, sys
import verl_digen, verl, ray, diffusers, torch, hydra, tensordict, transfer_queue
import verl.trainer.main_ppo, verl_digen.main, ray.util.collective
plugins = [e.name for e in md.entry_points(group="verl.plugins")]
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
@ray.remote
def square(x):
    return x * x
@ray.remote
class Counter:
    def __init__(self):
        self.n = 0
    def add(self):
        self.n += 1
        return self.n
c = Counter.remote()
ray.get(c.add.remote())
result = {"square": ray.get(square.remote(7)), "count": ray.get(c.add.remote()), "plugins": plugins,
          "files": {m.__name__: m.__file__ for m in (verl_digen, verl, ray, diffusers, torch)}}
ray.shutdown()
print("RESULT " + json.dumps(result))
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_the_bundle_fits_and_imports_in_a_venv_with_only_torch_and_the_devices_packages(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = tmp_path / "whl"
    build = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_bundle.py"), "--python-version", version,
                            "--out", str(out)], capture_output=True, text=True, timeout=400)
    if "pip download failed" in build.stderr:
        pytest.fail(f"the package index is unreachable from here; the bundle test needs it:\n{build.stderr[-2000:]}")
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    report = json.loads(build.stdout.strip().splitlines()[-1])
    wheels = glob.glob(str(out / "*.whl"))
    size = sum(os.path.getsize(w) for w in wheels)
    assert report["bundle_bytes"] == size and report["wheels"] == len(wheels)
    assert size + report["tree_bytes"] < LIMIT, report
    assert report["ray_bytes"] < report["ray_bytes_before"] / 1.5, report  # the trimmed Ray
    names = {os.path.basename(w).split("-")[0].lower() for w in wheels}
    assert {"verl", "ray", "diffusers", "verl_digen"} <= names and "torch" not in names

    stand_in = str(tmp_path / "device")
    linked = _stand_in(stand_in)
    assert "torch" in linked
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    (site,) = glob.glob(str(env_dir / "lib" / "python*" / "site-packages"))
    with open(os.path.join(site, "device.pth"), "w", encoding="utf-8") as f:
        f.write(stand_in + "\n")
    target = str(tmp_path / "site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", target, *wheels], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS")}
    env["PYTHONPATH"] = target
    run = subprocess.run([str(env_dir / "bin" / "python"), "-c", CHECK], capture_output=True, text=True,
                         env=env, cwd=str(tmp_path), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["square"] == 49 and result["count"] == 2
    assert "digen" in result["plugins"]
    for mod in ("verl_digen", "verl", "ray", "diffusers"):
        assert result["files"][mod].startswith(target), result["files"]
    assert result["files"]["torch"].startswith(stand_in), result["files"]
