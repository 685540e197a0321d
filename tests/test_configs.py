"""Every config in configs/ loads; the small ones build a model and run one step."""

import importlib
import pathlib
import re
import subprocess
import sys

import jax
import pytest

import configs
import configs.fields
from configs import base
from planning import flops
from training import loop, settings
from training.state import build, param_count

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / 'configs'
FILES = sorted(p.name for p in CONFIGS.glob('*.py')  # the config files, not their helpers
               if 'def get_config(' in p.read_text())
PRESETS = {'125m': (115e6, 130e6), '1b': (1.2e9, 1.28e9), '8b': (7.9e9, 8.1e9)}


def load(name, arg=None):
  return configs.load(name + (f':{arg}' if arg else ''))


@pytest.mark.parametrize('name', FILES)
def test_every_config_file_loads_and_has_a_runnable_docstring(name):
  config = load(name)
  assert config.model.n_layers >= 1
  module = importlib.import_module(f'configs.{name[:-3]}')
  assert 'python train.py --config=configs/' in module.__doc__
  assert 'Should reach' in module.__doc__


@pytest.mark.parametrize('preset', list(PRESETS))
def test_llama_presets_have_their_real_sizes_and_shard_over_8_devices(preset):
  config = load('llama.py', preset)
  config.mesh.fsdp = -1
  setup = build(settings.resolve(config))  # abstract only: nothing of this size is allocated
  low, high = PRESETS[preset]
  assert low <= param_count(setup.abstract_state.params) <= high


@pytest.mark.parametrize('preset, total', [('1b', 1.0e9), ('4b', 3.88e9), ('27b', 27.01e9)])
def test_gemma3_presets_have_their_real_sizes_five_local_layers_in_six_and_a_tied_head(preset,
                                                                                       total):
  config = load('gemma3.py', preset)
  config.mesh.fsdp = -1
  setup = build(settings.resolve(config))  # abstract only
  assert abs(param_count(setup.abstract_state.params) - total) < 0.005 * total
  cfg = setup.model_cfg
  assert cfg.tie_embeddings and 'unembed' not in setup.abstract_state.params
  assert cfg.local_layers[:6] == (True,) * 5 + (False,) and cfg.windows == 'mixed'
  assert 'mlp_post_norm' in setup.abstract_state.params['blocks']


@pytest.mark.parametrize('preset, total', [('0.6b', 0.596e9), ('8b', 8.19e9), ('32b', 32.76e9)])
def test_qwen3_presets_have_their_real_sizes_with_qk_norms(preset, total):
  config = load('qwen3.py', preset)
  config.mesh.fsdp = -1
  setup = build(settings.resolve(config))  # abstract only
  assert abs(param_count(setup.abstract_state.params) - total) < 0.005 * total
  assert setup.model_cfg.qk_norm and 'q_norm' in setup.abstract_state.params['blocks']['attn']
  assert setup.model_cfg.tie_embeddings == (preset == '0.6b')


@pytest.mark.parametrize('preset, total, active', [('mixtral-8x7b', 46.7e9, 12.9e9),
                                                   ('qwen3-30b-a3b', 30.5e9, 3.3e9)])
def test_moe_presets_have_their_real_sizes_and_active_parameters(preset, total, active):
  config = load('moe.py', preset)
  config.mesh.fsdp = -1
  setup = build(settings.resolve(config))  # abstract only
  assert abs(param_count(setup.abstract_state.params) - total) < 0.01 * total
  cfg = setup.model_cfg  # the embedding, attention, router, k experts a layer and the head
  taken = cfg.n_layers * flops.matmul_params_per_layer(cfg, experts=True)
  assert abs(taken + 2 * cfg.d_model * cfg.vocab_size - active) < 0.02 * active


def test_the_long_context_preset_splits_its_row_over_8_devices_with_the_ring():
  config = load('llama.py', '8b-128k')
  setup = build(settings.resolve(config))  # abstract only
  assert dict(setup.mesh.shape) == {'data': 1, 'stage': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1, 'sequence': 8}
  assert (config.seq_len, config.batch_size) == (131072, 1)
  assert (setup.model_cfg.attention, setup.model_cfg.context_parallel) == ('pallas', 'ring')


@pytest.mark.parametrize('changes,message', [
    (dict(attention='cudnn'), "each layer takes its window at run time, which cuDNN cannot"),
    (dict(virtual_stages=2), 'pipeline chunks of local and global layers'),
])
def test_what_sliding_windows_cannot_run_with_yet_is_refused_naming_the_setting(changes, message):
  model = base.get_config().model
  model.update(vocab_size=384, n_layers=4, sliding_window=8, global_every=2, **changes)
  with pytest.raises(ValueError, match=message):
    base.ModelConfig.from_config(model).check()


def test_local_and_global_layers_follow_global_every():
  model = base.get_config().model
  model.update(vocab_size=384, n_layers=7, sliding_window=8, global_every=3)
  cfg = base.ModelConfig.from_config(model)
  assert cfg.local_layers == (True, True, False, True, True, False, True)
  assert cfg.windows == 'mixed'
  assert base.ModelConfig.from_config({**model, 'global_every': 0}).windows == 'uniform'
  assert base.ModelConfig.from_config({**model, 'sliding_window': 0}).windows == 'none'


def test_unknown_preset_names_the_choices():
  with pytest.raises(ValueError, match='1b'):
    load('llama.py', '3b')


@pytest.mark.integration
@pytest.mark.parametrize('name', ['base.py', 'default.py'])
def test_small_configs_run_one_step_on_8_devices(name, tmp_path):
  config = load(name)
  config.workdir, config.train_steps, config.eval_batches = str(tmp_path), 1, 1
  records = loop.run(config)
  assert records[0]['step'] == 1 and records[-1]['eval_loss'] > 0
  assert jax.device_count() == 8


def test_model_sharding_kernels_and_the_step_benchmark_import_without_the_data_stack():
  """The GPU image has jax, flax, optax and ml-collections but not tfds or grain."""
  code = '''
import sys
class Block:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ('tensorflow_datasets', 'grain'):
      raise ImportError('not on the GPU image: ' + name)
sys.meta_path.insert(0, Block())
import benchmarks.train_step
import model, sharding, kernels, inference.generate, planning.flops, reporting.metrics
'''
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).resolve().parents[1], timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


def test_every_number_of_the_base_config_must_be_finite_and_in_range():
  """Each int and float setting of configs/base.py, set to NaN, inf (floats: an int setting takes
  neither) and a negative value (-2 where -1 means something), is refused by settings.resolve
  naming it; nothing the rule leaves out can reach a run."""
  from configs import schema
  from training import settings
  fields = {name: default for name, _, default in schema.declared(configs.base.Run)
            if isinstance(default, (int, float)) and not isinstance(default, bool)}
  assert {'optimizer.learning_rate', 'loss.z_loss', 'model.norm_eps', 'seed'} <= set(fields)
  for field, default in fields.items():
    bad = [-2 if field.startswith('mesh.') or field == 'distributed.process_id' else -1]
    if isinstance(default, float):
      bad += [float('nan'), float('inf'), -float('inf')]
    for value in bad:
      config = load('base.py')
      *parents, name = field.split('.')
      node = config
      for parent in parents:
        node = node[parent]
      node[name] = type(default)(value) if isinstance(default, int) else value
      with pytest.raises(ValueError, match=rf'config\.{re.escape(field)}\b'):
        settings.resolve(config)
  settings.resolve(load('base.py'))  # and its defaults pass


def test_every_setting_declares_what_changing_it_does_and_the_docs_show_the_table():
  """configs/base.py: EFFECTS names each setting once, with a kind configs/effects.py knows; the
  resume check compares exactly the kept kinds; docs/checkpoints.md holds the generated table."""
  from configs import base, effects
  settings = effects.fields(base.get_config())
  assert sorted(settings) == sorted(base.EFFECTS), (
      f'undeclared: {sorted(set(settings) - set(base.EFFECTS))}; '
      f'declared but no setting: {sorted(set(base.EFFECTS) - set(settings))}')
  assert set(base.EFFECTS.values()) == set(effects.KINDS)
  kept = effects.of_kinds(effects.KEPT_ON_RESUME)
  assert {'model.lora_alpha', 'model.experts_per_token', 'model.router', 'seed',
          'data.tokenizer_model'} <= set(kept)
  assert not {'model.compute_dtype', 'model.param_dtype', 'optimizer.learning_rate',
              'mesh.fsdp', 'train_steps'} & set(kept)
  docs = (CONFIGS.parent / 'docs' / 'checkpoints.md').read_text()
  assert effects.table() in docs, 'docs/checkpoints.md: paste `python -m configs.effects` in'


def test_the_settings_page_holds_every_declaration():
  from configs import base, schema
  docs = (CONFIGS.parent / 'docs' / 'settings.md').read_text()
  assert schema.table(base.Run) in docs, 'docs/settings.md: paste `python -m configs.base` in'


def test_a_setting_is_one_field_and_everything_else_follows_from_it(tmp_path):
  """A new setting declared as one field of its section (configs/schema.py): `--config` overrides
  it, type-checked; EFFECTS, the range check, the docs' tables, the Run and what a resumed run
  compares all follow, with nothing else written."""
  import dataclasses

  from absl import flags
  from ml_collections import config_flags

  from configs import base, effects, schema

  @dataclasses.dataclass(frozen=True)
  class Loss(base.LossConfig):
    dummy_weight: float = schema.setting(0.5, 'a term a test adds', 'data',
                                         range=schema.at_least(0))

  Run = dataclasses.make_dataclass('Run', [('loss', Loss, schema.section(Loss))],
                                   bases=(base.Run,), frozen=True, kw_only=True)
  defaults = schema.config_dict(Run)
  assert defaults.loss.dummy_weight == 0.5 and 'dummy_weight' not in base.get_config().loss

  def parsed(*argv):  # as train.py's --config flag parses them
    values = flags.FlagValues()
    config_flags.DEFINE_config_dict('config', schema.config_dict(Run), flag_values=values,
                                    sys_argv=['train.py', *argv])
    values(['train.py', *argv])
    return values.config

  config = parsed('--config.loss.dummy_weight=0.25')
  assert config.loss.dummy_weight == 0.25
  with pytest.raises(flags.IllegalFlagValueError):  # a float setting takes no word
    parsed('--config.loss.dummy_weight=heavy')

  declared = schema.effects(Run)
  assert declared['loss.dummy_weight'] == 'data' and 'loss.dummy_weight' not in base.EFFECTS
  raw = config.to_dict()
  configs.fields.check_fields(raw, Run)
  with pytest.raises(ValueError, match=r'config\.loss\.dummy_weight=-1\.0 must be at least 0'):
    configs.fields.check_fields({**raw, 'loss': {**raw['loss'], 'dummy_weight': -1.0}}, Run)
  with pytest.raises(ValueError, match=r'config\.loss\.dummy_weight is not a setting'):
    configs.fields.check_fields(raw)  # meshlm's own Run has no such field

  assert '`loss.dummy_weight`' in effects.table(declared)
  assert '| `loss.dummy_weight` | `0.5` | at least 0 | data | a term a test adds |' in schema.table(Run)

  raw['model']['vocab_size'] = 384
  run = Run.of(raw)
  assert run.loss.dummy_weight == 0.25 and run.as_dict()['loss']['dummy_weight'] == 0.25
  with pytest.raises(ValueError, match=r'config\.loss\.dummy_weight=-2 must be at least 0'):
    run.replace(loss={'dummy_weight': -2})
  saved = run.as_dict()  # what its checkpoints record; a resumed run with another value
  again = {**saved, 'loss': {**saved['loss'], 'dummy_weight': 0.75}}
  assert effects.changed(saved, again, effects.KEPT_ON_RESUME, declared) == [
      ('loss.dummy_weight', 0.25, 0.75)]


def test_a_change_of_every_kept_setting_is_refused_on_resume_and_no_other():
  """runtime/checkpoint.py: check_resume, against a saved config, for each setting in turn."""
  from configs import base, effects
  from runtime import checkpoint
  saved = base.get_config().to_dict()
  for field in effects.fields(base.get_config()):
    config = base.get_config()
    *parents, name = field.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    value = node[name]
    node[name] = (not value if isinstance(value, bool) else value + 1 if isinstance(
        value, (int, float)) else value + 'x')
    if base.EFFECTS[field] in effects.KEPT_ON_RESUME:
      with pytest.raises(ValueError, match=rf'config\.{re.escape(field)}='):
        checkpoint.check_resume(saved, config, pathlib.Path('/w/checkpoints/3'))
    else:
      checkpoint.check_resume(saved, config, pathlib.Path('/w/checkpoints/3'))
