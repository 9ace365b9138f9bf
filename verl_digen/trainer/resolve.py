"""Turn a composed config into what a run needs, failing before any worker starts.

:func:`check_run_config` runs every check, for both entry points, writing nothing;
:func:`prepare_run` adds the run's directories and resume point: the one object the controller
works from. Each function names the config key at fault: the number of steps, the model
directory (a local directory, a hub id resolved to its snapshot in the Hugging Face cache, or
the tiny model built in its place), the prompt sets, the output directory, a reachable remote
reward, and whether every role fits its GPU's memory.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verl_digen.config.schema import ConfigError, DigenConfig, digen_config_from_dict, prompt_sources
from verl_digen.config.verl_keys import DIGEN_MAIN, MAIN_PPO, RunConfig, VerlTrainerKeys, resolve_run_config

if TYPE_CHECKING:  # checkpoint.py imports torch: only when a run is prepared
    from verl_digen.trainer.checkpoint import Checkpoint


def resolve_model_path(cfg: DigenConfig) -> str:
    """The model directory (the tiny model is built when none is given; a hub id becomes its
    snapshot directory, see :func:`model_directory`), checked before any worker starts: its
    pipeline is supported, every safetensors file is whole, and the configured sample size is one
    the architecture can take. Workers receive this directory, never the hub id."""
    from verl_digen.models.registry import ADAPTERS, detect_arch
    from verl_digen.models.tiny import ensure_tiny

    if cfg.model.path is None:
        if cfg.model.tiny_arch == "digits":  # the shipped pretrained toy, copied into the cache
            from verl_digen.models.toy import ensure_toy

            path = ensure_toy(cfg.model.tiny_arch)
        else:
            path = ensure_tiny(cfg.model.tiny_arch)
    else:
        path = model_directory(cfg.model.path)
    if cfg.model.arch is not None and cfg.model.arch not in ADAPTERS:
        raise ConfigError(f"invalid config: digen.model.arch={cfg.model.arch!r}; known: {', '.join(sorted(ADAPTERS))}")
    arch = cfg.model.arch or detect_arch(path)  # names a missing model_index.json or an unsupported pipeline
    check_safetensors(path)
    return _check_sample_size(cfg, arch, path)


def _check_sample_size(cfg: DigenConfig, arch: str, path: str) -> str:
    """``path`` (a model directory or the shipped configs) when the family's model there can take
    the run's sample size; a ConfigError naming the sampling keys otherwise."""
    from verl_digen.models.base import SampleSpec
    from verl_digen.models.registry import ADAPTERS

    s = cfg.sampling
    try:
        ADAPTERS[arch].check_sample_size(path, SampleSpec(s.height, s.width, s.num_frames))
    except ValueError as e:
        raise ConfigError(
            f"invalid config: digen.sampling.height={s.height}, width={s.width}, num_frames={s.num_frames}: {e}"
        ) from None
    return path


def is_hub_id(path: str) -> bool:
    """``name`` or ``org/name`` as the Hugging Face hub spells repository ids; a path that is
    absolute, relative to ``.`` or ``~``, or deeper than one ``/`` is a local path only."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def model_directory(path: str, key: str = "digen.model.path") -> str:
    """``path`` as an absolute directory when it is a local directory; else, when it reads as a
    hub id, its snapshot directory from diffusers' own ``DiffusionPipeline.download`` (the files
    ``from_pretrained`` would fetch, through the Hugging Face cache: ``HF_HOME`` /
    ``HF_HUB_CACHE``; with ``HF_HUB_OFFLINE=1`` only the cache is read). The error names ``key``."""
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        return os.path.abspath(local)
    if not is_hub_id(path):
        raise FileNotFoundError(f"{key}: model path '{path}' does not exist")
    from diffusers import DiffusionPipeline
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        # local_files_only offline: read the cache without first trying (and warning about) the network
        return str(DiffusionPipeline.download(path, local_files_only=offline))
    except (OSError, ValueError) as e:  # not cached offline, unknown repo, no model_index.json, network
        where = f"not in the hub cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE=1" if offline else "download failed"
        raise FileNotFoundError(
            f"{key}: model path '{path}' is not a local directory, and as a hub id it cannot be resolved "
            f"({where}): {e}"
        ) from None


def check_safetensors(path: str) -> None:
    """Every ``*.safetensors`` file under a model directory has a readable header whose tensors
    fit in the file: a truncated or damaged download stops here, naming the file, instead of
    inside a worker's ``from_pretrained``. Reads headers only (a few KB per file)."""
    import json
    import struct

    for root, _, files in os.walk(path):
        for name in sorted(files):
            if not name.endswith(".safetensors"):
                continue
            file = os.path.join(root, name)
            size = os.path.getsize(file)
            try:
                with open(file, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    if n > size - 8:
                        raise ValueError(f"header length {n} exceeds the file")
                    header = json.loads(f.read(n))
                ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
                need = 8 + n + max(ends, default=0)
                if size < need:
                    raise ValueError(f"{size} bytes, the header needs {need} (truncated)")
            except (ValueError, KeyError, TypeError, struct.error) as e:
                raise ConfigError(f"invalid model: {file} is not a whole safetensors file ({e})") from None


def check_component_weights(path: str) -> None:
    """Every model component that ``model_index.json`` lists and that has a ``config.json`` (the
    networks: transformer, VAE, text encoders; schedulers and tokenizers have none) has its
    weights: a file with a weights suffix, or a sharded index whose shards are all present. A
    folder missing them stops here, naming it, instead of inside a worker's ``from_pretrained``."""
    import json

    from verl_digen.models.base import has_component, read_model_index
    from verl_digen.models.prompt_cache import WEIGHT_SUFFIXES

    index = read_model_index(path)
    for name in sorted(index):
        folder = os.path.join(path, name)
        if not has_component(index, name) or not os.path.isfile(os.path.join(folder, "config.json")):
            continue
        files = os.listdir(folder)
        indexes = [f for f in files if f.endswith(".index.json")]
        complete = []
        for shard_index in indexes:
            try:
                with open(os.path.join(folder, shard_index)) as f:
                    shards = set(json.load(f)["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"invalid model: {os.path.join(folder, shard_index)} is not a readable "
                                  f"sharded-weights index ({e})") from None
            missing = sorted(s for s in shards if not os.path.isfile(os.path.join(folder, s)))
            complete.append(not missing)
            if missing and len(indexes) == 1:
                raise ConfigError(f"invalid model: {folder} lacks {len(missing)} weight shard(s) its "
                                  f"{shard_index} lists: {', '.join(missing[:5])}")
        if indexes and not any(complete):  # e.g. only one format of a two-format repo downloaded is fine
            raise ConfigError(f"invalid model: {folder}: none of its sharded-weights indexes "
                              f"({', '.join(sorted(indexes))}) has all its shards")
        if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
            raise ConfigError(
                f"invalid model: component '{name}' ({folder}) has a config.json but no weights file "
                f"(expected e.g. diffusion_pytorch_model.safetensors or model.safetensors); the download or "
                "copy is incomplete"
            )


def resolve_prompt_records(cfg: DigenConfig, source: Any = None) -> list[dict[str, Any]]:
    """The prompt records (``{"prompt": ..., <ground truth and other fields>}``) of the run.

    ``source`` (default ``digen.data.prompts``) is ``builtin:<name>``, a file, or a list of
    files, read in order and concatenated as veRL concatenates ``data.train_files``."""
    from verl_digen.data import builtin_prompt_records, load_prompt_records

    key = "digen.data.prompts" if source is None else "digen.validation.prompts"
    source = cfg.data.prompts if source is None else source
    records: list[dict[str, Any]] = []
    for one in prompt_sources(source, key):
        try:
            if one.startswith("builtin:"):
                records += builtin_prompt_records(one.split(":", 1)[1])
            else:
                records += load_prompt_records(one, cfg.data.chat_template)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{key}: {e}") from None
        except ValueError as e:
            raise ConfigError(f"invalid config: {key}={one!r}: {e}") from None
    limit = cfg.data.max_prompt_chars
    for i, record in enumerate(records):
        if len(record["prompt"]) > limit:
            raise ConfigError(
                f"invalid data: {key}={source!r}: prompt {i} has {len(record['prompt'])} characters, more than "
                f"digen.data.max_prompt_chars={limit} (text encoders truncate far below this; fix the data or raise the limit)"
            )
    return records


def limit_prompt_tokens(cfg: DigenConfig, model_path: str, records: list[dict[str, Any]],
                        val_records: list[dict[str, Any]]) -> tuple[list, list, str | None]:
    """``digen.data.max_prompt_tokens`` (veRL's ``data.max_prompt_length``) on the training and
    validation prompts, counted by the model's length tokenizer
    (:meth:`~verl_digen.models.base.DiffusionAdapter.prompt_token_counts`): over-long prompts
    are dropped and counted (``filter_overlong_prompts``), else the first one is an error naming
    it. Returns the records kept and a note when the limit could not be checked here (the check
    tool without the model's files)."""
    limit = cfg.data.max_prompt_tokens
    if limit is None or model_path == "<emulated>":
        return records, val_records, None
    not_here = (records, val_records, f"digen.data.max_prompt_tokens={limit} not checked: the model's tokenizer is "
                                      "not on this machine (the run checks it when it starts)")
    if not os.path.isfile(os.path.join(model_path, "model_index.json")):  # a tiny model not yet built
        return not_here
    from verl_digen.models.registry import ADAPTERS, detect_arch

    adapter = ADAPTERS[cfg.model.arch or detect_arch(model_path)]
    if not os.path.isdir(os.path.join(model_path, adapter.length_tokenizer)):  # the shipped configs: no tokenizer
        return not_here
    kept = []
    for key, rows in (("digen.data.prompts", records), ("digen.validation.prompts", val_records)):
        counts = adapter.prompt_token_counts(model_path, [r["prompt"] for r in rows]) if rows else []
        over = [i for i, n in enumerate(counts) if n > limit]
        if over and not cfg.data.filter_overlong_prompts:
            i = over[0]
            raise ConfigError(
                f"invalid data: {key}: prompt {i} ({rows[i]['prompt'][:60]!r}) has {counts[i]} tokens "
                f"(as the {adapter.arch} model's {adapter.length_tokenizer} reads it), more than "
                f"digen.data.max_prompt_tokens={limit}; {len(over)} of {len(rows)} prompts are over; drop them with "
                "digen.data.filter_overlong_prompts=true (veRL's data.filter_overlong_prompts) or raise the limit")
        if over:
            print(f"[verl-digen] {key}: dropped {len(over)} of {len(rows)} prompts longer than "
                  f"digen.data.max_prompt_tokens={limit} tokens (digen.data.filter_overlong_prompts)", flush=True)
        drop = set(over)
        kept.append([r for i, r in enumerate(rows) if i not in drop])
    return kept[0], kept[1], None


def check_loggers(loggers: tuple[str, ...]) -> None:
    """``trainer.logger`` names only backends veRL's ``Tracking`` knows (what each needs to start:
    :func:`check_logger_setup`)."""
    from verl.utils.tracking import Tracking

    unknown = [b for b in loggers if b not in Tracking.supported_backend]
    if unknown:
        raise ConfigError(
            f"invalid config: trainer.logger={list(loggers)!r}: unknown {unknown}; valid: {', '.join(Tracking.supported_backend)}"
        )


#: The package each of veRL's ``Tracking`` backends imports when it starts (console and file need none).
LOGGER_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab", "vemlp_wandb": "volcengine_ml_platform",
                   "tensorboard": "tensorboard", "clearml": "clearml", "trackio": "trackio", "rl_insight": "rl_insight"}
#: Environment variables veRL's ``Tracking`` reads with ``os.environ[...]`` (a KeyError when unset).
LOGGER_ENV = {"vemlp_wandb": ("VOLC_ACCESS_KEY_ID", "VOLC_SECRET_ACCESS_KEY", "MLP_TRACKING_REGION")}


def check_logger_setup(loggers: tuple[str, ...] | list[str]) -> None:
    """What each ``trainer.logger`` backend needs in order to start, checked before Ray: its
    package, and the credentials whose absence stops veRL's ``Tracking`` (after Ray and every
    worker started, with a raw traceback). Only what fails for certain is checked: W&B's API key
    (:func:`wandb_key_problem`) and ``vemlp_wandb``'s environment variables; a backend that
    carries on without its server (mlflow, which veRL retries and then skips) is not refused."""
    import importlib.util

    for backend in loggers:
        package = LOGGER_PACKAGES.get(backend)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"invalid config: trainer.logger has {backend!r} but the {package} package is not "
                              f"installed in this environment: pip install {package.replace('_', '-')}, or remove "
                              f"{backend} from trainer.logger")
        missing = [k for k in LOGGER_ENV.get(backend, ()) if not os.environ.get(k)]
        if missing:
            raise ConfigError(f"invalid config: trainer.logger has {backend!r}, which reads {', '.join(missing)} from "
                              "the environment: set them, or remove it from trainer.logger")
    if "wandb" in loggers:
        problem = wandb_key_problem()
        if problem:
            raise ConfigError(
                f"invalid config: trainer.logger has 'wandb' but {problem}: set WANDB_API_KEY (your key: "
                "https://wandb.ai/authorize), run `wandb login` once on this machine, or set WANDB_MODE=offline "
                "(logs under ./wandb, `wandb sync` later) or WANDB_MODE=disabled; or remove wandb from trainer.logger"
            )


def wandb_key_problem() -> str | None:
    """Why ``wandb.init`` would stop for want of credentials in this process, or None.

    Asks wandb itself, as ``wandb.init`` will: its settings (``WANDB_MODE`` and the settings files
    ``wandb offline`` writes; offline and disabled runs need no key), then the credentials it
    finds without prompting (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, the ``.netrc``
    entry ``wandb login`` writes, an ``api_key`` in its settings). With a wandb whose internals
    differ, the documented sources are read instead (``WANDB_MODE``, ``WANDB_API_KEY``, the
    ``.netrc`` of ``NETRC`` or the home directory)."""
    # The environment first: wandb's settings singleton is built once per process and keeps the
    # WANDB_MODE it saw then, while wandb.init reads the environment again.
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return None
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:
        return _wandb_key_problem_documented()
    try:
        settings = wandb_setup.singleton().settings
        if settings._offline or settings._noop:
            return None
        host = settings.base_url
        auth = wbauth.authenticate_session(host=host, source="verl-digen", prompt=False, update_session=False)
    except AttributeError:  # another wandb's internals
        return _wandb_key_problem_documented()
    except Exception as e:  # noqa: BLE001 - wandb found credentials it refuses (a malformed key)
        return f"its credentials are not usable ({type(e).__name__}: {e})"
    if auth is None:
        return f"no W&B API key is configured for {host} (WANDB_API_KEY, the .netrc entry `wandb login` writes)"
    return None


def _wandb_key_problem_documented() -> str | None:
    import netrc
    from urllib.parse import urlsplit

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return None
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = os.path.expanduser(os.environ.get("NETRC") or "~/.netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return f"no W&B API key is configured for {host} (WANDB_API_KEY, or the entry in {path} `wandb login` writes)"


def output_dir_for(cfg: DigenConfig, trainer: VerlTrainerKeys) -> str:
    """``digen.output_dir``, or ``runs/<project_name>/<experiment_name>-<time>``, created."""
    if cfg.output_dir:
        path = cfg.output_dir
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join("runs", trainer.project_name, f"{trainer.experiment_name}-{stamp}")
    return check_directory(path, "digen.output_dir")


def check_directory(path: str, key: str, *, create: bool = True) -> str:
    """Create the run directory ``key`` names (absolute path returned); a path that is, or lies
    under, a regular file, or that cannot be created, is a :class:`ConfigError` naming both.
    ``create=False``: the first check only, writing nothing (:func:`check_run_config`)."""
    path = os.path.abspath(os.path.expanduser(path))
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if probe and not os.path.isdir(probe):
        raise ConfigError(f"invalid config: {key}={path} cannot be a directory: {probe} is a file")
    if not create:
        return path
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"invalid config: {key}={path} cannot be created ({e.strerror or e})") from None
    return path


def preflight_reward(cfg: DigenConfig) -> None:
    """Fail before any worker starts when a remote reward (HTTP server, VLM judge) is unreachable, or a
    custom reward file or a reward factory does not load."""
    from verl_digen.rewards import build_reward

    specs = [{"name": cfg.reward.name, "kwargs": cfg.reward.kwargs}] + list(cfg.reward.components)
    for spec in specs:
        if spec.get("name") in ("http", "vlm_judge"):
            build_reward(spec["name"], **dict(spec.get("kwargs") or {})).check_reachable()
        elif spec.get("name") in ("custom", "factory"):
            from verl_digen.rewards.factory import RewardFactoryReward

            kwargs = dict(spec.get("kwargs") or {})
            try:
                if spec["name"] == "custom":  # the user's file loads and defines the function
                    build_reward("custom", **kwargs)
                else:  # the file loads, the factory fits its arguments (not called: it may load a model)
                    RewardFactoryReward.checked_factory(**kwargs)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"invalid config: {e}") from None


def ray_init_keys(container: dict[str, Any]) -> tuple[str | None, int | None]:
    """``ray_kwargs.ray_init.address`` and ``.num_cpus`` (None when unset)."""
    ray_init = (container.get("ray_kwargs") or {}).get("ray_init") or {}
    return ray_init.get("address"), ray_init.get("num_cpus")


# What veRL's main_ppo starts before a trainer mode runs, CPUs reserved in Ray (verl 0.9.1): the
# TaskRunner actor (1), TransferQueue's controller (1) and its storage units (1 each,
# transfer_queue.backend.SimpleStorage.num_data_storage_units, 8 by default).
TASK_RUNNER_CPUS = 1
TQ_CONTROLLER_CPUS = 1
TQ_UNITS_KEY = "transfer_queue.backend.SimpleStorage.num_data_storage_units"


def check_local_ray_cpus(container: dict[str, Any], workers: int, num_cpus: int | None) -> None:
    """``main_ppo`` starting a local Ray: its CPU slots must hold the TaskRunner, TransferQueue
    (which veRL's TaskRunner starts for every trainer mode) and the digen workers (one CPU slot
    each, placement/pools.py); otherwise the job waits for them until veRL gives up (10 minutes,
    no message). Slots are ``ray_kwargs.ray_init.num_cpus``, else Ray's override
    (``RAY_OVERRIDE_RESOURCES``), else this machine's cores; logical slots may exceed cores."""
    import json

    backend = ((container.get("transfer_queue") or {}).get("backend") or {})
    units = int(((backend.get("SimpleStorage") or {}).get("num_data_storage_units")) or 8)
    need = TASK_RUNNER_CPUS + TQ_CONTROLLER_CPUS + units + workers
    source = "ray_kwargs.ray_init.num_cpus"
    have = num_cpus
    if have is None:
        try:
            have = json.loads(os.environ.get("RAY_OVERRIDE_RESOURCES") or "{}").get("CPU")
            source = "RAY_OVERRIDE_RESOURCES"
        except (ValueError, AttributeError):
            have = None
    if have is None:
        have, source = os.cpu_count() or 1, "this machine's cores (ray_kwargs.ray_init.num_cpus unset)"
    if have < need:
        raise ConfigError(
            f"invalid config: main_ppo starts a local Ray with {have:g} CPU slots ({source}), but needs {need}: veRL's "
            f"TaskRunner ({TASK_RUNNER_CPUS}), TransferQueue ({TQ_CONTROLLER_CPUS} controller + {units} storage units, "
            f"{TQ_UNITS_KEY}) and the {workers} digen workers (one slot each); set ray_kwargs.ray_init.num_cpus={need} "
            "or more (slots may exceed the cores)"
        )


def preflight_ray(address: str | None) -> bool:
    """``main_ppo``: the Ray cluster veRL's driver is about to join answers (the probe
    ``verl_digen.main`` makes in :func:`verl_digen.trainer.runtime.init_ray`), so that a stale
    ``ray_current_cluster`` marker or a dead ``RAY_ADDRESS`` stops the job in one line instead of
    ``ray.init`` retrying it for minutes, and so that a cluster requiring token authentication is
    joined with this machine's token (or refused naming ``RAY_AUTH_MODE``). Nothing to check once
    Ray runs (inside veRL's TaskRunner). ``address``: ``ray_kwargs.ray_init.address``. True when the driver will start a local Ray."""
    import ray

    from verl_digen.trainer.ray_auth import follow_cluster_auth
    from verl_digen.trainer.runtime import check_ray_target, ray_target

    if ray.is_initialized():
        return False
    target, source = ray_target(address)
    if target is not None:
        check_ray_target(target, source)
        follow_cluster_auth(target)  # veRL's ray.init then joins in the cluster's auth mode
        return False
    return True


@dataclass(frozen=True)
class CheckedRun:
    """A run's config, checked before anything starts (see :func:`check_run_config`); read by
    the controller, never copied."""

    container: dict[str, Any]  # the whole config, resolved, as plain data
    run_config: RunConfig  # the digen mapping with veRL's keys applied, and where each came from
    cfg: DigenConfig
    layout: Any  # verl_digen.placement.pools.PoolLayout
    cluster: Any  # verl_digen.placement.pools.ClusterSpec: trainer.nnodes x trainer.n_gpus_per_node
    prompt_records: list[dict[str, Any]]  # each training prompt's record: its rewards' metadata
    val_records: list[dict[str, Any]]
    total_steps: int
    model_path: str
    ray_address: str | None  # ray_kwargs.ray_init.address
    ray_num_cpus: int | None  # ray_kwargs.ray_init.num_cpus
    memory_plan: list[Any] | None  # every role's per-GPU peak (verl_digen.memory.RolePlan); None: not planned
    model_note: str | None  # what was checked of the model when it is not its weights (check_model)

    @property
    def trainer(self) -> VerlTrainerKeys:
        """veRL's ``trainer.*`` keys, typed."""
        return self.run_config.trainer

    @property
    def emulated(self) -> bool:
        """An emulated cluster (``digen.emulate.model``): no model, no checkpoints, no validation."""
        return self.cfg.emulate.model is not None

    @property
    def prompts(self) -> list[str]:
        return [record["prompt"] for record in self.prompt_records]

    @property
    def val_prompts(self) -> list[str]:
        return [record["prompt"] for record in self.val_records]

    @property
    def negative_prompts(self) -> list[str]:
        """The records' own CFG negative prompts (a ``negative_prompt`` column), each once."""
        records = self.prompt_records + self.val_records
        return list(dict.fromkeys(r["negative_prompt"] for r in records if isinstance(r.get("negative_prompt"), str)))

    @property
    def test_freq(self) -> int:
        """Validate every this many steps (<= 0: never; an emulated run never validates)."""
        return -1 if self.emulated else self.trainer.test_freq

    @property
    def save_freq(self) -> int:
        """Checkpoint every this many steps (<= 0: never; an emulated run writes no checkpoints)."""
        return -1 if self.emulated else self.trainer.save_freq


def check_run_config(config: Any, entry: str = DIGEN_MAIN, *, without_weights: bool = False) -> CheckedRun:
    """Every check a run makes before Ray starts, writing nothing: veRL's keys mapped onto ours
    (and the ones that cannot apply refused), the typed config, the pools against the cluster,
    the prompt files, the step count, the loggers (their packages and credentials: a W&B key), the
    reward (a custom file loads, a server answers), the model directory (the tiny model is built
    when none is given) and, under ``main_ppo``, the Ray cluster veRL is about to join. Errors name
    the key the user wrote. Both entry points run it: ``verl_digen.main`` through :func:`prepare_run`, and
    ``main_ppo`` in its driver, as the digen mode's ``validate_config`` (:mod:`verl_digen.verl_hooks`);
    ``python -m verl_digen.check`` with ``without_weights`` (see :func:`check_model`)."""
    from omegaconf import OmegaConf

    from verl_digen.placement.pools import cluster_from_trainer_keys, pool_layout

    from verl_digen.config.compose import in_hydra_app, written_keys

    container = OmegaConf.to_container(config, resolve=True)
    assert isinstance(container, dict)
    # also types and checks veRL's trainer.* keys
    run_config = resolve_run_config(container, entry, written_keys(config))
    notice = run_config.notice()
    if notice and (entry != MAIN_PPO or in_hydra_app()):
        # once per job: under main_ppo its driver says it (a Hydra app); the trainer, which checks
        # again inside Ray, does not repeat it
        print(notice, flush=True)
    trainer = run_config.trainer
    ray_address, ray_num_cpus = ray_init_keys(container)
    try:
        cfg = digen_config_from_dict(run_config.digen)
        check_loggers(trainer.logger)
        cluster = cluster_from_trainer_keys(trainer)
        layout = pool_layout(cfg, cluster)
        cfg.pass_rows(cluster.devices)  # colocated FSDP: the micro-batch must deal over every GPU
        records = resolve_prompt_records(cfg)
        val_records = resolve_prompt_records(cfg, cfg.validation.prompts)
        if cfg.rollout_data_dir is not None:  # created by prepare_run
            check_directory(cfg.rollout_data_dir, "digen.rollout_data_dir", create=False)
        preflight_reward(cfg)
        model_path, memory_plan, model_note = check_model(cfg, trainer, without_weights=without_weights)
        records, val_records, token_note = limit_prompt_tokens(cfg, model_path, records, val_records)
        model_note = "; ".join(n for n in (model_note, token_note) if n) or None
        steps = trainer.steps_for(len(records), cfg.batch.groups_per_step)
        val_records = val_records[: cfg.validation.num_prompts]
        # Last: with veRL's default trainer.logger=[console,wandb], a missing W&B key must not hide
        # the errors above.
        check_logger_setup(trainer.logger)
        if entry == MAIN_PPO and preflight_ray(ray_address):  # veRL's driver will start a local Ray
            check_local_ray_cpus(container, sum(layout.worker_counts.values()), ray_num_cpus)
    except (ConfigError, FileNotFoundError) as e:
        raise type(e)(run_config.rename(str(e))) from None
    return CheckedRun(container, run_config, cfg, layout, cluster, records, val_records, steps, model_path,
                      ray_address, ray_num_cpus, memory_plan, model_note)


def weights_on_this_machine(cfg: DigenConfig) -> bool:
    """Whether ``digen.model.path`` names a local directory here (a hub id is not resolved)."""
    return cfg.model.path is not None and os.path.isdir(os.path.expanduser(cfg.model.path))


def check_model(cfg: DigenConfig, trainer: VerlTrainerKeys, *, without_weights: bool = False,
                ) -> tuple[str, list[Any] | None, str | None]:
    """The model's checks: its directory (:func:`resolve_model_path`), activation checkpointing
    decided when ``auto``, every role's memory at this model's size (``digen.memory.check``) and
    every component's weights present. Returns (model directory, memory plan or None, a note).

    ``without_weights`` (``python -m verl_digen.check``): when ``digen.model.path`` is not a
    directory on this machine, the family's shipped real configs stand in for it (sample size and
    memory planned at real size, nothing loaded, no weights checked), and the note says so; the
    built-in tiny models (no ``digen.model.path``, no ``digen.model.arch``) are not built."""
    if cfg.emulate.model is not None:  # an emulated cluster has no model, no weights to save, nothing to resume
        return "<emulated>", None, None
    shipped = without_weights and not weights_on_this_machine(cfg)
    if shipped and cfg.model.path is None and cfg.model.arch is None:
        if cfg.model.checkpointing is None:  # auto: off for a model of kilobytes, as for a run
            cfg.model.gradient_checkpointing = "false"
        if cfg.model.encoders_offloaded is None:  # auto: resident, as for a run
            cfg.model.offload_text_encoders = "false"
        return "<built-in>", None, (f"the built-in tiny model (digen.model.tiny_arch={cfg.model.tiny_arch}) is built "
                                     "when the run starts: kilobytes, not planned")
    model_path = shipped_model_configs(cfg) if shipped else resolve_model_path(cfg)
    # Real size: a model directory, or the shipped configs; the built-in tiny models are kilobytes.
    real_size = shipped or cfg.model.path is not None
    plan_path = None if shipped else model_path
    devices = dict(devices_per_node=trainer.n_gpus_per_node, nnodes=trainer.nnodes)
    if cfg.model.optimizer_offload == "auto" and cfg.placement == "disaggregated":
        # digen.model.optimizer_offload=auto of trainers, decided here once (before checkpointing,
        # which it can make unnecessary): parked exactly when that spares the recomputed forward.
        parked = False
        if real_size:
            from verl_digen.memory import decide_optimizer_offload

            parked = decide_optimizer_offload(cfg, **devices, model_path=plan_path)
        cfg.model.optimizer_offload = "true" if parked else "false"
    if cfg.model.checkpointing is None:
        # digen.model.gradient_checkpointing=auto, decided here once for every worker: on when a
        # training pass would not fit the GPU without it (the memory plan at this model's size).
        decided = False
        if real_size:
            from verl_digen.memory import decide_checkpointing

            decided = decide_checkpointing(cfg, **devices, model_path=plan_path)
        cfg.model.gradient_checkpointing = "true" if decided else "false"
    _decide_encoder_offload(cfg, real_size, devices, plan_path)
    plans = None
    if real_size and cfg.memory.check:
        # Every role's per-GPU peak at this model's size must fit the GPU (MemoryPlanError names the knob).
        from verl_digen.memory import check_job_memory

        plans = check_job_memory(cfg, **devices, model_path=plan_path)
    if shipped:
        where = "unset" if cfg.model.path is None else f"{cfg.model.path!r} is not a directory on this machine"
        return model_path, plans, (f"digen.model.path {where}: checked with the shipped configs of "
                                   f"{cfg.model.arch} ({model_path}), no weights")
    check_component_weights(model_path)  # after the memory plan: a job that cannot fit is the first thing to fix
    return model_path, plans, None


def _decide_encoder_offload(cfg: DigenConfig, real_size: bool, devices: dict[str, int], plan_path: str | None) -> None:
    """``digen.model.offload_text_encoders=auto``, decided here once for every worker: the
    generating workers keep the text encoders resident when the memory plan fits with them there;
    the built-in tiny models keep them resident."""
    if cfg.model.encoders_offloaded is not None:
        return
    offload = False
    if real_size:
        from verl_digen.memory import decide_encoder_offload

        offload = decide_encoder_offload(cfg, **devices, model_path=plan_path)
    cfg.model.offload_text_encoders = "true" if offload else "false"


def shipped_model_configs(cfg: DigenConfig) -> str:
    """The shipped real configs of ``digen.model.arch`` (a diffusers layout without weights), with
    the sample size checked against them as :func:`resolve_model_path` checks a model directory."""
    from verl_digen.models.real_configs import FAMILIES, config_dir
    from verl_digen.models.registry import ADAPTERS

    arch = cfg.model.arch
    if arch not in FAMILIES or arch not in ADAPTERS:
        raise ConfigError(f"invalid config: digen.model.arch={arch!r}: without the model's weights the check plans "
                          f"with a family's shipped configs; known: {', '.join(sorted(FAMILIES))}")
    path = config_dir(arch)
    return _check_sample_size(cfg, arch, path)


@dataclass(frozen=True)
class PreparedRun(CheckedRun):
    """A checked run with its directories made and its starting point found
    (:func:`prepare_run`): what the controller works from."""

    output_dir: str  # digen.output_dir, created
    checkpoint_root: str  # trainer.default_local_dir as written, created unless emulated
    resume_from: Checkpoint | None  # the checkpoint to resume; None: start fresh
    identity: dict[str, Any] | None  # this run's identity, for the checkpoints it writes (None: emulated)

    @property
    def start_step(self) -> int:
        return self.resume_from.step if self.resume_from is not None else 0


def one_line_errors() -> tuple[type[BaseException], ...]:
    """The errors a job's entry point prints as one ``[verl-digen] error:`` line and exits 2 on
    (their messages name the key, file or server and the fix): ``verl_digen.main``, and
    ``main_ppo``'s driver in the digen mode (:mod:`verl_digen.verl_hooks`)."""
    from verl_digen.rewards.http_client import RewardServerError
    from verl_digen.trainer.checkpoint import CheckpointError
    from verl_digen.trainer.runtime import RayStartError

    return ConfigError, FileNotFoundError, CheckpointError, RewardServerError, RayStartError


def check_resume(checked: CheckedRun) -> tuple[Any, dict[str, Any] | None]:
    """The checkpoint ``trainer.resume_mode`` asks for (None: start fresh), checked to be this
    run's (every difference listed) and to leave steps to run, and this run's identity for the
    checkpoints it writes (None: emulated). Reads only: ``main_ppo``'s driver runs it before Ray
    (:mod:`verl_digen.verl_hooks`), :func:`prepare_run` again where the run starts."""
    from verl_digen.trainer.checkpoint import resume_point

    if checked.emulated:
        return None, None
    trainer = checked.trainer
    try:
        resume_from, identity = resume_point(trainer, trainer.checkpoint_root, checked.cfg, checked.model_path)
        if resume_from is not None and resume_from.step >= checked.total_steps:
            raise ConfigError(
                f"checkpoint {resume_from.path} is at step {resume_from.step}, which already reaches "
                f"trainer.total_training_steps={checked.total_steps}; raise total_training_steps to continue, "
                "or start fresh with trainer.resume_mode=disable"
            )
    except (ConfigError, FileNotFoundError) as e:
        raise type(e)(checked.run_config.rename(str(e))) from None
    return resume_from, identity


def prepare_run(config: Any, entry: str = DIGEN_MAIN) -> PreparedRun:
    """:func:`check_run_config`, then what a run needs before Ray starts: its output directory
    and checkpoint root created, and the checkpoint ``trainer.resume_mode`` asks for, checked to
    be this run's and to leave steps to run. Errors name the key the user wrote."""
    from dataclasses import fields

    checked = check_run_config(config, entry)
    cfg, trainer = checked.cfg, checked.trainer
    try:
        output_dir = output_dir_for(cfg, trainer)
        if cfg.rollout_data_dir is not None:  # absolute: the workers that write there may run elsewhere
            cfg.rollout_data_dir = check_directory(cfg.rollout_data_dir, "digen.rollout_data_dir")
        root = trainer.checkpoint_root
        if not checked.emulated:
            check_directory(root, "trainer.default_local_dir")  # the root stays as written (messages name it)
    except (ConfigError, FileNotFoundError) as e:
        raise type(e)(checked.run_config.rename(str(e))) from None
    resume_from, identity = check_resume(checked)
    return PreparedRun(**{f.name: getattr(checked, f.name) for f in fields(checked)}, output_dir=output_dir,
                       checkpoint_root=root, resume_from=resume_from, identity=identity)
