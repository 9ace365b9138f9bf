"""Tests for verl_digen.data: prompt files, built-in prompts and the resumable sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from verl_digen.data import PromptSampler, builtin_prompt_sets, builtin_prompts, load_prompts

PROMPTS = ["a red apple on a table", "a cat on a sofa", "a lighthouse at dusk"]


# --------------------------------------------------------------------------- load_prompts


def test_load_txt_skips_blank_lines_and_strips(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("  a red apple on a table \n\n a cat on a sofa\n   \na lighthouse at dusk")
    assert load_prompts(path) == PROMPTS
    assert load_prompts(str(path)) == PROMPTS


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS)]
    path.write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")
    assert load_prompts(path) == PROMPTS


def test_load_jsonl_missing_prompt_key_names_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl'?, line 3: missing key 'prompt'"):
        load_prompts(path)


def test_load_jsonl_invalid_json_names_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"line 2: invalid JSON"):
        load_prompts(path)


def test_load_parquet(tmp_path: Path) -> None:
    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": PROMPTS, "score": [1, 2, 3]}).to_parquet(path)
    assert load_prompts(path) == PROMPTS


def test_load_parquet_without_prompt_column(tmp_path: Path) -> None:
    path = tmp_path / "other.parquet"
    pd.DataFrame({"caption": PROMPTS}).to_parquet(path)
    with pytest.raises(ValueError, match=r"no 'prompt' column.*caption"):
        load_prompts(path)


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "blank.txt"])
def test_empty_file_has_no_prompts(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\n   \n" if name == "blank.txt" else "")
    with pytest.raises(ValueError, match=rf"prompt file '.*{name}' contains no prompts"):
        load_prompts(path)


def test_empty_parquet_has_no_prompts(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(path)
    with pytest.raises(ValueError, match="contains no prompts"):
        load_prompts(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.txt' does not exist"):
        load_prompts(tmp_path / "nope.txt")


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"prompts\.csv'.*unsupported extension '\.csv'.*\.txt, \.jsonl, \.parquet"):
        load_prompts(path)


# --------------------------------------------------------------------------- built-in prompts


def test_builtin_prompts() -> None:
    prompts = builtin_prompts()
    assert prompts == builtin_prompts("demo")
    assert 16 <= len(prompts) <= 64
    assert len(set(prompts)) == len(prompts)
    assert all(p and p == p.strip() for p in prompts)
    assert builtin_prompt_sets() == ["demo", "digits", "digits_val", "val"]
    with pytest.raises(ValueError, match=r"unknown built-in prompt set 'nope'; available: demo, digits, digits_val, val"):
        builtin_prompts("nope")


def test_validation_prompts_are_held_out_from_the_demo_set() -> None:
    val = builtin_prompts("val")
    assert val and not set(val) & set(builtin_prompts("demo"))


# --------------------------------------------------------------------------- PromptSampler


def test_sampler_epochs_are_permutations_and_deterministic() -> None:
    prompts = [f"prompt {i}" for i in range(10)]
    a = PromptSampler(prompts, seed=7)
    b = PromptSampler(prompts, seed=7)

    first = a.next(10)
    second = a.next(10)
    assert first == b.next(10) and second == b.next(10)
    for epoch in (first, second):
        assert sorted(i for i, _ in epoch) == list(range(10))
        assert all(prompts[i] == p for i, p in epoch)
    assert first != second  # reshuffled each epoch
    assert a.epoch == 2 and a.position == 0
    assert PromptSampler(prompts, seed=8).next(10) != first


def test_sampler_crosses_epoch_boundaries_cleanly() -> None:
    prompts = [f"p{i}" for i in range(7)]
    reference = PromptSampler(prompts, seed=3)
    stream = reference.next(7) + reference.next(7) + reference.next(7)

    sampler = PromptSampler(prompts, seed=3)
    chunks = [sampler.next(n) for n in (3, 5, 0, 4, 9)]  # 21 in total, crossing epochs mid-batch
    assert [pair for chunk in chunks for pair in chunk] == stream
    assert sampler.epoch == 3 and sampler.position == 0

    big = PromptSampler(prompts, seed=3).next(21)  # one call spanning three epochs
    assert big == stream


def test_sampler_without_shuffle_is_file_order() -> None:
    sampler = PromptSampler(PROMPTS, seed=0, shuffle=False)
    assert sampler.next(5) == [(0, PROMPTS[0]), (1, PROMPTS[1]), (2, PROMPTS[2]), (0, PROMPTS[0]), (1, PROMPTS[1])]


def test_sampler_resume_continues_exactly() -> None:
    prompts = [f"p{i}" for i in range(11)]
    original = PromptSampler(prompts, seed=42)
    original.next(4)
    original.next(9)  # now in epoch 1, position 2
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON checkpoint
    assert (state["epoch"], state["position"]) == (1, 2)

    resumed = PromptSampler(prompts, seed=42)
    resumed.load_state_dict(state)

    assert [resumed.next(n) for n in (5, 13, 3)] == [original.next(n) for n in (5, 13, 3)]
    assert resumed.state_dict() == original.state_dict()


def test_sampler_rejects_mismatched_state() -> None:
    state = PromptSampler(PROMPTS, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        PromptSampler(PROMPTS, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts=3 but this sampler has num_prompts=2"):
        PromptSampler(PROMPTS[:2], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        PromptSampler(PROMPTS, seed=1).load_state_dict({**state, "position": 3})


def test_sampler_argument_errors() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSampler([], seed=0)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(PROMPTS, seed=-1)
    with pytest.raises(ValueError, match="non-negative"):
        PromptSampler(PROMPTS, seed=0).next(-1)


# --------------------------------------------------------------------------- prompt records (metadata)


def test_records_keep_every_jsonl_field(tmp_path: Path) -> None:
    from verl_digen.data import load_prompt_records

    rows = [
        {"prompt": "a photo of a bench", "tag": "single_object", "include": [{"class": "bench", "count": 1}]},
        {"prompt": 'a sign that says "OPEN"', "ground_truth": "OPEN"},
    ]
    path = tmp_path / "meta.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompt_records(path) == rows
    assert load_prompts(path) == [r["prompt"] for r in rows]


def test_records_of_txt_and_builtin_sets(tmp_path: Path) -> None:
    from verl_digen.data import builtin_prompt_records, load_prompt_records

    path = tmp_path / "p.txt"
    path.write_text("one\n\ntwo\n")
    assert load_prompt_records(path) == [{"prompt": "one"}, {"prompt": "two"}]
    assert builtin_prompt_records("demo") == [{"prompt": p} for p in builtin_prompts("demo")]


def test_records_of_parquet_plain_and_verl_format(tmp_path: Path) -> None:
    from verl_digen.data import load_prompt_records

    plain = tmp_path / "plain.parquet"
    pd.DataFrame({"prompt": PROMPTS, "ground_truth": ["A", "B", "C"]}).to_parquet(plain)
    assert load_prompt_records(plain)[1] == {"prompt": PROMPTS[1], "ground_truth": "B"}

    # veRL's RL parquet: chat-format prompt, ground truth under reward_model, extra_info
    verl_rows = pd.DataFrame({
        "data_source": ["ocr", "ocr"],
        "prompt": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": 'a sign "HI"'}],
                   [{"role": "user", "content": 'a mug "TEA"'}]],
        "reward_model": [{"style": "rule", "ground_truth": "HI"}, {"style": "rule", "ground_truth": "TEA"}],
        "extra_info": [{"index": 0}, {"index": 1}],
    })
    path = tmp_path / "verl.parquet"
    verl_rows.to_parquet(path)
    records = load_prompt_records(path)
    assert [r["prompt"] for r in records] == ['a sign "HI"', 'a mug "TEA"']
    assert [r["ground_truth"] for r in records] == ["HI", "TEA"]
    assert records[0]["data_source"] == "ocr" and records[1]["extra_info"] == {"index": 1}
    assert records[0]["raw_prompt"][0] == {"role": "system", "content": "be brief"}

    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"prompt": [[{"role": "system", "content": "x"}]]}).to_parquet(bad)
    with pytest.raises(ValueError, match=r"row 0: 'prompt' is a chat with no user message"):
        load_prompt_records(bad)


def test_a_chats_system_message_is_kept_apart_from_the_image_prompt_and_said(tmp_path: Path, caplog) -> None:
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_digen.data import load_prompt_records

    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "system", "content": "Describe the image."}, {"role": "user", "content": "a red fox"}],
         "negative_prompt": "blurry"},
        {"prompt": [{"role": "user", "content": "a blue bird"}], "negative_prompt": None},
    ]), path)
    with caplog.at_level(logging.WARNING, logger="verl_digen.data.prompts"):
        records = load_prompt_records(path)
    assert [r["prompt"] for r in records] == ["a red fox", "a blue bird"]
    assert records[0]["system_prompt"] == "Describe the image." and "system_prompt" not in records[1]
    assert records[0]["negative_prompt"] == "blurry"
    assert "1 of 2 chats have a system message" in caplog.text and "system_prompt" in caplog.text


def test_a_chat_template_makes_the_image_prompt_and_negative_chats_are_read(tmp_path: Path) -> None:
    """veRL's custom_chat_template (veRL-Omni's SD3.5 recipe renders the user messages only), and
    the negative prompt as veRL-Omni's Qwen-Image data script writes it: a chat of its own."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_digen.data import load_prompt_records

    path = tmp_path / "chats.parquet"
    system = {"role": "system", "content": "Describe the image."}
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [system, {"role": "user", "content": "a red fox"}],
         "negative_prompt": [system, {"role": "user", "content": "blurry"}]},
    ]), path)
    (record,) = load_prompt_records(path)
    assert (record["prompt"], record["negative_prompt"]) == ("a red fox", "blurry")  # the last user messages
    assert record["raw_negative_prompt"][1]["content"] == "blurry"
    tagged = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (record,) = load_prompt_records(path, tagged)
    assert record["prompt"] == "<system>Describe the image.<user>a red fox"
    assert record["negative_prompt"] == "<system>Describe the image.<user>blurry"
    with pytest.raises(ValueError, match=r"digen.data.chat_template is not a valid Jinja template"):
        load_prompt_records(path, "{% for m in messages %}")
    with pytest.raises(ValueError, match=r"row 0: digen.data.chat_template failed on this chat"):
        load_prompt_records(path, "{{ messages[5]['content'] }}")
    pq.write_table(pa.Table.from_pylist([{"prompt": "a cat", "negative_prompt": 3}]), path)
    with pytest.raises(ValueError, match=r"'negative_prompt' must be a string or a chat, got int"):
        load_prompt_records(path)
