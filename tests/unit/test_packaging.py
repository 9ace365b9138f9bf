"""What a user gets from `pip install verl-digen`: a wheel that holds every data file of the
package (the presets among them) and the license, next to veRL-Omni's veRL and TransferQueue, with
the requirements veRL pins. Installed into a fresh virtual environment, it runs a shipped preset
from any directory: tests/e2e/test_packaging_e2e.py."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "verl_digen")
# What the build must not see: local state of a checkout (its venv, runs, earlier builds).
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    "runs", "checkpoints", "outputs", "tensorboard_log")


PRESETS = os.path.join(REPO, "configs")


def _data_files() -> set[str]:
    """Every file of the package that is not Python source, and every preset of ``configs/``
    (which the wheel holds in ``verl_digen/config/``), as a wheel names them."""
    files = set()
    for root, dirs, names in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files |= {os.path.relpath(os.path.join(root, n), REPO) for n in names if not n.endswith((".py", ".pyc"))}
    for root, _, names in os.walk(PRESETS):
        files |= {"verl_digen/config/" + os.path.relpath(os.path.join(root, n), PRESETS) for n in names}
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel built from a copy of the checkout (the build writes build/ and *.egg-info next to
    its sources), without build isolation: the running environment's setuptools, no download."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "dist"), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (path,) = (tmp / "dist").glob("verl_digen-*.whl")
    return str(path)


def test_wheel_holds_every_data_file_of_the_package_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = _data_files()
    assert {"verl_digen/config/flux_disaggregated.yaml", "verl_digen/config/smoke/tiny.yaml"} <= data
    assert data - names == set()
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    text = zipfile.ZipFile(wheel).read(license_file).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    metadata = zipfile.ZipFile(wheel).read(license_file.replace("licenses/LICENSE", "METADATA")).decode()
    assert "License-Expression: Apache-2.0" in metadata


def test_wheel_presets_are_those_of_the_checkout(wheel):
    """The wheel's copies of configs/ are byte for byte the checkout's."""
    with zipfile.ZipFile(wheel) as z:
        for root, _, names in os.walk(PRESETS):
            for n in names:
                path = os.path.join(root, n)
                with open(path, "rb") as f:
                    assert z.read("verl_digen/config/" + os.path.relpath(path, PRESETS)) == f.read(), path


def _fresh_venv(path: str) -> str:
    """A new virtual environment whose dependencies come from the running one: a ``.pth`` line
    puts its site-packages after the venv's own (offline, and the installed torch untouched).
    A plain path line, not ``import site``: the running environment's own ``.pth`` files (an
    editable verl-digen among them) are not processed, so only the installed wheel provides
    verl_digen."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, timeout=120)
    python = os.path.join(path, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "running_env_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _fake_installed(site: str, name: str, version: str) -> None:
    """Installed-package metadata only: pip's resolver reads nothing else."""
    info = os.path.join(site, f"{name}-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    open(os.path.join(info, "RECORD"), "w").close()


def test_wheel_installs_next_to_verl_omnis_veRL_and_TransferQueue_changing_nothing(wheel, tmp_path):
    """An environment as verl-omni leaves it: veRL from its pinned git commit (0.9.0.dev0, no
    verl-core extra) and TransferQueue 0.1.8. Stand-ins, because neither can be installed here:
    their metadata in the venv's own site-packages, ahead of the running environment's packages.
    pip, offline, must find nothing to change but verl-digen itself."""
    python = _fresh_venv(str(tmp_path / "venv"))
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    _fake_installed(site, "verl", "0.9.0.dev0")
    _fake_installed(site, "TransferQueue", "0.1.8")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--dry-run", "--no-index", wheel],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (would,) = [line for line in proc.stdout.splitlines() if line.startswith("Would install")]
    assert would == "Would install verl-digen-0.1.0"


def _requirements(requires_dist: list[str], extra: str = "") -> list:
    """The requirements (``Requires-Dist`` lines) that apply without any extra, or with
    ``extra`` only."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires_dist]
    if not extra:
        return [r for r in reqs if r.marker is None]
    return [r for r in reqs if r.marker and r.marker.evaluate({"extra": extra}) and not r.marker.evaluate({"extra": ""})]


def _wheel_requires(wheel: str) -> list[str]:
    """The wheel's ``Requires-Dist`` (its METADATA: what pip reads)."""
    from email.parser import Parser

    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(z.read(name).decode()).get_all("Requires-Dist")


def test_verl_requirement_admits_the_tested_veRL_and_the_one_verl_omni_pins(wheel):
    """verl-omni pins veRL to a git commit reporting 0.9.0.dev and TransferQueue==0.1.8: our
    requirements must leave both as they are (patches/README.md, "Supported veRL versions")."""
    from packaging.specifiers import SpecifierSet

    import verl_digen

    reqs = _requirements(_wheel_requires(wheel))
    (verl,) = [r for r in reqs if r.name == "verl"]
    assert verl.extras == {"verl-core"} and verl.specifier == SpecifierSet(verl_digen.VERL_VERSIONS_SUPPORTED)
    assert verl.specifier.contains(verl_digen.VERL_VERSION_PINNED) and verl.specifier.contains("0.9.0.dev0")
    assert not verl.specifier.contains("0.10.0")
    assert not [r for r in reqs if r.name.lower() == "transferqueue"]  # veRL's own extra decides it


def test_vllm_extra_pins_what_veRL_0_9_1s_vllm_extra_pins(wheel):
    def pins(requirements) -> dict[str, str]:
        return {r.name: str(r.specifier) for r in requirements if str(r.specifier).startswith("==")}

    assert importlib.metadata.version("verl") == "0.9.1"
    verl_vllm = pins(_requirements(importlib.metadata.requires("verl"), "vllm"))
    assert verl_vllm["vllm"] == "==0.24.0" and verl_vllm["torch"] == "==2.11.0"
    assert pins(_requirements(_wheel_requires(wheel), "vllm")) == verl_vllm
