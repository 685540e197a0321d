"""A run, resolved once: every setting of the config, typed and checked, with what the config left
open filled in (the base model and tokenizer it starts from, the vocabulary, the attention kernel,
the layout), and what resolving found (the tokenizer and chat template, where the run starts, the
Target its programs are compiled for). `training.settings.resolve` makes the one Run an entry point
hands down; nothing below the entry points reads the raw config, and nothing rewrites a Run but
`dataclasses.replace` (training/layout.py lays out candidates so).

  run = settings.resolve(config)
  run.model.d_model, run.mesh.fsdp, run.data.tokenizer, run.target.name, run.tokenizer.name

Each section is the typed form its own module defines and checks (model.ModelConfig,
sharding.MeshConfig, …); `Run.as_dict` is the config as a run saves it (workdir/config.json, each
checkpoint), the form a resumed run and sample.py read back.
"""

import dataclasses
import pathlib
import typing

from data.config import DataConfig
from model import ModelConfig
from planning.target import PlanConfig, Target
from runtime.distributed import DistributedConfig
from sharding.hierarchical import PartitionConfig
from sharding.mesh import MeshConfig
from training.optimizer import OptimizerConfig

HF, RUN = 'hf', 'run'  # Start.kind: a Hugging Face checkpoint, a meshlm run's
RANDOM = 'random'  # config.init_from: freshly drawn parameters, on purpose


@dataclasses.dataclass(frozen=True)
class LossConfig:
  z_loss: float  # weight of log(Z)², which keeps the softmax normaliser near 1


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  """DPO's loss on preference records (training/step.py: preference_sums)."""
  beta: float  # β: the scale of the implicit reward β·(log π − log π_ref)
  label_smoothing: float  # ε: the loss −(1−ε)·log σ(β·h) − ε·log σ(−β·h), h the reward margin


@dataclasses.dataclass(frozen=True)
class LmEvalConfig:
  """lm-eval's tasks scored during training (evaluation/during.py; the entry point adds the hook)."""
  tasks: str  # task or group names, comma-separated; '': none
  every: int  # steps between scorings (0: only at the last step)
  limit: float  # examples a task at most (a fraction below 1); 0: all
  include_path: str  # more task directories, comma-separated
  batch_size: int  # rows a forward

  @property
  def task_names(self) -> list[str]:
    return [name.strip() for name in self.tasks.split(',') if name.strip()]

  @property
  def include_paths(self) -> list[str]:
    return [path.strip() for path in self.include_path.split(',') if path.strip()]


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run's parameters come from (config.init_from), found once by settings.resolve."""
  init_from: str  # as given: '', random, hf:DIR, or a run's workdir or checkpoint
  kind: str = ''  # HF, RUN, or '' (fresh parameters)
  path: pathlib.Path | None = None  # HF: the checkpoint's directory; RUN: the run's workdir
  saved: dict | None = dataclasses.field(default=None, compare=False)  # RUN: its saved config

  @property
  def fresh(self) -> bool:
    return not self.kind


# The config's sections and the typed form each becomes.
SECTIONS = {'model': ModelConfig, 'mesh': MeshConfig, 'partition': PartitionConfig,
            'optimizer': OptimizerConfig, 'loss': LossConfig, 'dpo': DpoConfig,
            'distributed': DistributedConfig,
            'plan': PlanConfig, 'data': DataConfig, 'lm_eval': LmEvalConfig}
# What resolving found: not settings, never saved.
RESOLVED = ('tokenizer', 'template', 'start', 'target')


@dataclasses.dataclass(frozen=True)
class Run:
  workdir: str
  seed: int
  train_steps: int
  log_every: int
  eval_every: int
  eval_batches: int
  checkpoint_every: int
  keep_checkpoints: int
  init_from: str
  init_adapters: str
  dry_run: bool
  max_bad_steps: int
  profile_steps: int
  profile_start: int
  batch_size: int
  microbatches: int
  seq_len: int
  model: ModelConfig
  mesh: MeshConfig
  partition: PartitionConfig
  optimizer: OptimizerConfig
  loss: LossConfig
  dpo: DpoConfig
  distributed: DistributedConfig
  plan: PlanConfig
  data: DataConfig
  lm_eval: LmEvalConfig
  tokenizer: typing.Any = dataclasses.field(default=None, compare=False)  # data.tokenizers'
  template: typing.Any = None  # the chat template its records render with (data/chat.py: owned)
  start: Start | None = None
  target: Target | None = dataclasses.field(default=None, compare=False)

  @classmethod
  def of(cls, values: dict, **resolved) -> 'Run':
    """A Run from a config's values (nested dicts, every setting; settings.resolve fills them),
    each section built, so checked, by its own type."""
    sections = {name: kind(**values[name]) for name, kind in SECTIONS.items()}
    return cls(**{**values, **sections, **resolved})

  def as_dict(self) -> dict:
    """The settings as nested dicts, as configs/base.py lays them out (what a run saves)."""
    values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
              if field.name not in RESOLVED}
    return {name: dataclasses.asdict(value) if name in SECTIONS else value
            for name, value in values.items()}

  def differentiates_bf16(self) -> bool:
    """Whether the step's trained parameters are bf16: in param_dtype, or the compute-dtype copy
    of master weights kept off the devices (training/tiers.py)."""
    opt = self.optimizer
    dtype = (self.model.compute_dtype if opt.tiered and not opt.master_on_devices
             else self.model.param_dtype)
    return dtype == 'bfloat16'

  def untiered_because(self) -> str | None:
    """Why the optimizer state's tiers (training/tiers.py) do not run with this run yet, or
    None where they do."""
    model = self.model
    return (f'config.model.lora_rank={model.lora_rank} trains adapters small enough for the '
            'devices' if model.lora_rank else
            f'config.model.draft_heads={model.draft_heads} clips the heads apart'
            if model.draft_heads else
            "config.model.router_bias_rate steps the routers' bias inside the step"
            if model.router_bias_rate else
            "config.data.record='preference' (DPO) keeps a reference model in the state"
            if self.data.preference else None)

  def replace(self, **sections) -> 'Run':
    """This run with some settings changed: `section={field: value}` for a section's fields,
    `name=value` for a top-level one. Each section rebuilt is checked again."""
    changes = {name: (dataclasses.replace(getattr(self, name), **value) if name in SECTIONS
                      and isinstance(value, dict) else value) for name, value in sections.items()}
    return dataclasses.replace(self, **changes)
