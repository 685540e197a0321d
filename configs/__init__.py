"""ml-collections configs. `load('llama.py:1b')` gives what `--config=configs/llama.py:1b` gives."""

import importlib
import pathlib


def load(spec: str):
  """A locked config from 'name.py[:arg]' or 'configs/name.py[:arg]' (for notebooks and tests)."""
  path, _, arg = spec.partition(':')
  module = importlib.import_module(f'configs.{pathlib.Path(path).stem}')
  config = module.get_config(arg) if arg else module.get_config()
  config.lock()
  return config
