"""From a raw config to a resolved, checked one: the first thing every entry point does (train.py
through `loop.run`, sample.py through `sampling.load`, the benchmarks, a notebook).

  config = settings.resolve(config)

Resolving fills in what the config leaves open: `config.init_from='hf:DIR'` gives config.model
(and the tokenizer) from a Hugging Face checkpoint's config.json; `config.model.vocab_size=0`
becomes the tokenizer's size, padded. Checking (`check`) judges every setting that can be judged
without devices or files, each bad one a ValueError naming `config.<field>` and the fix. What
depends on the devices (the mesh against their count and the model's dimensions, cuDNN on a
GPU, pinned host memory) is `training.state.build`'s, which raises `sharding.MeshMismatch` for a
mesh the model or batch cannot use; files (data, checkpoints, the workdir) are checked where
they are opened, before anything is written.
"""

import functools

from configs import base
from data import tokenizers
from model import ModelConfig
from planning import gpus
from runtime import distributed, huggingface
import sharding
from training import optimizer

MINIMA = (('train_steps', 1), ('batch_size', 1), ('microbatches', 1), ('seq_len', 1),
          ('log_every', 1), ('profile_steps', 0), ('profile_start', 0), ('eval_every', 0),
          ('eval_batches', 0), ('checkpoint_every', 0), ('keep_checkpoints', 1),
          ('max_bad_steps', 1), ('data.workers', 0), ('data.prefetch', 1), ('plan.devices', 0),
          ('plan.memory_gb', 0))


def resolve(config):
  """A checked copy of `config` with what it leaves open filled in (module docstring)."""
  config = huggingface.with_model_settings(config, base.get_config().model)
  config = tokenizers.with_vocab_size(config, tokenizers.load(config.data))
  check(config)
  return config


def check(config) -> None:
  """Every check of `config` that needs no devices or files; ValueError naming the setting."""
  for field, low in MINIMA:
    value = functools.reduce(getattr, field.split('.'), config)
    if value < low:
      raise ValueError(f'config.{field}={value} must be at least {low}')
  ModelConfig.from_config(config.model)
  sharding.check_mesh_config(config.mesh)
  optimizer.check(config.optimizer)
  distributed.check(config.distributed)
  if config.plan.target:
    gpus.get(config.plan.target)
