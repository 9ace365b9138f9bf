"""The device bundle's package lists (scripts/gpu_bundle.py), without downloading: every carried
package pinned by scripts/constraints.txt, none of them one the device already has, torch never
carried. The bundle built and installed: tests/e2e/test_gpu_bundle_e2e.py."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_bundle  # noqa: E402


def test_every_carried_package_is_pinned_and_missing_on_the_device():
    pins = gpu_bundle.pins(os.path.join(ROOT, "scripts", "constraints.txt"))
    carried = {gpu_bundle.canon(n) for n in gpu_bundle.MISSING}
    assert not carried - set(pins), "carried but not pinned"
    assert not carried & {gpu_bundle.canon(n) for n in gpu_bundle.DEVICE_HAS}
    assert "torch" not in carried and "torch" in gpu_bundle.DEVICE_HAS
    assert set(gpu_bundle.SDIST_ONLY) <= set(gpu_bundle.MISSING)


def test_the_trimmed_ray_keeps_what_a_run_imports():
    dropped = {d.split("/")[1] for d in gpu_bundle.RAY_DROP}
    # ray.util (placement groups, collective), the core binaries and the dashboard's agent stay
    assert not dropped & {"util", "core", "_private", "_raylet.so", "experimental", "runtime_env"}
    assert "ray/dashboard/client/build" in gpu_bundle.RAY_DROP and "ray/dashboard" not in gpu_bundle.RAY_DROP


def test_pins_reads_name_version_lines_by_canonical_name(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("# header\nTransferQueue==0.1.11\nrpds_py==1.0  # note\nplain\n")
    assert gpu_bundle.pins(str(f)) == {"transferqueue": "0.1.11", "rpds-py": "1.0"}
