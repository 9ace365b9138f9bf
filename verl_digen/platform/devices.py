"""The device table (``devices.yaml`` next to this module): what each GPU type has and costs.

Two readers at different layers use it: the memory planner (:mod:`verl_digen.memory.plan`: each
device type's memory) and the simulator's cost model (:mod:`verl_digen.sim.cost_model`, which
reads the file as one of its profiles). It lives here, below both, as packaged data, and this
module imports nothing from verl_digen, so neither reader reaches across the layers to the other.
"""

from __future__ import annotations

import functools
import os

DEVICES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "devices.yaml")


@functools.lru_cache(maxsize=1)
def device_memory_gib() -> dict[str, float]:
    """GiB per device type (``hbm_gb``: the HBM capacity, which the datasheets' "80 GB" states in
    binary units: 5 stacks of 16 GiB)."""
    import yaml

    with open(DEVICES_FILE, encoding="utf-8") as f:
        devices = yaml.safe_load(f)["devices"]
    return {name: float(spec["hbm_gb"]) for name, spec in devices.items()}


def device_types() -> list[str]:
    """The known device types, sorted."""
    return sorted(device_memory_gib())
