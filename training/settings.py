"""From a raw config to a resolved, checked one: the first thing every entry point does (train.py
through `loop.run`, sample.py through `sampling.load`, the benchmarks, a notebook).

  config, target = settings.resolve(config)

Resolving fills in what the config leaves open: `config.init_from` gives the base model's settings
(and the tokenizer) from where it starts, a Hugging Face checkpoint's config.json or a meshlm run's
saved config (`with_start`; another tokenizer than its own is refused); the tokenizer is a resumed
run's own copy (data/tokenizers.py: owned); `config.model.vocab_size=0` becomes the tokenizer's
size, padded; `config.model.attention='auto'` a kernel. It also gives the run's Target
(planning/target.py): the devices its programs are compiled for and what they are, which everything
after reads rather than looking the GPU up again. Checking (`check`) judges every setting that can
be judged without devices or files, each bad one a ValueError naming `config.<field>` and the fix.
What depends on the devices (the mesh against their count and the model's dimensions, cuDNN on a
GPU, pinned host memory) is `training.state.build`'s, which raises `sharding.MeshMismatch` for a
mesh the model or batch cannot use; files (data, checkpoints, the workdir) are checked where they
are opened, before anything is written.
"""

import dataclasses
import difflib
import math
import pathlib

import jax
import ml_collections

from configs import base, effects
from data import tokenizers, tokens
from interop import huggingface
from model import ModelConfig
from planning import gpus, timing
from planning import target as target_lib
from planning.target import Target
from runtime import checkpoint, distributed
from sharding import hierarchical
import sharding


def _at_least(low):
  return lambda value: value >= low, f'at least {low}'


POSITIVE = (lambda value: value > 0, 'positive')
SHARE = (lambda value: 0 <= value < 1, 'in [0, 1)')

# The values every number of a config may take. The model's shapes and blocks and the mesh's sizes
# are ModelConfig's and sharding.check_mesh_config's to judge, with what they must divide.
RANGES = {
    'seed': _at_least(0), 'train_steps': _at_least(1), 'batch_size': _at_least(1),
    'microbatches': _at_least(1), 'seq_len': _at_least(1), 'log_every': _at_least(1),
    'profile_steps': _at_least(0), 'profile_start': _at_least(0), 'eval_every': _at_least(0),
    'eval_batches': _at_least(0), 'checkpoint_every': _at_least(0),
    'keep_checkpoints': _at_least(1), 'max_bad_steps': _at_least(1),
    'model.rope_theta': POSITIVE, 'model.rope_factor': POSITIVE,
    'model.rope_low_freq_factor': POSITIVE, 'model.rope_high_freq_factor': POSITIVE,
    'model.rope_original_length': _at_least(1), 'model.max_position_embeddings': _at_least(0),
    'model.norm_eps': POSITIVE, 'model.lora_rank': _at_least(0), 'model.lora_alpha': POSITIVE,
    'model.experts': _at_least(0), 'model.experts_per_token': _at_least(1),
    'model.shared_experts': _at_least(0), 'model.expert_d_ff': _at_least(0),
    'model.dense_layers': _at_least(0), 'model.router_bias_rate': _at_least(0),
    'model.capacity_factor': _at_least(0), 'model.expert_buffer': _at_least(0),
    'model.load_balance_loss': _at_least(0), 'model.router_z_loss': _at_least(0),
    'optimizer.learning_rate': _at_least(0), 'optimizer.warmup_steps': _at_least(0),
    'optimizer.min_lr_ratio': (lambda value: 0 <= value <= 1, 'in [0, 1]'),
    'optimizer.b1': SHARE, 'optimizer.b2': SHARE, 'optimizer.eps': _at_least(0),
    'optimizer.weight_decay': _at_least(0), 'optimizer.grad_clip': _at_least(0),
    'loss.z_loss': _at_least(0),
    'distributed.num_processes': _at_least(0), 'distributed.process_id': _at_least(-1),
    'distributed.initialization_timeout_s': POSITIVE,
    'distributed.heartbeat_timeout_s': POSITIVE,
    'plan.devices': _at_least(0), 'plan.memory_gb': _at_least(0),
    'data.validation_fraction': SHARE, 'data.workers': _at_least(0), 'data.prefetch': _at_least(1),
}


@dataclasses.dataclass(frozen=True)
class Resolved:
  """What `resolve` settled, once: the entry points read the tokenizer from here rather than load
  it again. Unpacks as (config, target)."""
  config: ml_collections.ConfigDict  # checked, with what it left open filled in
  target: Target  # what its programs are compiled for (planning/target.py)
  tokenizer: tokenizers.Tokenizer  # the run's own (a resumed run's copy in its workdir)

  def __iter__(self):
    return iter((self.config, self.target))


def resolve(config, devices=None) -> Resolved:
  """`config` checked, with what it leaves open filled in (module docstring), and its Target, for
  a run on `devices` (default: this process's).

    config, target = settings.resolve(config)
  """
  start = started_from(config)
  config = with_start(config, start)
  tokenizer = tokenizers.owned(config.data, config.workdir)  # a resumed run's own copy
  check_start_tokenizer(config, tokenizer, start)
  config = tokenizers.with_vocab_size(config, tokenizer)
  check(config)
  target = target_lib.resolve(config.plan, config.dry_run,
                              jax.devices() if devices is None else devices)
  if config.partition.hierarchical and not config.mesh.auto:  # the search checks its meshes
    hierarchical.check_nodes(config.partition, sharding.mesh_shape(config.mesh, target.n_devices),
                             target.gpus_per_node)
  return Resolved(with_attention(config, target.kernels, cudnn=target.on_gpu), target, tokenizer)


RANDOM = 'random'  # config.init_from: freshly drawn parameters, on purpose


def started_from(config) -> tuple[dict, pathlib.Path] | None:
  """(the saved config, the workdir) of the meshlm run `config.init_from` names; else None."""
  if huggingface.directory(config.init_from) or config.init_from in ('', RANDOM):
    return None
  return checkpoint.saved_run(config.init_from)


def with_start(config, start=None):
  """A copy of `config` whose base model is the checkpoint's it starts from (`config.init_from`:
  a Hugging Face model's config.json, or a meshlm run's saved config, whose settings of the
  kinds configs/effects.py: FROM_CHECKPOINT it takes), with its tokenizer where the config leaves
  the default. A setting given other than its default and the checkpoint's is an error naming
  both: its parameters were trained for that model."""
  defaults = base.get_config()
  if start is None:
    return huggingface.with_model_settings(config, defaults.model)
  saved, run = start
  if not saved:  # unreadable: the checkpoint's own check names it
    return config
  config = config.copy_and_resolve_references()
  for field in effects.of_kinds(effects.FROM_CHECKPOINT):
    value, given = effects.get(saved, field, _UNSAVED), effects.get(config, field)
    if value is _UNSAVED or value == given:
      continue
    if given != effects.get(defaults, field):
      raise ValueError(
          f'config.{field}={given!r}, but config.init_from={config.init_from} was trained with '
          f'{value!r}; drop the setting (the checkpoint decides it) or start from another '
          'checkpoint')
    section, key = field.rsplit('.', 1)
    config[section][key] = value
  kept = effects.get(saved, 'data.tokenizer', 'byte')
  if config.data.tokenizer == 'byte' and kept != 'byte':  # the default: take the run's own
    config.data.tokenizer = kept
    config.data.tokenizer_model = tokenizers.kept_model(run, saved['data']) or saved['data'][
        'tokenizer_model']
  return config


_UNSAVED = object()


def check_start_tokenizer(config, tokenizer, start) -> None:
  """ValueError if `config.init_from`, a Hugging Face model or a meshlm run (`start`:
  started_from's), was trained with another tokenizer than `tokenizer` (its embeddings are those
  ids'), naming both."""
  hf = huggingface.directory(config.init_from)
  if hf and (hf / 'tokenizer.json').is_file():
    theirs = tokenizers.HFTokenizer(str(hf / 'tokenizer.json'))
  elif start is None or 'data' not in start[0]:
    return
  else:
    saved, run = start
    data = ml_collections.ConfigDict(saved['data'])
    if kept := tokenizers.kept_model(run, data):
      data.tokenizer_model = kept
    try:
      theirs = tokenizers.load(data)
    except ValueError:  # its files are gone: the vocabulary check is what is left
      return
  if theirs.fingerprint != tokenizer.fingerprint:
    raise ValueError(
        f'config.init_from={config.init_from} was trained with the {theirs.name} tokenizer '
        f'{theirs.fingerprint}, and config.data names {tokenizer.name} {tokenizer.fingerprint}: '
        'its embeddings are the first one\'s ids. Leave config.data.tokenizer at byte to take '
        "the run's own, or name the same files")


def with_attention(config, gpu: gpus.GPU | None, cudnn: bool = True):
  """`config.model.attention='auto'` made concrete for programs ranked for `gpu`'s kernels (None:
  a CPU's), where cuDNN's compile (`cudnn`: not in a CPU stand-in for a GPU). On a CPU `xla`
  (our kernel only interprets there; it runs only the ring, context_parallel='ring'); on a GPU
  the fused kernel that runs this model and mesh (kernels.fused_for) which the time model
  predicts fastest (timing.rank_attention: cuDNN on an H100 at head dims 64 and 128, its
  backward reaching 2.6× ours). A config that names one keeps it, and so does one whose mesh the
  layout search picks (config.mesh.auto): it chooses for each candidate (layout.with_layout)."""
  if config.model.attention != 'auto' or config.mesh.auto:
    return config
  config = config.copy_and_resolve_references()
  config.model.attention = next(kernel for kernel, _ in attention_choice(config, gpu)
                                if cudnn or kernel != 'cudnn')
  return config


def attention_choice(config, gpu: gpus.GPU | None) -> list[tuple[str, float]]:
  """[(implementation, its predicted time ÷ the fastest's)] that `with_attention` chooses from,
  fastest first. Without a GPU, xla; but ring attention is our kernel's alone, anywhere."""
  m = config.model
  if gpu is None:
    return [('pallas' if m.context_parallel == 'ring' else 'xla', 1.0)]
  return timing.rank_attention(m.head_dim, m.compute_dtype, config.seq_len, length_split=(
      config.mesh.sequence != 1 or m.context_parallel == 'ring'))


def check(config) -> None:
  """Every check of `config` that needs no devices or files; ValueError naming the setting.
  The fields first: those of configs/base.py, no others (a typo in a config file would otherwise
  set a field nothing reads); then every number: finite, and within RANGES."""
  unknown(config, base.get_config())
  for field, value in numbers(config):
    if not math.isfinite(value):
      raise ValueError(f'config.{field}={value} is not a number a run can use; give a finite one')
    if field in RANGES and not RANGES[field][0](value):
      raise ValueError(f'config.{field}={value} must be {RANGES[field][1]}')
  model = ModelConfig.from_config(config.model)
  if model.draft_heads and model.draft_heads + 2 > config.seq_len:
    raise ValueError(f'config.model.draft_heads={model.draft_heads}: head k guesses the token '
                     f'k + 1 after each position, which needs rows of at least '
                     f'{model.draft_heads + 2} tokens, and config.seq_len={config.seq_len}; '
                     'lower draft_heads or raise seq_len')
  sharding.check_mesh_config(config.mesh)
  distributed.check(config.distributed)
  hierarchical.check(config.partition, config.mesh)
  if config.partition.hierarchical:
    check_hierarchical(model)
  tokens.check(config.data, config.workdir)
  if config.plan.target:
    gpus.get(config.plan.target)  # before anything slower, such as the GPU compiler's devices


def check_hierarchical(model: ModelConfig) -> None:
  """What config.partition.hierarchical=True does not run with, whatever the devices."""
  if model.frozen_base:
    raise ValueError('config.partition.hierarchical=True splits a trained state over nodes; under '
                     'LoRA (config.model.lora_rank > 0) or config.model.draft_only only small '
                     'added parameters train, and their gradients are small: set it to False')
  if model.experts:
    raise ValueError('config.partition.hierarchical=True does not run MoE models yet: their '
                     "router's balancing loss is over the whole batch, which each data "
                     'replica would see only its share of; set it to False')
  if model.matmul_precision == 'fp8':
    raise ValueError("config.partition.hierarchical=True does not run with config.model."
                     "matmul_precision='fp8' yet: each data replica would scale its own share "
                     "of a tensor; use one of them")


def check_start(config) -> None:
  """A run that trains on a frozen base (LoRA, draft heads alone) starts from a model, or says it
  means a random one: ValueError otherwise. (Training's alone: a plan needs no weights.)"""
  model = config.model
  if (model.lora_rank or model.draft_only) and not config.init_from:
    what = ('config.model.draft_only=True trains draft heads on a frozen model' if
            model.draft_only else f'config.model.lora_rank={model.lora_rank} trains adapters on '
            'a frozen base')
    raise ValueError(f'{what}, and config.init_from is empty: it would be random weights. Start '
                     "from a model (--config.init_from=hf:DIR, or a run's workdir), or set "
                     f'--config.init_from={RANDOM} to mean it')


def numbers(config, prefix: str = ''):
  """(field, value) for every int and float a config holds (not its booleans), nested fields as
  `optimizer.b1`."""
  for key, value in config.items():
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      yield from numbers(value, f'{prefix}{key}.')
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield f'{prefix}{key}', value


def unknown(config, known, prefix: str = '') -> None:
  """ValueError naming a field of `config` that `known` (configs/base.py's config) lacks."""
  for key, value in config.items():
    if key not in known:
      hint = difflib.get_close_matches(key, list(known), n=1)
      raise ValueError(f'config.{prefix}{key} is not a setting meshlm has'
                       f'{f"; did you mean config.{prefix}{hint[0]}?" if hint else ""} '
                       '(configs/base.py lists every setting); fix the config file')
    if isinstance(value, (ml_collections.ConfigDict, dict)) and isinstance(
        known[key], (ml_collections.ConfigDict, dict)):
      unknown(value, known[key], f'{prefix}{key}.')
