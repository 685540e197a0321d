"""meshlm and MaxText timed on the GPU this runs on, on the same work, in one command: each
system's step measured (the median of --timed_steps steps, each waited for, after --warmup_steps), its
tokens/s and MFU by one formula (planning/flops.py's FLOPs of the model, the same for both), its
memory (the compiler's plan and the device's peak), and its program banked beside the
measurement and re-predicted by the time model, so `python -m benchmarks.calibrate --check`
holds the model to a peer's program too.

  scripts/calibrate_on_device.sh wheels         # here: what the GPU image lacks, MaxText's too
  scripts/calibrate_on_device.sh side_by_side   # on a lent GPU: this, banked into $OUT/bank.tgz
  python -m benchmarks.side_by_side             # on any GPU whose Python imports MaxText
  python -m benchmarks.side_by_side --dry       # anywhere: the rehearsal, on the tiny preset

The work is benchmarks/peers.py's (its preset's batch, sequence, microbatches, bf16 compute on
fp32 weights, cuDNN's fused attention through JAX in both), and the candidates each system's user
would run: meshlm's preset as it ships and meshlm's fastest in peers' committed search
(benchmarks/results/peers_best-h100-deviceless.json); MaxText at the nearest remat policy scanned
(its default) and unrolled, and its fastest in that search. The fastest of each that ran is
compared, and meshlm's fastest at no more memory than MaxText's fastest.

Each candidate runs in a process of its own (a clean peak memory; one that runs out of memory
loses only its row): meshlm's in this Python, MaxText's in --maxtext_python with --maxtext_path
first on its path (benchmarks/side_by_side_maxtext.py). The rows are banked after each, in the
order that matters most, and the candidates that would pass --deadline_s are listed as skipped:
--bank_dir/calibrate_steps_side_by_side-<gpu>.json, and its .programs.json.gz.

--dry runs every step but the GPU's: the tiny preset on this machine's CPU (meshlm's XLA attention,
MaxText's dot_product), both children as on a GPU where MaxText imports (else its rows say why
not), the wheels the device would carry and their size against its 64 MiB, and the commands.
"""

import gzip
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from absl import flags

from benchmarks import bank, inputs, peers, profiled, report
from planning import flops, gpus, timing
from runtime import cli
from training import settings

_PRESET = flags.DEFINE_string('preset', '1b', "The work, of benchmarks/peers.py's PRESETS.")
_DRY = flags.DEFINE_bool('dry', False, 'The rehearsal: the tiny preset on this machine (CPU).')
_STEPS = flags.DEFINE_integer('timed_steps', 10, 'Timed steps, each waited for.')
_WARMUP = flags.DEFINE_integer('warmup_steps', 2, 'Untimed steps after compiling.')
_PROFILE_CALLS = flags.DEFINE_integer('profiled_steps', 3, 'Steps profiled after timing.')
_OUT_DIR = flags.DEFINE_string('bank_dir', None, 'Where the rows are banked; default '
                               'benchmarks/results (with --dry a folder of the temporary dir).')
_DEADLINE_S = flags.DEFINE_integer('deadline_s', 540, 'Candidates that could not finish by then '
                                   'are skipped (each is given what is left, at most 240 s).')
_MAXTEXT_PYTHON = flags.DEFINE_string('maxtext_python', sys.executable,
                                      "The Python that runs MaxText's step.")
_MAXTEXT_PATH = flags.DEFINE_string('maxtext_path', '', "Put first on MaxText's PYTHONPATH (the "
                                    'unpacked maxtext-site of the wheels).')
_CHILD = flags.DEFINE_string('child', None, "Internal: time meshlm's candidate (JSON settings) "
                             'into --bank_dir.')
_WHEELS = flags.DEFINE_string('wheels', '.whl', 'The wheels a lent GPU is given (--dry sizes them).')

CARRY_LIMIT = 64 * 2**20  # what travels to a lent GPU: the working tree and what it carries
CANDIDATE_S = 240  # one candidate's compile, steps and profile, at most


def effective(system: str, overrides: dict) -> dict:
  """A candidate's layers and remat policy: the preset's (MaxText's nearest, scanned as is its
  default), then `overrides`."""
  model = peers.PRESETS[_PRESET.value]().config.model
  if system == 'meshlm':
    return {'model.scan_layers': model.scan_layers, 'model.remat_policy': model.remat_policy,
            **overrides}
  return {'scan_layers': 'true', 'remat_policy': peers.REMAT[model.remat_policy], **overrides}


def candidates(name: str, results: str = 'benchmarks/results/peers_best-h100-deviceless.json'
               ) -> list[tuple[str, dict]]:
  """(system, overrides) to run, the most telling first: both systems as a user starts them, then
  MaxText unrolled, then each system's fastest of peers' committed search where it is another."""
  chosen = [('meshlm', {}), ('MaxText', {}), ('MaxText', {'scan_layers': 'false'})]
  try:
    searched = {p['preset']: p for p in json.loads(pathlib.Path(results).read_text())['presets']}
  except FileNotFoundError:
    searched = {}
  for system in ('MaxText', 'meshlm'):
    found = searched.get(name, {}).get(system)
    if found and found['best'] is not None:
      best = found['candidates'][found['best']]['settings']
      if all(effective(system, best) != effective(s, o) for s, o in chosen if s == system):
        chosen.append((system, best))
  return chosen


def what(system: str, overrides: dict) -> str:
  """A candidate's row name: the preset, the system, its layers and remat policy."""
  return (f'{_PRESET.value} {system} {peers.label(effective(system, overrides))}'
          + ('' if overrides else ' (as it ships)' if system == 'meshlm' else ' (its default)'))


def child_env(dry: bool, path: str = '') -> dict:
  env = dict(os.environ)
  if dry:  # one CPU device, as the tiny preset's one GPU (the tests' 8 simulated ones are not)
    env['XLA_FLAGS'] = re.sub(r'--xla_force_host_platform_device_count=\d+', '',
                              env.get('XLA_FLAGS', '')).strip()
  if path:
    env['PYTHONPATH'] = os.pathsep.join(p for p in (path, env.get('PYTHONPATH')) if p)
  return env


def command(system: str, overrides: dict, folder: str, preset: peers.Preset, dry: bool
            ) -> list[str]:
  if system == 'meshlm':
    return [sys.executable, '-m', 'benchmarks.side_by_side', f'--preset={_PRESET.value}',
            f'--child={json.dumps(overrides)}', f'--bank_dir={folder}', f'--timed_steps={_STEPS.value}',
            f'--warmup_steps={_WARMUP.value}', f'--profiled_steps={_PROFILE_CALLS.value}',
            *(['--dry'] if dry else [])]
  on_cpu = {'hardware': 'cpu', 'skip_jax_distributed_system': 'true',
            'attention': 'dot_product'} if dry else {}
  settings = peers.maxtext_settings(preset, pathlib.Path(folder), {**on_cpu, **overrides},
                                    deviceless=False)
  return [_MAXTEXT_PYTHON.value, str(pathlib.Path(__file__).with_name('side_by_side_maxtext.py')),
          folder, str(_STEPS.value), str(_WARMUP.value), str(_PROFILE_CALLS.value), *settings]


def meshlm_child(overrides: dict, folder: pathlib.Path) -> None:
  """Times meshlm's candidate here; the files and JSON line side_by_side_maxtext.py writes."""
  preset = peers.PRESETS[_PRESET.value]()
  config = peers.meshlm_config(preset, overrides, attention='xla' if _DRY.value else 'cudnn')
  prepared = inputs.prepare(config)
  step, state, batch = prepared.train_step, prepared.state, prepared.batch
  times = []
  for i in range(_WARMUP.value + _STEPS.value):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    if i >= _WARMUP.value:
      times.append(time.perf_counter() - start)

  def call():
    nonlocal state
    state, m = step(state, batch)
    return m
  (folder / 'profile.json').write_text(json.dumps(profiled.kernels(call, _PROFILE_CALLS.value)))
  with gzip.open(folder / 'hlo.txt.gz', 'wt') as f:
    f.write(step.as_text())
  m = step.memory_analysis()
  stats = jax.devices()[0].memory_stats() or {}
  run = prepared.run
  print(json.dumps({'times_s': times, 'compile_s': prepared.compile_s, 'jax': jax.__version__,
                    'argument_bytes': m.argument_size_in_bytes,
                    'output_bytes': m.output_size_in_bytes, 'temp_bytes': m.temp_size_in_bytes,
                    'alias_bytes': m.alias_size_in_bytes,
                    'peak_bytes': stats.get('peak_bytes_in_use'), 'loss': float(metrics['loss']),
                    'mesh': {k: v for k, v in prepared.setup.mesh.shape.items() if v > 1},
                    'batch_size': run.batch_size, 'microbatches': run.microbatches,
                    'seq_len': run.seq_len}))


def run_candidate(system: str, overrides: dict, preset: peers.Preset, gpu: gpus.GPU,
                  model_flops: float, limit_s: float, dry: bool, log=print) -> tuple[dict, dict]:
  """(its row, its banked program) of one candidate, run in its own process within `limit_s`; a
  row with the error where it did not run."""
  row = {'what': what(system, overrides), 'system': system, 'settings': overrides}
  with tempfile.TemporaryDirectory(prefix='meshlm-side-by-side-') as folder:
    argv = command(system, overrides, folder, preset, dry)
    row['argv'] = [pathlib.Path(a).name if a == argv[0] else a for a in argv]
    try:
      done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s,
                            env=child_env(dry, _MAXTEXT_PATH.value if system == 'MaxText' else ''))
    except subprocess.TimeoutExpired:
      return {**row, 'error': f'did not finish within {limit_s:.0f} s'}, {}
    last = done.stdout.strip().splitlines()[-1:] or ['']
    if done.returncode or not last[0].startswith('{'):
      why = (done.stderr.strip().splitlines() or ['(no output)'])[-1]
      return {**row, 'error': f'exit {done.returncode}: {why[:300]}'}, {}
    measured = json.loads(last[0])
    hlo = gzip.open(pathlib.Path(folder) / 'hlo.txt.gz', 'rt').read()
    profile = json.loads((pathlib.Path(folder) / 'profile.json').read_text())
  c = preset.config
  if any(measured[k] != c[k] for k in ('batch_size', 'microbatches', 'seq_len')):
    return {**row, 'error': f'ran other shapes than the preset: {measured}'}, {}
  step_s = statistics.median(measured['times_s'])
  predicted = timing.predict(hlo, gpu)
  total = (measured['argument_bytes'] + measured['output_bytes'] + measured['temp_bytes']
           - measured['alias_bytes'])
  tokens = c.batch_size * c.seq_len / preset.gpus
  row.update(
      measured_s=step_s, times_s=measured['times_s'], predicted_s=predicted.seconds,
      ratio=step_s / predicted.seconds, tokens_per_s_per_device=tokens / step_s,
      mfu=model_flops * tokens / step_s / gpu.peak_bf16_flops,
      predicted_mfu=model_flops * tokens / predicted.seconds / gpu.peak_bf16_flops,
      predicted_breakdown=predicted.breakdown, compile_s=measured['compile_s'],
      devices=preset.gpus, jax=measured['jax'], loss=measured['loss'],
      memory={'argument': measured['argument_bytes'], 'output': measured['output_bytes'],
              'temp': measured['temp_bytes'], 'alias': measured['alias_bytes'], 'total': total},
      peak_bytes=measured['peak_bytes'])
  log(f'{row["what"]:<58}{step_s * 1e3:>10.1f}{predicted.seconds * 1e3:>10.1f}'
      f'{row["tokens_per_s_per_device"]:>10,.0f}{row["mfu"]:>7.1%}{total / 2**30:>8.2f}'
      + (f'{measured["peak_bytes"] / 2**30:>8.2f}' if measured['peak_bytes'] else f'{"—":>8}'),
      flush=True)
  return row, {'hlo': hlo, 'profile': profile}


def compared(rows: list[dict]) -> dict:
  """Each system's fastest that ran, and meshlm's fastest at no more memory than MaxText's."""
  ran = [r for r in rows if 'measured_s' in r]
  fastest = {s: min((r for r in ran if r['system'] == s), key=lambda r: r['measured_s'],
                    default=None) for s in ('meshlm', 'MaxText')}
  out = {f'{s}_fastest': r and r['what'] for s, r in fastest.items()}
  theirs = fastest['MaxText']
  if fastest['meshlm'] and theirs:
    out['tokens_per_s_ratio'] = (fastest['meshlm']['tokens_per_s_per_device']
                                 / theirs['tokens_per_s_per_device'])
    within = [r for r in ran if r['system'] == 'meshlm'
              and r['memory']['total'] <= theirs['memory']['total']]
    ours = min(within, key=lambda r: r['measured_s'], default=None)
    out['at_no_more_memory'] = ours and {
        'meshlm': ours['what'], 'tokens_per_s_ratio':
        ours['tokens_per_s_per_device'] / theirs['tokens_per_s_per_device']}
  return out


def wheels(folder: str) -> dict:
  """What a lent GPU would be given: the wheels and the unpacked MaxText, their size and the
  working tree's against what travels."""
  tree = subprocess.run(['git', 'ls-files', '-z'], capture_output=True, text=True).stdout
  tree_bytes = sum(os.path.getsize(p) for p in tree.split('\0') if p and os.path.isfile(p))
  files = sorted(pathlib.Path(folder).glob('*')) if os.path.isdir(folder) else []
  carried = sum(f.stat().st_size for f in files)
  return {'folder': folder, 'files': {f.name: f.stat().st_size for f in files},
          'maxtext_site': any(f.name == 'maxtext-site.tar.xz' for f in files),
          'tree_bytes': tree_bytes, 'carried_bytes': carried,
          'fits': tree_bytes + carried <= CARRY_LIMIT}


def main(argv):
  del argv
  if _CHILD.value is not None:
    return meshlm_child(json.loads(_CHILD.value), pathlib.Path(_OUT_DIR.value))
  started = time.perf_counter()
  dry = _DRY.value
  name = 'tiny' if dry else _PRESET.value
  if name not in peers.PRESETS:
    raise SystemExit(f'--preset={name}: not one of {list(peers.PRESETS)}')
  flags.FLAGS.preset = name  # the children run the same
  device = jax.devices()[0]
  if not dry and device.platform != 'gpu':
    raise SystemExit(f'benchmarks/side_by_side.py: this machine has no GPU ({device.platform}); '
                     '--dry rehearses it here')
  gpu = gpus.find(device.device_kind)
  part_name = gpu.name.lower() if gpu else device.platform
  gpu = gpu or gpus.NOMINAL
  out_dir = _OUT_DIR.value or (f'{tempfile.gettempdir()}/meshlm-side-by-side-dry' if dry
                               else 'benchmarks/results')
  preset = peers.PRESETS[name]()
  if preset.gpus != jax.device_count() and not dry:
    raise SystemExit(f'--preset={name} runs on {preset.gpus} GPU(s); this machine has '
                     f'{jax.device_count()}')
  model_flops = flops.flops_per_token(settings.resolve(
      peers.meshlm_config(preset, attention='xla'), log=lambda *_: None).model,
      preset.config.seq_len)
  print(f'{name}: {preset.gpus} × {device.device_kind}, {preset.config.batch_size} × '
        f'{preset.config.seq_len} tokens, {preset.config.microbatches} microbatch(es); measured '
        f'here, predicted by the time model for {gpu.name}; jax {jax.__version__}, MaxText '
        f'{peers.MAXTEXT}')
  print(f'{"candidate":<58}{"ms":>10}{"pred ms":>10}{"tok/s":>10}{"MFU":>7}{"GiB":>8}{"peak":>8}')
  rows, programs = [], {}
  figures = {'benchmark': 'calibrate_steps_side_by_side', 'device': device.device_kind,
             'platform': device.platform, 'jax': jax.__version__, 'model_for': gpu.name,
             'preset': name, 'maxtext': peers.MAXTEXT, 'dry': dry, 'rows': rows, 'refit': {},
             'command': report.command()}
  for system, overrides in candidates(name):
    left = _DEADLINE_S.value - (time.perf_counter() - started) - 10
    if left < (5 if dry else 60):
      rows.append({'what': what(system, overrides), 'system': system,
                   'settings': overrides, 'skipped': f'past --deadline_s={_DEADLINE_S.value}'})
      print(f'{rows[-1]["what"]:<58}skipped: past --deadline_s', flush=True)
      continue
    row, program = run_candidate(system, overrides, preset, gpu, model_flops,
                                 min(CANDIDATE_S, left), dry)
    if 'error' in row:
      print(f'{row["what"]:<58}did not run: {row["error"][:120]}', flush=True)
    rows.append(row)
    if program:
      programs[row['what']] = program
    figures.update(compared(rows), seconds=time.perf_counter() - started)
    bank.write_part(out_dir, 'steps_side_by_side', part_name, figures, programs)
  if dry:
    figures['wheels'] = wheels(_WHEELS.value)
    w = figures['wheels']
    print(f'\nwheels for a lent GPU ({w["folder"]}): {len(w["files"])} files, '
          f'{w["carried_bytes"] / 2**20:.1f} MiB, with the working tree '
          f'{(w["tree_bytes"] + w["carried_bytes"]) / 2**20:.1f} of {CARRY_LIMIT / 2**20:.0f} MiB'
          + ('' if w['maxtext_site'] else '; no maxtext-site.tar.xz: '
             'scripts/calibrate_on_device.sh wheels makes it'))
    print('commands:')
    for r in rows:
      print('  ' + ' '.join(r.get('argv', ['(skipped)'])))
  summary = compared(rows)
  if 'tokens_per_s_ratio' in summary:
    print(f'\nfastest: meshlm {summary["meshlm_fastest"]!r}, MaxText {summary["MaxText_fastest"]!r}:'
          f' meshlm ÷ MaxText tokens/s {summary["tokens_per_s_ratio"]:.3f}' + (
              f'; at no more memory {summary["at_no_more_memory"]["tokens_per_s_ratio"]:.3f}'
              if summary['at_no_more_memory'] else '; meshlm has none at no more memory'))
  figures.update(summary, seconds=time.perf_counter() - started)
  bank.write_part(out_dir, 'steps_side_by_side', part_name, figures, programs)
  report.emit({**figures, 'bank_dir': out_dir}, None)


if __name__ == '__main__':
  cli.run(main)
