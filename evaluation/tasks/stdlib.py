"""The shipped tasks' documents (lm-eval's `custom_dataset`): read from the JSONL files beside
this one, built by scripts/build_eval_tasks.py, so a task needs neither a download nor the
working directory it is run from."""

import json
import pathlib

import datasets

HERE = pathlib.Path(__file__).resolve().parent


def _test_split(name: str) -> datasets.DatasetDict:
  with open(HERE / f'{name}.jsonl') as f:
    return datasets.DatasetDict({'test': datasets.Dataset.from_list([json.loads(line) for line in f])})


def next_line(**_) -> datasets.DatasetDict:
  return _test_split('stdlib_next_line')


def complete(**_) -> datasets.DatasetDict:
  return _test_split('stdlib_complete')
