"""Profile files read into a :class:`Catalog` (every shipped profile, extra files, the
calibration's ``overrides:``)."""

from __future__ import annotations

import glob
import os
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Mapping

from verl_digen.platform.devices import DEVICES_FILE
from verl_digen.sim.costs.profiles import DeviceProfile, ModelProfile, ProfileError, RewardProfile, SystemProfile

# verl_digen/sim/profiles
PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles")

SECTIONS = {"models": ModelProfile, "devices": DeviceProfile, "systems": SystemProfile, "rewards": RewardProfile}
IGNORED_SECTIONS = {"measurements", "runs"}  # raw timings, published runs (read by their own tools)


@dataclass
class Catalog:
    models: dict[str, ModelProfile] = field(default_factory=dict)
    devices: dict[str, DeviceProfile] = field(default_factory=dict)
    systems: dict[str, SystemProfile] = field(default_factory=dict)
    rewards: dict[str, RewardProfile] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    overridden: list[str] = field(default_factory=list)  # "section.name.key" set by ``overrides:`` (calibration)

    def _get(self, section: str, name: str) -> Any:
        table = getattr(self, section)
        if name not in table:
            kind = section[:-1]
            raise ProfileError(f"unknown {kind} profile {name!r}; known: {', '.join(sorted(table))}")
        return table[name]

    def system(self, name: str) -> SystemProfile:
        return self._get("systems", name)

    def model(self, name: str) -> ModelProfile:
        return self._get("models", name)

    def device(self, name: str) -> DeviceProfile:
        return self._get("devices", name)

    def reward(self, name: str) -> RewardProfile:
        return self._get("rewards", name)


def _typed(cls: type, name: str, key: str, value: Any, path: str) -> Any:
    tp = typing.get_type_hints(cls)[key]
    try:
        # YAML reads "11.9e9" (no sign in the exponent) as a string
        if tp is float and not isinstance(value, bool):
            return float(value)
        if tp is int and not isinstance(value, bool) and float(value) == int(float(value)):
            return int(float(value))
    except (TypeError, ValueError):
        raise ProfileError(f"{path}: {cls.__name__} {name!r}: {key}={value!r} is not a number") from None
    return value


def _build(cls: type, name: str, data: Mapping[str, Any], path: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ProfileError(f"{path}: {cls.__name__} {name!r} has unknown keys {sorted(unknown)}; valid: {sorted(known)}")
    values = {key: _typed(cls, name, key, value, path) for key, value in data.items()}
    try:
        return cls(name=name, **values)
    except TypeError as e:
        raise ProfileError(f"{path}: {cls.__name__} {name!r}: {e}") from None


def _patch(obj: Any, data: Mapping[str, Any], path: str) -> Any:
    """``obj`` with the fields of ``data`` replaced (``sources`` merged)."""
    cls = type(obj)
    known = {f.name for f in fields(cls)} - {"name"}
    unknown = set(data) - known
    if unknown:
        raise ProfileError(f"{path}: overrides for {cls.__name__} {obj.name!r} have unknown keys {sorted(unknown)}")
    values = {k: _typed(cls, obj.name, k, v, path) for k, v in data.items() if k != "sources"}
    if "sources" in data:
        values["sources"] = {**obj.sources, **data["sources"]}
    return replace(obj, **values)


def builtin_profile_files() -> list[str]:
    """The shipped profile files: ``verl_digen/sim/profiles/*.yaml`` and the device table, which
    lives below both the simulator and the memory planner (:mod:`verl_digen.platform.devices`);
    in file-name order, as when the device table was one of the profiles."""
    return sorted([*glob.glob(os.path.join(PROFILE_DIR, "*.yaml")), DEVICES_FILE], key=os.path.basename)


def load_catalog(extra: Iterable[str] = (), *, include_builtin: bool = True, overrides: bool = True) -> Catalog:
    """Every shipped profile (:func:`builtin_profile_files`) plus ``extra`` files (later files win).

    A profile file holds any of ``models:``, ``devices:``, ``systems:`` and ``rewards:`` (name ->
    fields, each with its ``sources``). ``overrides:`` (the calibration, written by
    ``python -m verl_digen.sim.calibrate``) patches fields of profiles defined anywhere, after
    every file is read; ``overrides=False`` loads the profiles without it.
    """
    import yaml

    paths = builtin_profile_files() if include_builtin else []
    paths += list(extra)
    cat = Catalog()
    patches: list[tuple[str, Mapping[str, Any]]] = []
    for path in paths:
        if not os.path.isfile(path):
            raise ProfileError(f"profile file {path} does not exist")
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        unknown = set(doc) - set(SECTIONS) - IGNORED_SECTIONS - {"overrides"}
        if unknown:
            raise ProfileError(
                f"{path}: unknown top-level keys {sorted(unknown)}; valid: "
                f"{', '.join([*SECTIONS, *sorted(IGNORED_SECTIONS), 'overrides'])}"
            )
        for section, cls in SECTIONS.items():
            for name, data in (doc.get(section) or {}).items():
                getattr(cat, section)[name] = _build(cls, name, data, path)
        if doc.get("overrides"):
            patches.append((path, doc["overrides"]))
        cat.files.append(path)
    if overrides:
        for path, patch in patches:
            for section, entries in patch.items():
                if section not in SECTIONS:
                    raise ProfileError(f"{path}: overrides.{section} is not one of {', '.join(SECTIONS)}")
                table = getattr(cat, section)
                for name, data in (entries or {}).items():
                    if name not in table:
                        raise ProfileError(f"{path}: overrides.{section}.{name}: no such profile")
                    table[name] = _patch(table[name], data, path)
                    cat.overridden += [f"{section}.{name}.{k}" for k in data if k != "sources"]
    return cat
