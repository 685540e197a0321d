"""meshlm beside MaxText on the same work and the same compiler: each preset's train step compiled
by both systems for the same compile-only H100s by the same XLA (this environment's jaxlib), and both
optimized programs read by meshlm's time model (planning/timing.py). Every time below is that
model's prediction, never a measurement; memory is each compiler's own plan.

  python -m benchmarks.peers                                  # every preset of PRESETS
  python -m benchmarks.peers --presets=8b --out=benchmarks/results/peers-h100-deviceless.json
  python -m benchmarks.peers --presets=8b,70b --meshlm=model.grad_reduce_dtype=bfloat16
  python -m benchmarks.peers --search --presets=1b,8b --out=benchmarks/results/peers_best-h100-deviceless.json

Two comparisons. By default each preset as it ships (its tuned remat policy, layers, head chunk)
beside MaxText at its defaults and the nearest remat policy (REMAT). With --search, best against
best: each system compiles every combination of the settings its users turn for speed against
memory (MESHLM_SPACE: layers scanned or unrolled × every remat policy of the layout search;
MAXTEXT_SPACE: scan_layers × its remat policies, `custom` among them, and vocabulary tiling where
it could make a candidate fit), on the preset's mesh, batch and microbatches; each candidate is
listed with its memory and step, the curve of step against memory is marked, and each system's
fastest that fits (--memory_gb, default what JAX's allocator takes of an H100) is compared.

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
from configs import base, llama, moe
from planning import gpu_compiler, gpus, timing
from runtime import cli
from sharding import collectives
from training import layout, settings
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
    # configs/base.py's tiny model on one GPU: the search and its judgement, in seconds (tests)
    'tiny': lambda: Preset(base.get_config(), 1, (
        'model_name=llama3-8b', 'override_model_config=true', 'base_emb_dim=64',
        'base_num_query_heads=4', 'base_num_kv_heads=2', 'base_num_decoder_layers=2',
        'base_mlp_dim=192', 'head_dim=16', 'vocab_size=384')),
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
         'none': 'minimal_with_context',
         'dots_attention_except_out': 'minimal', 'full': 'full'}

# What each system's users turn for speed against memory, every combination compiled by
# --search; the preset's mesh, batch, microbatches and precision stay (the same work).
MESHLM_SPACE = [{'model.scan_layers': scan, 'model.remat_policy': policy}
                for scan in (False, True) for policy in layout.POLICIES]
# MaxText's remat policies (configs/base.yml's list, less the offloading ones), and its `custom`
# keeping what meshlm's `_except_out` policies keep: every projection's output but attention's
# output projection's, and with `context` attention's output too
_EXCEPT_OUT = {'remat_policy': 'custom', **dict.fromkeys(
    ('query_proj', 'key_proj', 'value_proj', 'mlpwi_0', 'mlpwi_1', 'mlpwo'), 'device')}
MAXTEXT_SPACE = [{'scan_layers': scan, **remat} for scan in ('false', 'true') for remat in (
    *({'remat_policy': policy} for policy in (
        'full', 'save_qkv_proj', 'save_dot_except_mlp', 'save_dot_except_mlpwi',
        'save_dot_with_context_except_mlp', 'minimal', 'minimal_with_context')),
    _EXCEPT_OUT, {**_EXCEPT_OUT, 'context': 'device'})]
# MaxText's vocabulary tiling computes the loss in this many tiles, for less memory: tried on each
# candidate that does not fit without it and is predicted faster than the fastest that does.
VOCAB_TILES = 4

_PRESETS = flags.DEFINE_string('presets', ','.join(p for p in PRESETS if p != 'tiny'),
                               'Comma-separated, of PRESETS.')
_SEARCH = flags.DEFINE_bool('search', False, "Best against best: each system's fastest "
                            'configuration that fits (MESHLM_SPACE, MAXTEXT_SPACE), and the curve '
                            'of step against memory; else each preset as it ships beside MaxText at '
                            'the nearest remat policy, its other settings its defaults.')
_MEMORY_GB = flags.DEFINE_float('memory_gb', None, "--search: what fits, in GiB a GPU; default "
                                "what JAX's allocator takes of an H100")
_WITH_MAXTEXT = flags.DEFINE_bool('maxtext', True, "--nomaxtext: meshlm's side alone")
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


def maxtext_settings(preset: Preset, out: pathlib.Path, overrides: dict | None = None,
                     deviceless: bool = True) -> list[str]:
  """MaxText's command line for `preset`: the same work, then `overrides` (a search's settings);
  for compile-only GPUs unless not `deviceless` (then for the devices it runs on)."""
  c = preset.config
  settings = dict(s.split('=', 1) for s in preset.maxtext)
  settings.update({
      'hardware': 'gpu', 'attention': 'cudnn_flash_jax', 'dtype': 'bfloat16',
      'weight_dtype': 'float32', 'remat_policy': REMAT[c.model.remat_policy],
      'per_device_batch_size': str(c.batch_size / c.microbatches / preset.gpus),
      'gradient_accumulation_steps': str(c.microbatches), 'max_target_length': str(c.seq_len),
      'ici_fsdp_parallelism': str(preset.gpus // preset.expert),
      'ici_expert_parallelism': str(preset.expert), 'dataset_type': 'synthetic',
      'enable_checkpointing': 'false', 'run_name': 'peers', 'base_output_directory': str(out),
      **({'internal_compile': 'true', 'internal_compile_num_devices': str(preset.gpus)}
         if deviceless else {}),
      **(overrides or {})})
  return [f'{k}={v}' for k, v in settings.items()]


def maxtext_program(preset: Preset, overrides: dict | None = None,
                    xla_flags: str = '') -> tuple[dict, str]:
  """(MaxText's compiled memory and shapes, its optimized program) for `preset`."""
  with tempfile.TemporaryDirectory(prefix='meshlm-peers-') as tmp:
    child = pathlib.Path(__file__).with_name('peers_maxtext.py')
    done = subprocess.run(
        [str(maxtext_python()), str(child), tmp, str(preset.gpus),
         *maxtext_settings(preset, pathlib.Path(tmp), overrides)],
        env={**gpu_compiler.environment(),
             **({'XLA_FLAGS': xla_flags} if xla_flags else {})},
        capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f'MaxText did not compile: {done.stderr.strip().splitlines()[-1]}')
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    with gzip.open(pathlib.Path(tmp) / 'hlo.txt.gz', 'rt') as f:
      return figures, f.read()


def meshlm_config(preset: Preset, overrides: dict | None = None, given: tuple[str, ...] = (),
                  attention: str = 'cudnn'):
  """meshlm's config for `preset`: the preset, then `given` (--meshlm's section.field=value),
  then `overrides` (a search's, {'section.field': value}), its attention `attention`."""
  config = preset.config.copy_and_resolve_references()
  config.model.attention = attention
  for field, value in [*(s.partition('=')[::2] for s in given), *(overrides or {}).items()]:
    section, _, key = field.rpartition('.')
    holder = config[section] if section else config
    if key not in holder:
      raise SystemExit(f'--meshlm={field}={value}: {field} is not a setting of configs/base.py')
    if isinstance(value, str):
      value = type(holder[key])(value) if not isinstance(holder[key], bool) else (
          value.lower() in ('1', 'true'))
    holder[key] = value
  if preset.expert > 1:
    config.mesh.fsdp, config.mesh.expert = preset.gpus // preset.expert, preset.expert
  return config


def meshlm_program(preset: Preset, overrides: dict | None = None,
                   given: tuple[str, ...] = ()) -> tuple[dict, str]:
  """(meshlm's compiled memory and shapes, its optimized program), compiled as a dry run does
  (meshlm_config's)."""
  config = meshlm_config(preset, overrides, given)
  config.plan.target, config.plan.devices, config.dry_run = 'H100', preset.gpus, True
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
                          for op, s in sent.items()},
          'fusions_by_op': fusions_by_op(step)}


def fusions_by_op(step: timing.StepTime, top: int = 12) -> dict[str, dict]:
  """Where the time outside GEMMs and attention goes: the fusions and other kernels grouped by
  the JAX operation they come from (the op_name's last two parts), costliest first, each with its
  seconds and launches a step."""
  ops = {}
  for k in step.kernels:
    if k.part in ('fusion', 'other'):
      o = ops.setdefault(k.op, {'s': 0.0, 'launches': 0})
      o['s'] += k.seconds * k.runs
      o['launches'] += k.runs
  return dict(sorted(ops.items(), key=lambda kv: -kv[1]['s'])[:top])


def sent(row: dict, op: str) -> str:
  s = row['collectives'].get(op)
  if not s:
    return '—'
  most = max(s['by_dtype'], key=s['by_dtype'].get)  # the dtype that carries the most bytes
  return f'{s["bytes"] / 2**30:.1f} ({most})'


@dataclasses.dataclass(frozen=True)
class Given:
  """What the command line adds to every compile of a system."""
  meshlm: tuple[str, ...] = ()  # --meshlm
  maxtext_xla_flags: str = ''  # --maxtext_xla_flags
  programs: str | None = None  # --programs: keep each program there


def search(name: str, preset: Preset, system: str, space: list[dict], memory_bytes: int,
           flops: float | None = None, given: Given = Given(), log=print) -> list[dict]:
  """Every candidate of `space` compiled by `system` ('meshlm' or 'MaxText') and read by the time
  model, as rows of `figures` with their settings (or the error that stopped them) and whether
  they fit `memory_bytes`; MaxText's again with vocabulary tiling where that could make it win.
  MFU counts the model's FLOPs (`flops`, a step's a GPU; meshlm's rows count their own)."""
  rows = [candidate(name, preset, system, settings, flops, given, log) for settings in space]
  if system == 'MaxText':
    fastest = min((r['step_s'] for r in rows if fits(r, memory_bytes)), default=float('inf'))
    rows += [candidate(name, preset, system,
                       {**r['settings'], 'num_vocab_tiling': str(VOCAB_TILES)}, flops, given,
                       log)
             for r in list(rows) if 'error' not in r and not fits(r, memory_bytes)
             and r['step_s'] < fastest]
  return judge(rows, memory_bytes)


def judge(rows: list[dict], memory_bytes: int) -> list[dict]:
  """`rows`, each marked with whether it fits `memory_bytes` (a row that did not compile does
  not)."""
  for r in rows:
    r['fits'] = fits(r, memory_bytes)
  return rows


def candidate(name: str, preset: Preset, system: str, settings: dict, flops: float | None,
              given: Given = Given(), log=print) -> dict:
  """One configuration's row; a configuration its system refuses or fails to compile is a row
  with its error, so that one bad combination does not end the search."""
  try:
    memory, hlo = (meshlm_program(preset, settings, given.meshlm) if system == 'meshlm' else
                   maxtext_program(preset, settings, given.maxtext_xla_flags))
  except (RuntimeError, ValueError) as e:
    log(f'  {system} {label(settings)}: {e}')
    return {'settings': settings, 'label': label(settings), 'error': str(e)}
  c = preset.config
  if any(memory[k] != c[k] for k in ('batch_size', 'microbatches', 'seq_len')):
    raise SystemExit(f'{name}: {system} was given other shapes than the preset ({memory})')
  flops = memory.pop('flops', flops)
  row = {'settings': settings, 'label': label(settings), 'flops': flops,
         **figures(memory, hlo, preset, flops)}
  if given.programs:
    keep(hlo, given.programs, f'{name}-{system.lower()}-{label(settings, sep="-")}')
  log(f'  {system:<8}{row["label"]:<52}{row["total_bytes"] / 2**30:>7.2f} GiB'
      f'{row["step_s"]:>8.3f} s')
  return row


def fits(row: dict, memory_bytes: int) -> bool:
  return 'error' not in row and row['total_bytes'] <= memory_bytes


def best(rows: list[dict]) -> dict | None:
  """The fastest of the rows that fit; None where none does."""
  return min((r for r in rows if r['fits']), key=lambda r: r['step_s'], default=None)


def front(rows: list[dict]) -> list[dict]:
  """The curve of step against memory: each compiled row faster than every row that needs less
  memory, least memory first (what a reader with a given memory can have at best)."""
  curve = []
  for r in sorted((r for r in rows if 'error' not in r),
                  key=lambda r: (r['total_bytes'], r['step_s'])):
    if not curve or r['step_s'] < curve[-1]['step_s']:
      curve.append(r)
  return curve


_SHORT = {'query_proj': 'qkv', 'key_proj': 'qkv', 'value_proj': 'qkv', 'mlpwi_0': 'mlp',
          'mlpwi_1': 'mlp', 'mlpwo': 'mlp'}


def label(settings: dict, sep: str = ', ') -> str:
  """A candidate's settings as a row names them: the values, MaxText's custom by what it keeps."""
  parts = []
  for key, value in settings.items():
    key = key.rpartition('.')[2]
    if value == 'device':
      continue  # named in 'custom(…)'
    if key == 'remat_policy' and value == 'custom':
      kept = [_SHORT.get(k, k) for k, v in settings.items() if v == 'device']
      value = 'custom(' + '+'.join(dict.fromkeys(kept)) + ')'
    parts.append(('scanned' if value in (True, 'true') else 'unrolled') if key == 'scan_layers'
                 else f'vocab tiles {value}' if key == 'num_vocab_tiling' else str(value))
  return sep.join(parts)


def keep(hlo: str, where: str, name: str) -> None:
  kept = pathlib.Path(where)
  kept.mkdir(parents=True, exist_ok=True)
  with gzip.open(kept / f'{name}.hlo.txt.gz', 'wt') as f:
    f.write(hlo)


def best_against_best(names: list[str], given: Given, done=lambda results: None
                      ) -> tuple[list[dict], int]:
  """Each system's search on each preset: every candidate, the curve, the fastest that fits;
  `done(results so far)` after each preset."""
  memory_bytes = (int(_MEMORY_GB.value * 2**30) if _MEMORY_GB.value
                  else gpus.usable_memory_bytes(gpus.get('H100')))
  print(f'fits: at most {memory_bytes / 2**30:.2f} GiB a GPU')
  results = []
  for name in names:
    preset = PRESETS[name]()
    print(f'{name}: {preset.gpus} GPU(s), {preset.config.batch_size} × {preset.config.seq_len} '
          f'tokens, {preset.config.microbatches} microbatch(es)', flush=True)
    rows = {'meshlm': search(name, preset, 'meshlm', MESHLM_SPACE, memory_bytes, given=given)}
    if _WITH_MAXTEXT.value:
      flops = next(r['flops'] for r in rows['meshlm'] if 'error' not in r)
      rows['MaxText'] = search(name, preset, 'MaxText', MAXTEXT_SPACE, memory_bytes, flops,
                               given)
    print(f'{"":<2}{"system":<9}{"settings":<52}{"GiB":>7}{"step":>8}{"MFU":>7}{"GEMM":>7}'
          f'{"attn":>7}{"fusion":>7}{"rest":>7}{"comm":>7}')
    result = {'preset': name, 'gpus': preset.gpus, 'batch_size': preset.config.batch_size,
              'seq_len': preset.config.seq_len, 'microbatches': preset.config.microbatches}
    for system, found in rows.items():
      curve, fastest = front(found), best(found)
      for r in sorted(found, key=lambda r: r.get('total_bytes', float('inf'))):
        mark = ('*' if r is fastest else '·' if any(r is c for c in curve) else ' ')
        if 'error' in r:
          print(f'{mark:<2}{system:<9}{r["label"]:<52}  {r["error"][:60]}')
          continue
        print(f'{mark:<2}{system:<9}{r["label"]:<52}{r["total_bytes"] / 2**30:>7.2f}'
              f'{r["step_s"]:>8.3f}{r["mfu"]:>7.1%}{r["gemm_s"]:>7.3f}{r["attention_s"]:>7.3f}'
              f'{r["fusion_s"]:>7.3f}{r["rest_s"]:>7.3f}{r["exposed_communication_s"]:>7.3f}'
              + ('' if r['fits'] else '  does not fit')
              + ('  (loops whose trips depend on the data, each charged once: undercounted)'
                 if r['loops_of_unknown_trips'] else ''))
      result[system] = {'candidates': found, 'best': found.index(fastest) if fastest else None,
                        'front': [found.index(c) for c in curve]}
    print('  * the fastest that fits; · on the curve of step against memory (faster than every '
          'candidate needing less)')
    if _WITH_MAXTEXT.value:
      ours, theirs = best(rows['meshlm']), best(rows['MaxText'])
      if ours and theirs:
        result['step_ratio'] = ours['step_s'] / theirs['step_s']
        result['memory_ratio'] = ours['total_bytes'] / theirs['total_bytes']
        print(f'  best against best within {memory_bytes / 2**30:.2f} GiB: meshlm '
              f'{ours["label"]} {ours["step_s"]:.3f} s at {ours["total_bytes"] / 2**30:.2f}'
              f' GiB, MaxText {theirs["label"]} {theirs["step_s"]:.3f} s at '
              f'{theirs["total_bytes"] / 2**30:.2f} GiB: meshlm ÷ MaxText {result["step_ratio"]:.3f}',
              flush=True)
        for system, r in (('meshlm', ours), ('MaxText', theirs)):
          print(f'  {system}\'s best outside GEMMs and attention, by JAX operation (s, launches): '
                + '; '.join(f'{op} {o["s"]:.3f} ({o["launches"]})'
                            for op, o in list(r['fusions_by_op'].items())[:8]))
    results.append(result)
    done(results)
  return results, memory_bytes


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.peers', *sys.argv[1:]])
  names = _PRESETS.value.split(',')
  unknown = [n for n in names if n not in PRESETS]
  if unknown:
    raise SystemExit(f'--presets: {unknown} are not of {list(PRESETS)}')
  print(f'H100 (deviceless), jaxlib {jax.__version__}, MaxText {MAXTEXT}; per GPU a step, '
        'predicted by the time model; GiB and seconds')
  figures_of = {'benchmark': 'peers', 'compiled_for': 'H100', 'deviceless': True,
                'source': 'model', 'jax': jax.__version__, 'maxtext': MAXTEXT,
                'flax': importlib.metadata.version('flax'), 'meshlm_settings': _MESHLM.value,
                'maxtext_xla_flags': _MAXTEXT_XLA_FLAGS.value}
  given = Given(tuple(_MESHLM.value), _MAXTEXT_XLA_FLAGS.value, _PROGRAMS.value)
  # A long search keeps each finished preset in OUT.partial (the results file itself is written
  # whole, at the end, so a stopped run leaves the last one as it was)
  partial = pathlib.Path(f'{_OUT.value}.partial') if _OUT.value else None
  if _SEARCH.value:
    def done(results):
      if partial:
        partial.write_text(json.dumps({**figures_of, 'presets': results}, indent=2) + '\n')
    results, memory_bytes = best_against_best(names, given, done)
    figures_of.update(search=True, memory_bytes=memory_bytes)
  else:
    results = as_shipped(names, given)
  report.emit({**figures_of, 'presets': results, 'command': report.command()}, _OUT.value)
  if partial:
    partial.unlink(missing_ok=True)


def as_shipped(names: list[str], given: Given) -> list[dict]:
  """Each preset as it ships beside MaxText at the nearest remat policy (REMAT)."""
  head = (f'{"preset":<18}{"system":<9}{"GiB":>7}{"step":>8}{"tok/s":>8}{"MFU":>7}{"GEMM":>7}'
          f'{"attn":>7}{"fusion":>7}{"rest":>7}{"comm":>7}  {"reduce-scatter":<16}all-gather')
  print(head)
  results = []
  for name in names:
    preset = PRESETS[name]()
    ours, our_hlo = meshlm_program(preset, given=given.meshlm)
    flops = ours.pop('flops')
    try:
      theirs, their_hlo = maxtext_program(preset, xla_flags=given.maxtext_xla_flags)
    except RuntimeError as e:
      print(f'{name:<18}{"MaxText":<9}{e}')
      results.append({'preset': name, 'gpus': preset.gpus, 'maxtext_error': str(e),
                      'meshlm': figures(ours, our_hlo, preset, flops)})
      continue
    if any(theirs[k] != ours[k] for k in ('batch_size', 'microbatches', 'seq_len')):
      raise SystemExit(f'{name}: MaxText was given other shapes than meshlm ({theirs} vs {ours})')
    rows = {'meshlm': figures(ours, our_hlo, preset, flops),
            'MaxText': figures(theirs, their_hlo, preset, flops)}
    if given.programs:
      for system, hlo in (('meshlm', our_hlo), ('maxtext', their_hlo)):
        keep(hlo, given.programs, f'{name}-{system}')
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
  return results


if __name__ == '__main__':
  cli.run(main)
