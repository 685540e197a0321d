"""meshlm beside MaxText on the same work and the same compiler: each preset's train step compiled
by both systems for the same compile-only H100s by the same XLA (this environment's jaxlib), and both
optimized programs read by meshlm's time model (planning/timing.py). Every time below is that
model's prediction, never a measurement; memory is each compiler's own plan.

  python -m benchmarks.peers                                  # every preset of PRESETS
  python -m benchmarks.peers --presets=8b --out=benchmarks/results/peers-h100-deviceless.json
  python -m benchmarks.peers --presets=8b,70b --meshlm=model.grad_reduce_dtype=bfloat16

MaxText (PyPI's maxtext==MAXTEXT) lives in an environment of its own, made on first use beside this
one (<environment>/meshlm-peers/maxtext-<version>-jax-<jaxlib>, about 2 GB of downloads; not part
of the suite): MaxText with the modules its train step imports (REQUIREMENTS; its package declares
none outside a CUDA or TPU extra, and that extra pins another jax), at this environment's jax,
jaxlib and flax, with the GPU compiler of planning/gpu_compiler.py on its path. Its step is
compiled by its own code in a child process there (benchmarks/peers_maxtext.py).

Same work: each preset's global batch, sequence length, microbatches (MaxText's
gradient_accumulation_steps) and GPUs are meshlm's (configs/llama.py RUNS and GPUS); both shard
every parameter over every GPU (fsdp), compute in bf16 with fp32 weights, and run cuDNN's fused
attention through JAX (meshlm's attention='cudnn', MaxText's cudnn_flash_jax). meshlm's remat
'dots' saves every projection's output: MaxText's 'minimal' saves the same tensors by its names;
'full' is 'full' in both. meshlm's 'dots_attention' also keeps cuDNN's attention output and
softmax statistics, which no MaxText policy names, and the '_except_out' variants (the 8b's and
the 1b's) redo the output projection rather than keep its output: MaxText runs its 'minimal'
there, the nearest, and each system's memory and step show what the difference costs. Everything else is each system's default, which is the point: meshlm's
chunked head and its gradient reduction dtype (config.model.grad_reduce_dtype), MaxText's own.

Per GPU: memory (arguments + outputs + temporaries − donated), the predicted step, tokens/s and MFU
(the model's FLOPs, planning/flops.py, the same for both), the step's parts (GEMM, attention, other
fusions, the rest with launches, exposed communication) and what the reduce-scatters and
all-gathers send, with their dtype.
"""

import dataclasses
import gzip
import importlib.metadata
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
from absl import flags

from benchmarks import report
from configs import llama, moe
from planning import gpu_compiler, gpus, timing
from runtime import cli
from sharding import collectives
from training import settings
from training.programs import compile_and_plan
from training.state import build

MAXTEXT = '0.2.5'
# What maxtext.trainers.pre_train.train_compile imports beyond jax and flax (found by importing
# it in a bare environment), at the versions this benchmark's results were made with.
REQUIREMENTS = ['absl-py==2.5.1', 'aqtp==0.9.0', 'drjax==0.2.1', 'grain==0.2.18',
                'huggingface_hub==2.4.0', 'Jinja2==3.1.6', 'omegaconf==2.4.0', 'optax==0.2.8',
                'orbax-checkpoint==0.12.8', 'packaging==26.4', 'pathwaysutils==0.1.13',
                'pillow==13.0.0', 'pydantic==2.14.4', 'qwix==0.1.8', 'sentencepiece==0.2.3',
                'sympy==1.14.0', 'tiktoken==0.14.0', 'tokamax==0.0.17', 'transformers==5.24.0']


@dataclasses.dataclass(frozen=True)
class Preset:
  config: object  # meshlm's ConfigDict
  gpus: int
  maxtext: tuple[str, ...]  # MaxText settings naming the same model
  expert: int = 1  # experts split over this many GPUs (the expert axis), FSDP over the rest


# MaxText's model files where it has the model; Llama-3.2-1B's shapes over its llama3-8b otherwise.
PRESETS = {
    '8b': lambda: Preset(llama.get_config('8b'), llama.GPUS['8b'], ('model_name=llama3-8b',)),
    '1b': lambda: Preset(llama.get_config('1b'), llama.GPUS['1b'], (
        'model_name=llama3-8b', 'override_model_config=true', 'base_emb_dim=2048',
        'base_num_query_heads=32', 'base_num_kv_heads=8', 'base_num_decoder_layers=16',
        'base_mlp_dim=8192', 'head_dim=64', 'logits_via_embedding=true')),
    '70b': lambda: Preset(llama.get_config('70b'), llama.GPUS['70b'],
                          ('model_name=llama3.1-70b',)),
    # megablox=false as MaxText's own GPU config for it has (configs/gpu/models/mixtral_8x7b.yml):
    # its experts then multiply through jax.lax.ragged_dot. With megablox its GPU program runs
    # them as a loop of tiles whose trip count depends on the routing, which no model can charge.
    'mixtral-8x7b': lambda: Preset(moe.get_config('mixtral-8x7b'), moe.GPUS['mixtral-8x7b'],
                                   ('model_name=mixtral-8x7b', 'megablox=false')),
    # The layout docs/moe.md plans Mixtral at: its experts split over 8 GPUs in both systems
    'mixtral-8x7b-ep8': lambda: Preset(moe.get_config('mixtral-8x7b'), moe.GPUS['mixtral-8x7b'],
                                       ('model_name=mixtral-8x7b', 'megablox=false'), expert=8),
}
# meshlm's policy: MaxText's that saves the same (dots_attention: the nearest, above)
REMAT = {'dots': 'minimal', 'dots_attention': 'minimal', 'dots_except_out': 'minimal',
         'dots_attention_except_out': 'minimal', 'full': 'full'}

_PRESETS = flags.DEFINE_string('presets', ','.join(PRESETS), 'Comma-separated, of PRESETS.')
_ENV = flags.DEFINE_string('maxtext_env', None, "MaxText's environment; default beside this one.")
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')
_MESHLM = flags.DEFINE_multi_string('meshlm', [], "A setting of meshlm's side, as section.field="
                                    'value (model.grad_reduce_dtype=bfloat16); repeatable.')
_MAXTEXT_XLA_FLAGS = flags.DEFINE_string(
    'maxtext_xla_flags', '', "XLA_FLAGS for MaxText's compile (its docs set XLA options so), e.g. "
    'the weight prefetch meshlm sets where gathers cross nodes: '
    '--xla_gpu_pipeline_all_gather=COLLECTIVE_PIPELINING_MODE_ON')
_PROGRAMS = flags.DEFINE_string('programs', None, "Also keep each optimized program there, as "
                                "<preset>-<system>.hlo.txt.gz (what the time model read).")


def environment_dir() -> pathlib.Path:
  jaxlib = importlib.metadata.version('jaxlib')
  return pathlib.Path(_ENV.value or pathlib.Path(sys.prefix) / 'meshlm-peers' /
                      f'maxtext-{MAXTEXT}-jax-{jaxlib}')


def maxtext_python() -> pathlib.Path:
  """The Python of MaxText's environment, made first if it is not there (built in a .partial
  folder, renamed when whole: an interrupted install is redone, never used)."""
  where = environment_dir()
  python = where / 'bin' / 'python'
  if python.is_file():
    return python
  partial = where.with_name(where.name + '.partial')
  shutil.rmtree(partial, ignore_errors=True)  # this benchmark's own unfinished folder
  print(f'making MaxText {MAXTEXT}\'s environment in {where} (about 2 GB; once)', flush=True)
  subprocess.run([sys.executable, '-m', 'venv', str(partial)], check=True)
  pip = [str(partial / 'bin' / 'python'), '-m', 'pip', 'install', '--quiet']
  pinned = [f'{name}=={importlib.metadata.version(name)}' for name in ('jax', 'jaxlib', 'flax')]
  try:
    subprocess.run([*pip, '--no-deps', f'maxtext=={MAXTEXT}'], check=True)
    subprocess.run([*pip, *pinned, *REQUIREMENTS], check=True)
  except subprocess.CalledProcessError as e:
    raise SystemExit(f'benchmarks/peers.py: installing MaxText {MAXTEXT} into {partial} failed '
                     f'({e}); its output is above. Run again to retry') from None
  partial.rename(where)
  return python


def maxtext_settings(preset: Preset, out: pathlib.Path) -> list[str]:
  c = preset.config
  return [*preset.maxtext, 'hardware=gpu', 'attention=cudnn_flash_jax', 'dtype=bfloat16',
          'weight_dtype=float32', f'remat_policy={REMAT[c.model.remat_policy]}',
          f'per_device_batch_size={c.batch_size / c.microbatches / preset.gpus}',
          f'gradient_accumulation_steps={c.microbatches}', f'max_target_length={c.seq_len}',
          f'ici_fsdp_parallelism={preset.gpus // preset.expert}',
          f'ici_expert_parallelism={preset.expert}', 'internal_compile=true',
          f'internal_compile_num_devices={preset.gpus}', 'dataset_type=synthetic',
          'enable_checkpointing=false', 'run_name=peers', f'base_output_directory={out}']


def maxtext_program(preset: Preset) -> tuple[dict, str]:
  """(MaxText's compiled memory and shapes, its optimized program) for `preset`."""
  with tempfile.TemporaryDirectory(prefix='meshlm-peers-') as tmp:
    child = pathlib.Path(__file__).with_name('peers_maxtext.py')
    done = subprocess.run(
        [str(maxtext_python()), str(child), tmp, str(preset.gpus),
         *maxtext_settings(preset, pathlib.Path(tmp))],
        env={**gpu_compiler.environment(),
             **({'XLA_FLAGS': _MAXTEXT_XLA_FLAGS.value} if _MAXTEXT_XLA_FLAGS.value else {})},
        capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f'MaxText did not compile: {done.stderr.strip().splitlines()[-1]}')
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    with gzip.open(pathlib.Path(tmp) / 'hlo.txt.gz', 'rt') as f:
      return figures, f.read()


def meshlm_program(preset: Preset) -> tuple[dict, str]:
  """(meshlm's compiled memory and shapes, its optimized program), compiled as a dry run does."""
  config = preset.config
  config.model.attention = 'cudnn'
  for setting in _MESHLM.value:
    field, _, value = setting.partition('=')
    section, _, key = field.rpartition('.')
    holder = config[section] if section else config
    if key not in holder:
      raise SystemExit(f'--meshlm={setting}: {field} is not a setting of configs/base.py')
    holder[key] = type(holder[key])(value) if not isinstance(holder[key], bool) else (
        value.lower() in ('1', 'true'))
  config.plan.target, config.plan.devices, config.dry_run = 'H100', preset.gpus, True
  if preset.expert > 1:
    config.mesh.fsdp, config.mesh.expert = preset.gpus // preset.expert, preset.expert
  setup = build(settings.resolve(config, log=lambda *_: None))
  compiled, plan = compile_and_plan(setup)
  return ({'argument_bytes': plan.argument_bytes, 'output_bytes': plan.output_bytes,
           'temp_bytes': plan.temp_bytes, 'alias_bytes': plan.alias_bytes,
           'mesh': {k: v for k, v in plan.mesh.items() if v > 1},
           'batch_size': config.batch_size, 'microbatches': config.microbatches,
           'seq_len': config.seq_len, 'flops': plan.flops},
          compiled.as_text())


def figures(memory: dict, hlo: str, preset: Preset, flops: float) -> dict:
  """One system's row: its memory, the time model's step and parts, what its collectives send."""
  gpu = gpus.get('H100')
  step = timing.predict(hlo, gpu)
  sent = collectives.summary(hlo)
  parts = step.breakdown
  c = preset.config
  return {**memory,
          'total_bytes': (memory['argument_bytes'] + memory['output_bytes']
                          + memory['temp_bytes'] - memory['alias_bytes']),
          'step_s': step.seconds,
          'tokens_per_s_per_gpu': c.batch_size * c.seq_len / preset.gpus / step.seconds,
          'mfu': flops / step.seconds / gpu.peak_bf16_flops,
          'gemm_s': parts['gemm'], 'attention_s': parts['attention'],
          'fusion_s': parts['fusion'], 'rest_s': parts['other'] + parts['launch'],
          'exposed_communication_s': parts['communication'], 'gemm_flops': step.gemm_flops,
          'loops_of_unknown_trips': step.loops_charged_once,
          'collectives': {op: {'bytes': s['bytes'], 'by_dtype': s['by_dtype']}
                          for op, s in sent.items()}}


def sent(row: dict, op: str) -> str:
  s = row['collectives'].get(op)
  if not s:
    return '—'
  most = max(s['by_dtype'], key=s['by_dtype'].get)  # the dtype that carries the most bytes
  return f'{s["bytes"] / 2**30:.1f} ({most})'


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.peers', *sys.argv[1:]])
  names = _PRESETS.value.split(',')
  unknown = [n for n in names if n not in PRESETS]
  if unknown:
    raise SystemExit(f'--presets: {unknown} are not of {list(PRESETS)}')
  print(f'H100 (deviceless), jaxlib {jax.__version__}, MaxText {MAXTEXT}; per GPU a step, '
        'predicted by the time model; GiB and seconds')
  head = (f'{"preset":<18}{"system":<9}{"GiB":>7}{"step":>8}{"tok/s":>8}{"MFU":>7}{"GEMM":>7}'
          f'{"attn":>7}{"fusion":>7}{"rest":>7}{"comm":>7}  {"reduce-scatter":<16}all-gather')
  print(head)
  results = []
  for name in names:
    preset = PRESETS[name]()
    ours, our_hlo = meshlm_program(preset)
    flops = ours.pop('flops')
    try:
      theirs, their_hlo = maxtext_program(preset)
    except RuntimeError as e:
      print(f'{name:<18}{"MaxText":<9}{e}')
      results.append({'preset': name, 'gpus': preset.gpus, 'maxtext_error': str(e),
                      'meshlm': figures(ours, our_hlo, preset, flops)})
      continue
    if any(theirs[k] != ours[k] for k in ('batch_size', 'microbatches', 'seq_len')):
      raise SystemExit(f'{name}: MaxText was given other shapes than meshlm ({theirs} vs {ours})')
    rows = {'meshlm': figures(ours, our_hlo, preset, flops),
            'MaxText': figures(theirs, their_hlo, preset, flops)}
    if _PROGRAMS.value:
      kept = pathlib.Path(_PROGRAMS.value)
      kept.mkdir(parents=True, exist_ok=True)
      for system, hlo in (('meshlm', our_hlo), ('maxtext', their_hlo)):
        with gzip.open(kept / f'{name}-{system}.hlo.txt.gz', 'wt') as f:
          f.write(hlo)
    for system, r in rows.items():
      print(f'{name:<18}{system:<9}{r["total_bytes"] / 2**30:>7.2f}{r["step_s"]:>8.3f}'
            f'{r["tokens_per_s_per_gpu"]:>8.0f}{r["mfu"]:>7.1%}{r["gemm_s"]:>7.3f}'
            f'{r["attention_s"]:>7.3f}{r["fusion_s"]:>7.3f}{r["rest_s"]:>7.3f}'
            f'{r["exposed_communication_s"]:>7.3f}  {sent(r, "reduce-scatter"):<16}'
            f'{sent(r, "all-gather")}', flush=True)
    ratio = rows['meshlm']['step_s'] / rows['MaxText']['step_s']
    memory = rows['meshlm']['total_bytes'] / rows['MaxText']['total_bytes']
    print(f'{"":<18}meshlm ÷ MaxText: step {ratio:.3f}, memory {memory:.3f}')
    for system, r in rows.items():
      if r['loops_of_unknown_trips']:
        print(f'{"":<18}{system}: {r["loops_of_unknown_trips"]} loop(s) whose trip count depends '
              'on the data, each charged once: its step is undercounted, not comparable')
    results.append({'preset': name, 'gpus': preset.gpus, 'mesh': ours['mesh'],
                    'batch_size': ours['batch_size'], 'seq_len': ours['seq_len'],
                    'microbatches': ours['microbatches'],
                    'remat': preset.config.model.remat_policy,
                    'maxtext_model': list(preset.maxtext),
                    'step_ratio': ratio, 'memory_ratio': memory, **rows})
  report.emit({'benchmark': 'peers', 'compiled_for': 'H100', 'deviceless': True,
               'source': 'model', 'jax': jax.__version__, 'maxtext': MAXTEXT,
               'flax': importlib.metadata.version('flax'), 'meshlm_settings': _MESHLM.value,
               'maxtext_xla_flags': _MAXTEXT_XLA_FLAGS.value,
               'presets': results,
               'command': report.command()}, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
