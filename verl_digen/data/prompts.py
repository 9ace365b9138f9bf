"""Prompt datasets: loading prompt files and sampling prompts deterministically.

* :func:`load_prompt_records` reads ``.txt`` (one prompt per non-empty line), ``.jsonl``
  (objects with a ``"prompt"`` string) and ``.parquet`` (a ``"prompt"`` column, plain strings
  or veRL's chat format) files into one *record* per prompt: a dict with the prompt under
  ``"prompt"`` and every other field of the line or row (ground truth, GenEval metadata, ...).
  The record is what reaches every reward as the sample's ``metadata``.
  :func:`load_prompts` gives just the prompt strings.
* :func:`builtin_prompts` returns a small prompt set shipped with the package.
* :class:`PromptSampler` hands out ``(index, prompt)`` pairs in a deterministic,
  epoch-shuffled order and can be checkpointed and resumed exactly.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = [
    "load_prompts",
    "load_prompt_records",
    "builtin_prompts",
    "builtin_prompt_sets",
    "PromptSampler",
    "SUPPORTED_EXTENSIONS",
]

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".parquet")

# Built-in prompt set name -> package data file in verl_digen/data/.
_BUILTIN_SETS = {
    "demo": "builtin_prompts.txt",
    "val": "builtin_val_prompts.txt",  # held out from demo
    # The toy digits model (verl_digen.models.toy): RL prompts, and held-out phrasings for validation.
    "digits": "builtin_digits_prompts.txt",
    "digits_val": "builtin_digits_val_prompts.txt",
}


def load_prompts(path: str | os.PathLike[str]) -> list[str]:
    """The prompt strings of a prompt file (see :func:`load_prompt_records`)."""
    return [record["prompt"] for record in load_prompt_records(path)]


_log = logging.getLogger(__name__)


def load_prompt_records(path: str | os.PathLike[str], chat_template: str | None = None) -> list[dict[str, Any]]:
    """Load the prompt records of a ``.txt``, ``.jsonl`` or ``.parquet`` file.

    Every record is a dict with the prompt string under ``"prompt"``:

    * ``.txt``: one prompt per line (``{"prompt": line}``); surrounding whitespace is stripped
      and blank lines are skipped.
    * ``.jsonl``: one JSON object per non-blank line with a non-empty string under
      ``"prompt"``; the record is the whole object (``ground_truth``, GenEval's ``tag`` /
      ``include``, ... are kept as they are).
    * ``.parquet``: one record per row with every column. ``"prompt"`` is a string, or veRL's
      chat format (a list of ``{"role", "content"}`` messages: the prompt is the last user
      message's content and the list is kept under ``"raw_prompt"``; system messages are not
      part of the image prompt, the denoiser's text encoder applying its own template: they are
      kept under ``"system_prompt"``, and a warning says how many chats had one). A row's
      ``negative_prompt`` column is its own CFG negative prompt. With ``chat_template`` (a Jinja
      template, veRL's ``custom_chat_template``) a chat's prompt is the template rendered with
      ``messages=<the chat>`` instead of its last user message. veRL's
      ``reward_model.ground_truth`` is copied to a top-level ``"ground_truth"`` when the row
      has none.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unsupported extension, a malformed record (with its line or row
            number), or a file with no prompts.
    """
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise ValueError(
            f"prompt file {str(path)!r} has unsupported extension {suffix or '(none)'!r}; "
            f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if not file.exists():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    if not file.is_file():
        raise ValueError(f"prompt file {str(path)!r} is not a regular file")

    if suffix == ".txt":
        records = _read_txt(file)
    elif suffix == ".jsonl":
        records = _read_jsonl(file)
    else:
        records = _read_parquet(file, chat_template)
    if not records:
        raise ValueError(f"prompt file {str(path)!r} contains no prompts")
    return records


def _read_txt(file: Path) -> list[dict[str, Any]]:
    lines = file.read_text(encoding="utf-8").splitlines()
    return [{"prompt": line.strip()} for line in lines if line.strip()]


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    records = []
    with file.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"prompt file {str(file)!r}, line {line_no}"
            try:
                record: Any = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if "prompt" not in record:
                raise ValueError(f"{where}: missing key 'prompt' (keys: {sorted(record)})")
            _check_prompt(record["prompt"], where)
            records.append(record)
    return records


def _read_parquet(file: Path, chat_template: str | None = None) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    columns = pq.read_schema(file).names
    if "prompt" not in columns:
        raise ValueError(f"prompt file {str(file)!r} has no 'prompt' column (columns: {columns})")
    rows = pq.read_table(file).to_pylist()
    chat_text = _chat_reader(chat_template)
    records = [_parquet_record(row, f"prompt file {str(file)!r}, row {index}", chat_text)
               for index, row in enumerate(rows)]
    with_system = sum(1 for r in records if r.get("system_prompt"))
    if with_system and chat_template is None:
        _log.warning("prompt file %s: %d of %d chats have a system message; the image prompt is each chat's last "
                     "user message (the denoiser's text encoder applies its own template), and the system message "
                     "stays in the record as 'system_prompt' (and the chat as 'raw_prompt') for the reward",
                     file, with_system, len(records))
    return records


def _user_messages(chat: list) -> list[dict[str, Any]]:
    return [m for m in chat if isinstance(m, dict) and m.get("role") == "user"]


def _chat_reader(template: str | None) -> Callable[[list, str], Any]:
    """``(chat, where) -> text``: a Jinja chat template rendered over the chat's ``messages``, in
    the sandboxed environment transformers renders chat templates in; without a template, the
    chat's last user message. Errors name ``where``."""
    if template is None:
        return lambda chat, where: _user_messages(chat)[-1].get("content")
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        compiled = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    except TemplateError as e:
        raise ValueError(f"digen.data.chat_template is not a valid Jinja template: {e}") from None

    def render(chat: list, where: str) -> str:
        try:
            return compiled.render(messages=chat)
        except TemplateError as e:
            raise ValueError(f"{where}: digen.data.chat_template failed on this chat: {e}") from None

    return render


def _parquet_record(row: dict[str, Any], where: str, chat_text: Callable[[list, str], Any]) -> dict[str, Any]:
    record = dict(row)
    prompt = record["prompt"]
    if isinstance(prompt, list):  # veRL's chat format: [{"role": "user", "content": "..."}, ...]
        if not _user_messages(prompt):
            raise ValueError(f"{where}: 'prompt' is a chat with no user message (veRL format expects "
                             "[{'role': 'user', 'content': ...}])")
        record["raw_prompt"] = prompt
        system = "\n".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict) and m.get("role") == "system")
        if system.strip() and "system_prompt" not in record:
            record["system_prompt"] = system
        prompt = chat_text(prompt, where)
    record["prompt"] = _check_prompt(prompt, where)
    negative = record.get("negative_prompt")
    if isinstance(negative, list):  # veRL-Omni's data scripts write the negative prompt as a chat too
        if not _user_messages(negative):
            raise ValueError(f"{where}: 'negative_prompt' is a chat with no user message")
        record["raw_negative_prompt"] = negative
        record["negative_prompt"] = chat_text(negative, f"{where}, negative_prompt")
    elif negative is not None and not isinstance(negative, str):
        raise ValueError(f"{where}: 'negative_prompt' must be a string or a chat, got {type(negative).__name__}")
    reward_model = record.get("reward_model")
    if "ground_truth" not in record and isinstance(reward_model, dict) and "ground_truth" in reward_model:
        record["ground_truth"] = reward_model["ground_truth"]
    return record


def _check_prompt(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: 'prompt' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: 'prompt' is empty")
    return value


def builtin_prompt_sets() -> list[str]:
    """Names accepted by :func:`builtin_prompts`."""
    return sorted(_BUILTIN_SETS)


def builtin_prompt_records(name: str = "demo") -> list[dict[str, Any]]:
    """:func:`builtin_prompts` as records (``{"prompt": ...}``)."""
    return [{"prompt": prompt} for prompt in builtin_prompts(name)]


def builtin_prompts(name: str = "demo") -> list[str]:
    """A small prompt set shipped with the package (``"demo"``: 32 short, varied prompts)."""
    if name not in _BUILTIN_SETS:
        raise ValueError(f"unknown built-in prompt set {name!r}; available: {', '.join(builtin_prompt_sets())}")
    text = resources.files("verl_digen.data").joinpath(_BUILTIN_SETS[name]).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


class PromptSampler:
    """Deterministic, epoch-based prompt order that can be checkpointed and resumed.

    Epoch ``e`` visits every prompt once, in a permutation drawn from ``(seed, e)`` (or in
    file order with ``shuffle=False``). :meth:`next` continues across epoch boundaries,
    so a batch may end one epoch and start the next. :meth:`state_dict` /
    :meth:`load_state_dict` save and restore ``(epoch, position)``: a sampler restored
    from a state continues exactly as the original would have.
    """

    def __init__(self, prompts: Sequence[str], *, seed: int, shuffle: bool = True) -> None:
        if isinstance(prompts, str):
            raise TypeError("PromptSampler expects a list of prompts, not a single string")
        if len(prompts) == 0:
            raise ValueError("PromptSampler needs at least one prompt")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"PromptSampler seed must be a non-negative int, got {seed!r}")
        self.prompts: tuple[str, ...] = tuple(prompts)
        self.seed = int(seed)
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order: np.ndarray = self.epoch_order(0)

    @property
    def epoch(self) -> int:
        """Epoch of the next prompt to be handed out (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many prompts of the current epoch have been handed out."""
        return self._position

    def __len__(self) -> int:
        return len(self.prompts)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Prompt indices in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next(self, n: int) -> list[tuple[int, str]]:
        """The next ``n`` ``(prompt_index, prompt)`` pairs, crossing epochs as needed."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"PromptSampler.next: n must be a non-negative int, got {n!r}")
        out: list[tuple[int, str]] = []
        while len(out) < n:
            take = min(n - len(out), len(self.prompts) - self._position)
            for index in self._order[self._position : self._position + take]:
                out.append((int(index), self.prompts[index]))
            self._position += take
            if self._position == len(self.prompts):
                self._epoch += 1
                self._position = 0
                self._order = self.epoch_order(self._epoch)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: position plus the settings it is only valid for."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the seed, shuffle flag and prompt count must match."""
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"PromptSampler state is missing {sorted(missing)}")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_prompts", len(self.prompts))):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"PromptSampler state has {key}={state[key]!r} but this sampler has {key}={mine!r}; "
                    "resuming would not reproduce the saved order"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.prompts):
            raise ValueError(
                f"PromptSampler state has epoch={epoch}, position={position}; "
                f"need epoch >= 0 and 0 <= position < {len(self.prompts)}"
            )
        self._epoch, self._position = epoch, position
        self._order = self.epoch_order(epoch)

    def __repr__(self) -> str:
        return (
            f"PromptSampler({len(self.prompts)} prompts, seed={self.seed}, shuffle={self.shuffle}, "
            f"epoch={self._epoch}, position={self._position})"
        )
