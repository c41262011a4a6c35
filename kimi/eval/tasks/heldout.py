"""The shipped tasks' data, read from the JSON lines beside this file (lm-eval's `custom_dataset`), so the
tasks need no hub and work from any directory. kimi/eval/build_tasks.py writes the files."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _split(name: str):
    import datasets

    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def lastword(**_task_metadata):
    return _split("lastword.jsonl")


def cloze(**_task_metadata):
    return _split("cloze.jsonl")
