"""Task `hf`: prompts and references from datasets built in code (save_to_disk, parquet, json, csv), chat
`messages` prompts through the chat template, and bad data failing at start with source, row and field."""

import pytest
from datasets import Dataset, DatasetDict

from asyncrlhf.config import load_config
from asyncrlhf.models import encode_prompts, load_tokenizer
from asyncrlhf.tasks import TaskError, fit_prompts, load_task, plain_text

pytestmark = pytest.mark.unit

GSM = [
    {"question": "Tom has 3 apples and buys 2 more. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "A box holds 12 eggs. How many in 3 boxes?", "answer": "12 * 3 = 36\n#### 36"},
    {"question": "Half of 1,000?", "answer": "1000 / 2 = 500\n#### 500"},
]


def task(*overrides):
    return load_config(["configs/tiny.yaml"], ["task.name=hf", *overrides])


def test_save_to_disk_splits_prompt_field_and_gsm8k_references(tmp_path):
    splits = DatasetDict({"train": Dataset.from_list(GSM), "test": Dataset.from_list(GSM[:1])})
    splits.save_to_disk(tmp_path / "d")
    cfg = task(f"task.dataset={tmp_path}/d", "task.prompt_field=question", "task.eval_split=test",
               "task.reference_field=answer", "task.reference_pattern='####\\s*(.+)$'")
    t = load_task(cfg.task)
    assert t.train == [r["question"] for r in GSM] and t.eval == [GSM[0]["question"]]
    assert t.train_references == ["5", "36", "500"]


@pytest.mark.parametrize("kind", ["parquet", "json", "csv"])
def test_local_files(tmp_path, kind):
    path = tmp_path / f"data.{'jsonl' if kind == 'json' else kind}"
    getattr(Dataset.from_list(GSM), f"to_{kind}")(str(path))
    t = load_task(task(f"task.dataset={path}", "task.prompt_field=question", "task.max_examples=2",
                       "task.reference_field=answer").task)
    assert t.train == [GSM[0]["question"], GSM[1]["question"]]
    assert t.train_references == [GSM[0]["answer"], GSM[1]["answer"]]  # no pattern: the whole field


def test_chat_messages_render_with_the_chat_template_and_the_config_system_prompt(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Summarise: the cat sat."}]},
            {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]}]
    Dataset.from_list(rows).save_to_disk(tmp_path / "chat")
    cfg = task(f"task.dataset={tmp_path}/chat", "task.prompt_field=messages",
               "model.system_prompt=You summarise.", "model.max_prompt_tokens=256")
    t = load_task(cfg.task)
    assert plain_text(t.train[0]) == "Summarise: the cat sat." and plain_text(t.train[1]) == "Hi"
    tokenizer = load_tokenizer(cfg.model)
    first, second = (tokenizer.decode(ids) for ids in encode_prompts(tokenizer, t.train, cfg.model))
    # the tiny tokenizer's template: "<s>{role}\n{content}</s>\n" per message, then "<s>assistant\n"
    assert first == "<s>system\nYou summarise.</s>\n<s>user\nSummarise: the cat sat.</s>\n<s>assistant\n"
    assert second == "<s>system\nBe terse.</s>\n<s>user\nHi</s>\n<s>assistant\n"  # the data's own system


def test_a_missing_field_fails_naming_source_row_and_field(tmp_path):
    rows = [{"prompt": "ok"}, {"text": "no prompt here"}]
    Dataset.from_list(rows).to_json(str(tmp_path / "d.jsonl"))
    with pytest.raises(TaskError, match=r"d.jsonl split `train`, row 1: no field `prompt`.*on_bad_row=skip"):
        load_task(task(f"task.dataset={tmp_path}/d.jsonl").task)


def test_a_wrong_type_fails_or_is_skipped_and_counted(tmp_path, caplog):
    rows = [{"prompt": "fine"}, {"prompt": ""}, {"prompt": "also fine"}]
    Dataset.from_list(rows).save_to_disk(tmp_path / "d")
    with pytest.raises(TaskError, match=r"row 1: field `prompt` is an empty string"):
        load_task(task(f"task.dataset={tmp_path}/d").task)
    Dataset.from_list([{"prompt": 3}, {"prompt": 4}]).save_to_disk(tmp_path / "n")
    with pytest.raises(TaskError, match=r"row 0: field `prompt` must be a string or a list of"):
        load_task(task(f"task.dataset={tmp_path}/n").task)
    t = load_task(task(f"task.dataset={tmp_path}/d", "task.on_bad_row=skip").task)
    assert t.train == ["fine", "also fine"] and "skipped 1 bad rows of 3" in caplog.text


def test_an_empty_or_missing_split_fails(tmp_path):
    Dataset.from_dict({"question": [], "answer": []}).to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(TaskError, match="split `train` is empty"):
        load_task(task(f"task.dataset={tmp_path}/empty.parquet", "task.prompt_field=question").task)
    DatasetDict({"train": Dataset.from_list(GSM)}).save_to_disk(tmp_path / "d")
    with pytest.raises(TaskError, match="has no split `validation`"):
        load_task(task(f"task.dataset={tmp_path}/d", "task.split=validation").task)
    with pytest.raises(TaskError, match="no such file"):
        load_task(task(f"task.dataset={tmp_path}/nope.parquet").task)


def test_a_reference_that_does_not_match_the_pattern_names_the_row(tmp_path):
    Dataset.from_list([*GSM, {"question": "q", "answer": "no marker"}]).save_to_disk(tmp_path / "d")
    with pytest.raises(TaskError, match=r"row 3: reference field `answer` does not match"):
        load_task(task(f"task.dataset={tmp_path}/d", "task.prompt_field=question",
                       "task.reference_field=answer", "task.reference_pattern='####\\s*(.+)$'").task)


def test_a_prompt_over_the_window_fails_is_skipped_or_truncated(tmp_path, caplog):
    rows = [{"prompt": "short"}, {"prompt": "x" * 200}, {"prompt": "fine"}]
    Dataset.from_list(rows).save_to_disk(tmp_path / "d")
    base = [f"task.dataset={tmp_path}/d", "model.max_prompt_tokens=64", "model.apply_chat_template=false"]
    tokenizer = load_tokenizer("tiny")

    def fit(*overrides):
        cfg = task(*base, *overrides)
        t = load_task(cfg.task)
        whole = cfg.model.model_copy(update={"max_prompt_tokens": 1 << 30})
        return fit_prompts(t, encode_prompts(tokenizer, t.train, whole), 64, cfg.task)[0]

    with pytest.raises(TaskError, match=r"row 1, field `prompt`: the prompt is \d+ tokens, over model"):
        fit("task.too_long=fail")
    assert fit("task.too_long=skip").train == ["short", "fine"] and "skipped 1 of 3 prompts" in caplog.text
    assert len(fit().train) == 3  # truncate (the default): kept, their last tokens
