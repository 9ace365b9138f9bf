"""Where the presets are, and the main job's config composed programmatically (tests, compare,
notebooks).

The presets live in ``configs/`` at the root of a checkout (an editable install reads them there)
and the wheel ships them inside the package, in this directory (setup.py copies them): either
way ``--config-name <preset>`` finds them from any working directory.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

CONFIG_NAME = "digen_trainer"
_PACKAGED = os.path.dirname(os.path.abspath(__file__))  # an installed wheel
_CHECKOUT = os.path.join(os.path.dirname(os.path.dirname(_PACKAGED)), "configs")  # a checkout


def presets_dir() -> str:
    """The directory holding ``digen_trainer.yaml`` and the presets: this package's own in an
    installed wheel, else the checkout's ``configs/``."""
    if os.path.isfile(os.path.join(_PACKAGED, f"{CONFIG_NAME}.yaml")):
        return _PACKAGED
    return _CHECKOUT


CONFIG_DIR = presets_dir()


def compose_config(
    overrides: list[str] | None = None, *, config_name: str = CONFIG_NAME, config_dir: str = CONFIG_DIR
) -> DictConfig:
    """The config ``python -m verl_digen.main [--config-dir D --config-name N] overrides`` would see.

    Hydra reads some 30 YAML files and merges them on every composition (about 0.6 s of CPU);
    the same defaults list composes to the same config, so this composes once per config dir,
    config name, config-group overrides and state of the files it read (:func:`_composed_base`),
    and applies the key overrides (``a.b=1``, ``+a.c=2``, ``~a.d``) to a copy of that with
    Hydra's own step for them, which is what Hydra's composition does after merging the defaults
    list. Overrides of ``hydra.*``, sweeps and anything that fails go through Hydra's whole
    composition, so its errors read as they always did. A composition that has to run (another
    preset, other config groups) reads each YAML file through :class:`_SharedLoads`: a file
    loaded by an earlier composition from the same sources, unchanged, is a copy of that load
    (the presets share veRL's ~30 files, parsed by PyYAML's pure-Python loader: most of a
    composition's time)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = list(overrides or [])
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        loader = getattr(GlobalHydra.instance().hydra, "config_loader", None)
        if hasattr(loader, "repository"):  # Hydra's internals as of 1.3; another layout composes unshared
            loader.repository = _SharedLoads(loader.repository)
        try:
            composed = _compose_from_base(os.path.abspath(config_dir), config_name, overrides)
        except Exception:  # noqa: BLE001 - Hydra's whole composition below raises its own error
            composed = None
        if composed is None:
            composed = compose(config_name=config_name, overrides=overrides)
    _remember_written(composed, overrides, config_file_keys(config_dir, config_name, _group_choices(overrides)))
    return composed


# id(config) -> the keys its overrides wrote, for every config compose_config returned and that
# is still alive (a DictConfig hashes by content, so a WeakKeyDictionary would not do)
_WRITTEN: dict[int, frozenset[str]] = {}


def _remember_written(config: DictConfig, overrides: list[str], chosen: frozenset[str] = frozenset()) -> None:
    import weakref

    from verl_digen.config.verl_keys import override_keys

    _WRITTEN[id(config)] = override_keys(overrides) | chosen
    weakref.finalize(config, _WRITTEN.pop, id(config), None)


def _group_choices(overrides: list[str]) -> dict[str, str]:
    """The config groups the overrides choose (``+smoke=tiny``): group -> option."""
    out = {}
    for item in overrides:
        key, sep, value = str(item).lstrip("+").partition("=")
        if sep and "." not in key and "@" not in key and "/" not in key:
            out[key] = value
    return out


def config_file_keys(config_dir: str, config_name: str, groups: dict[str, str]) -> frozenset[str]:
    """The ``digen.*`` keys a preset (``--config-name``, other than the base config) and the
    config groups chosen from ``config_dir`` (``+smoke=tiny``) set in their YAML files: the user
    chose those values as if writing them, so a default implied by other keys (a veRL-Omni
    recipe's, :mod:`verl_digen.config.omni_keys`) does not replace them."""
    from omegaconf import OmegaConf

    files = [os.path.join(config_dir, f"{config_name}.yaml")] if config_name != CONFIG_NAME else []
    files += [os.path.join(config_dir, group, f"{option}.yaml") for group, option in groups.items()]
    keys: set[str] = set()

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict) and node:
            for name, value in node.items():
                walk(value, f"{key}.{name}")
        elif key != "digen":
            keys.add(key)

    for file in files:
        if os.path.isfile(file):
            data = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
            walk((data or {}).get("digen") if isinstance(data, dict) else None, "digen")
    return frozenset(keys)


def written_keys(config: DictConfig) -> frozenset[str]:
    """The keys the command line wrote for ``config``: :func:`compose_config`'s overrides for a
    config it returned; inside a Hydra app (``main_ppo``, ``verl_digen.main``), Hydra's own
    record of the command line; else none. Some veRL defaults cannot apply when written
    (``algorithm.adv_estimator=gae``) but must pass when merely inherited."""
    if id(config) in _WRITTEN:
        return _WRITTEN[id(config)]
    if in_hydra_app():
        from hydra.core.hydra_config import HydraConfig

        from verl_digen.config.verl_keys import override_keys

        hydra = HydraConfig.get()
        groups = {g: str(o) for g, o in (hydra.runtime.choices or {}).items()
                  if o is not None and "/" not in g and "@" not in g}
        return override_keys(hydra.overrides.task) | config_file_keys(presets_dir(), hydra.job.config_name, groups)
    return frozenset()


def in_hydra_app() -> bool:
    """Whether this process runs a Hydra app (``main_ppo``'s or ``verl_digen.main``'s driver), whose
    record of the command line Hydra holds; :func:`compose_config` never sets one."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized()


# (config dir, config name, config-group overrides) -> (the sources' state, the composed config
# pickled: a returned config is a fresh copy, and nothing a caller does to it reaches the cache)
_BASES: dict[tuple[str, str, tuple[str, ...]], tuple[tuple, bytes]] = {}


def _compose_from_base(config_dir: str, config_name: str, overrides: list[str]) -> DictConfig | None:
    """``compose(config_name, overrides)`` as Hydra's ``load_configuration`` builds it: the
    defaults list (config-group overrides only) composed, then
    ``ConfigLoaderImpl._apply_overrides_to_config`` for the key overrides, in order; None where
    only Hydra's whole composition can say (``hydra.*`` or sweep overrides, a source that is not
    a directory). Inside ``initialize_config_dir(config_dir)``."""
    import pickle

    from hydra import compose
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().hydra.config_loader
    parsed, repo = loader._parse_overrides_and_create_caching_repo(config_name, overrides)
    if any(o.is_sweep_override() or o.is_hydra_override() for o in parsed):
        return None
    # Hydra's split (defaults_list.Overrides): a config group's override changes the defaults
    # list, anything else (a key, or a dict given to a group) is applied to the composed config.
    is_group = [not isinstance(o.value(), dict) and repo.group_exists(o.key_or_group) for o in parsed]
    groups = [o for o, group in zip(parsed, is_group) if group]
    keys = [o for o, group in zip(parsed, is_group) if not group]
    state = _sources_state(repo)
    if state is None:
        return None
    key = (config_dir, config_name, tuple(o.input_line for o in groups))
    cached = _BASES.get(key)
    if cached is None or cached[0] != state:
        base = compose(config_name=config_name, overrides=[o.input_line for o in groups])
        cached = _BASES[key] = (state, pickle.dumps(base))
    config = pickle.loads(cached[1])
    ConfigLoaderImpl._apply_overrides_to_config(keys, config)
    return config


def _sources_state(repo) -> tuple | None:
    """What a composition read, to notice an edit between two: every file under the search
    path's directories (``file://`` and ``pkg://`` sources) with its modification time and size,
    and the ConfigStore's nodes (``structured://``), compared by identity. None for another kind
    of source."""
    import importlib.util

    from hydra.core.config_store import ConfigStore

    state: list = []
    for source in repo.get_sources():
        scheme = source.scheme()
        if scheme == "structured":
            state.append(tuple(_store_nodes(ConfigStore.instance().repo, "")))
            continue
        if scheme == "file":
            dirs = [source.path]
        elif scheme == "pkg":
            spec = importlib.util.find_spec(source.path)
            if spec is None or not spec.submodule_search_locations:
                return None
            dirs = list(spec.submodule_search_locations)
        else:
            return None
        for top in dirs:
            for root, subdirs, names in os.walk(top):
                subdirs.sort()
                for name in sorted(names):
                    path = os.path.join(root, name)
                    info = os.stat(path)
                    state.append((path, info.st_mtime_ns, info.st_size))
    return tuple(state)


def _store_nodes(group: dict, prefix: str):
    """(path, node) of every node of the ConfigStore's ``repo`` dict, depth first; a node is kept
    by the cache entry, so an identity compare cannot meet a new node at a reused address."""
    for name in sorted(group):
        value = group[name]
        if isinstance(value, dict):
            yield from _store_nodes(value, f"{prefix}{name}/")
        else:
            yield _Same(f"{prefix}{name}", value)


class _Same:
    """A ConfigStore node in a sources' state: equal to the same node object under the same path."""

    __slots__ = ("path", "node")

    def __init__(self, path: str, node: object):
        self.path, self.node = path, node

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and self.path == other.path and self.node is other.node

    def __hash__(self) -> int:
        return hash((self.path, id(self.node)))


# (the sources, their state (_sources_state), config path) -> Hydra's ConfigResult of loading
# that config from those sources, pickled (each load hands out a fresh copy of it).
_LOADS: dict[tuple, bytes] = {}
_LOADS_MAX = 4096  # entries (about 35 per set of sources); past it the cache starts over


class _SharedLoads:
    """Hydra's ``ConfigRepository`` (``delegate``) whose ``load_config`` results are shared by
    every composition of the process that reads the same sources in the same state: a hit is a
    copy (unpickled) of the first load's result (what Hydra built from the file: config, header,
    defaults list), so no composition sees another's changes (Hydra merges loaded nodes into
    its composed config without copying them). The key is the search path's sources (class,
    provider, path, in order) and :func:`_sources_state` (every file's path, mtime and size; the
    ConfigStore's nodes by identity), taken when the sources are set: an edited, added or
    removed file, or a new ConfigStore node, is loaded afresh. A load that raises (or a result
    pickle cannot copy) is not kept.

    Hydra's ``CachingConfigRepository`` deep-copies its delegate once per composition; the copy
    keeps sharing the process-wide cache (``_LOADS``), and computes the state at its first load."""

    def __init__(self, delegate) -> None:
        self.delegate = delegate
        self._key: tuple | None = None  # (sources, state) once computed; () where not cacheable

    def __deepcopy__(self, memo):
        import copy

        return _SharedLoads(copy.deepcopy(self.delegate, memo))

    def initialize_sources(self, config_search_path) -> None:
        self.delegate.initialize_sources(config_search_path)
        self._key = None

    def load_config(self, config_path: str):
        import pickle

        if self._key is None:
            state = _sources_state(self.delegate)
            sources = tuple((type(s).__name__, s.provider, s.path) for s in self.delegate.get_sources())
            self._key = () if state is None else (sources, state)
        if not self._key:
            return self.delegate.load_config(config_path)
        key = (self._key, config_path)
        if key in _LOADS:
            return pickle.loads(_LOADS[key])
        result = self.delegate.load_config(config_path)
        try:
            blob = pickle.dumps(result)
        except Exception:  # noqa: BLE001 - a config pickle cannot copy is simply not shared
            return result
        if len(_LOADS) >= _LOADS_MAX:
            _LOADS.clear()
        _LOADS[key] = blob
        return result

    def get_schema_source(self):
        return self.delegate.get_schema_source()

    def group_exists(self, config_path: str) -> bool:
        return self.delegate.group_exists(config_path)

    def config_exists(self, config_path: str) -> bool:
        return self.delegate.config_exists(config_path)

    def get_group_options(self, group_name: str, *args, **kwargs):
        return self.delegate.get_group_options(group_name, *args, **kwargs)

    def get_sources(self):
        return self.delegate.get_sources()

    def __getattr__(self, name: str):  # anything else Hydra may ask of its repository
        if name == "delegate":  # not set yet (copy/pickle protocols probe before __init__)
            raise AttributeError(name)
        return getattr(self.delegate, name)
