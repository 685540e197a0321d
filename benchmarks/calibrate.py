"""The first command to run on a GPU: measures, on whatever GPU it runs on, what the time model's
efficiencies stand for (planning/gpus.py), each beside the model's prediction of the very
program that ran (planning/timing.py on its compiled HLO), as measured / predicted.

  python -m benchmarks.calibrate                        # every part: 6, ≤ 7 min each
  python -m benchmarks.calibrate --parts=gemm,copy      # some of them
  python -m benchmarks.calibrate --check                # re-predict the banked programs (no GPU)
  python -m benchmarks.calibrate --merge=DIR,…          # bank other runs' parts (no GPU)

Parts, in the order they run (what a GPU shows of a whole step first), each stopping once past
--part_budget_s (6 min; the shapes left are listed as skipped), so each fits a borrowed GPU's
10-minute command and all six fit 42 minutes:
  steps      the train steps of --step_configs (125m, 1b): bf16 with pallas and cudnn, then fp8;
             a part for each config (steps_125m, steps_1b)
  attention  forward, and forward+backward, of pallas (ours in Triton), hopper (ours in Mosaic
             GPU, kernels/flash_attention_hopper.py), cudnn and xla; head dims 64 and 128; keys
             2k, 4k and 8k; causal; GQA 32/8 heads; --tokens a call
  gemm       bf16 and fp8 matmuls: squares 2k–8k and the presets' projection shapes
  copy       an element-wise pass over 64 MiB – 2 GiB (HBM bandwidth), and a chain of --chain small
             dependent matmuls (the launch gap between kernels)
  host       copies between the device and pinned host memory inside one program, as
             optimizer.offload_state's step makes them: to the host, from it, and both at once
             (the PCIe link's bandwidth a direction, and whether the two directions overlap)
Time: a kernel program is called --iters times back to back and waited for once (the GPU never
idles between calls), the median of three such rounds; a train step, the median of --step_iters
steps each waited for, as benchmarks/train_step.py. Each part writes,
after every row (a machine taken away mid-part leaves the rows it finished):
  --out_dir/calibrate_<part>-<device>.json            device, jax version, command, its rows and
                                                      `refit`, the constants they imply
                                                      (docs/time-model.md: into planning/gpus.py)
  --out_dir/calibrate_<part>-<device>.programs.json.gz  each row's program as the GPU compiled it
                                                      (optimized HLO) and the kernels the device ran
                                                      in --profile_calls more calls (JAX's profiler)
A step row also keeps the memory its GPU's compile planned: `python -m benchmarks.memory_truth`
sets it beside this machine's deviceless compile of the same step.
The bank makes the time model testable without a GPU: --check re-predicts its programs. Off a GPU (the CPU test runs tiny shapes) the model is gpus.NOMINAL's and the
ratios mean nothing.
"""

import ast
import glob
import gzip
import importlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import bank, inputs, profiled, report
from kernels import matmul
import kernels
from planning import flops, gpus, timing
from runtime import cli
from training import programs

_PARTS = flags.DEFINE_list('parts', ['steps', 'attention', 'gemm', 'copy', 'host'], 'Parts to run.')
_GEMMS = flags.DEFINE_list('gemms', ['2048x2048x2048', '4096x4096x4096', '8192x8192x8192',
                                     '32768x2048x8192', '32768x8192x2048', '32768x4096x14336'],
                           'GEMMs m×k×n: squares, then 1b and 8b projections.')
_COPY_MIB = flags.DEFINE_list('copy_mib', ['64', '512', '2048'], 'Arrays passed over, MiB.')
_HOST_MIB = flags.DEFINE_list('host_mib', ['256', '1024'], 'Arrays copied to and from host memory, '
                              'MiB.')
_CHAIN = flags.DEFINE_integer('chain', 200, 'Dependent small matmuls of the launch-gap program.')
_IMPLS = flags.DEFINE_list('impls', ['pallas', 'hopper', 'cudnn', 'xla'],
                           'Attention implementations (hopper: ours in Mosaic GPU, sm_90a only).')
_HEAD_DIMS = flags.DEFINE_list('head_dims', ['64', '128'], 'Attention head dims.')
_SEQ_LENS = flags.DEFINE_list('seq_lens', ['2048', '4096', '8192'], 'Attention lengths.')
_HEADS = flags.DEFINE_string('heads', '32/8', 'Query/kv heads.')
_TOKENS = flags.DEFINE_integer('tokens', 16384, 'Batch × length of an attention call.')
_STEP_CONFIGS = flags.DEFINE_list('step_configs', ['configs/llama.py:125m', 'configs/llama.py:1b'],
                                  'Configs whose train steps are timed (file:argument).')
_STEP_ATTENTION = flags.DEFINE_list('step_attention', ['pallas', 'cudnn'], 'Their attentions.')
_STEP_PRECISION = flags.DEFINE_list('step_precision', ['default', 'fp8'],
                                    'Their config.model.matmul_precision.')
_ITERS = flags.DEFINE_integer('iters', 20, 'Calls of a kernel program a round.')
_STEP_VARIANTS = flags.DEFINE_list(
    'step_variants', ['preset'], 'Each a step variant of the configs: `preset`, or `packed` (segment '
    'ids in the batch) and config overrides joined by + (packed+model.cudnn_segments=0, '
    'model.scan_layers=False+model.head_chunk=0).')
_STEP_ITERS = flags.DEFINE_integer('step_iters', 6, 'Timed train steps.')
_PROFILE_CALLS = flags.DEFINE_integer('profile_calls', 3, 'Calls of each program profiled.')
_BUDGET = flags.DEFINE_float('part_budget_s', 360, 'A part adds no shape after this long.')
_CHECK = flags.DEFINE_bool('check', False, 'Re-predict every banked program in --out_dir with '
                           "today's time model, against what its GPU measured (benchmarks/bank.py); "
                           'nothing is measured.')
_MERGE = flags.DEFINE_list('merge', [], 'Folders of other calibrate runs (each a GPU command\'s '
                           'unpacked bank) whose parts are merged into --out_dir\'s: their rows '
                           'replace those of the same `what`; nothing is measured.')
_OUT_DIR = flags.DEFINE_string('out_dir', 'benchmarks/results', 'Where the JSON files go.')


def place(shape, dtype, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def measured_and_predicted(fn, args, gpu, options=None) -> dict:
  """{measured_s, predicted_s, ratio, kernels} for one call of jit(fn)(*args)."""
  compiled = jax.jit(fn).lower(*args).compile(options or {})
  predicted = timing.predict(compiled.as_text(), gpu)
  measured = inputs.back_to_back_s(compiled, args, _ITERS.value)
  return {'measured_s': measured, 'predicted_s': predicted.seconds,
          'ratio': measured / predicted.seconds, 'launches': predicted.launches,
          PROGRAM: program(compiled, lambda: compiled(*args))}


PROGRAM = '_program'  # a row's program and profile: main moves it from the row into the bank


def program(compiled, call) -> dict:
  return {'hlo': compiled.as_text(), 'profile': profiled.kernels(call, _PROFILE_CALLS.value)}


def gemm_rows(gpu):
  fp8_options = programs.FP8_COMPILER_OPTIONS if jax.devices()[0].platform == 'gpu' else {}
  for shape in _GEMMS.value:
    m, k, n = map(int, shape.split('x'))
    x, w = place((m, k), jnp.bfloat16), place((k, n), jnp.bfloat16, 1)
    for precision in ('bf16', 'fp8'):
      if precision == 'bf16':
        fn, options = (lambda a, b: a @ b), None
      else:
        fn, options = (lambda a, b: matmul.fp8_matmul('mk,kn->mn', a, b, jnp.bfloat16)), fp8_options
      row = measured_and_predicted(fn, (x, w), gpu, options)
      yield {'what': f'{precision} GEMM {m}×{k}×{n}', 'precision': precision, 'm': m, 'k': k,
             'n': n, 'flops': 2 * m * n * k, **row,
             'tflops': 2 * m * n * k / row['measured_s'] / 1e12}


def copy_rows(gpu):
  for mib in map(int, _COPY_MIB.value):
    x = place((mib * 2**20 // 4,), jnp.float32)
    row = measured_and_predicted(lambda a: a * 2, (x,), gpu)
    yield {'what': f'pass over {mib} MiB', 'bytes': 2 * mib * 2**20, **row,
           'tb_per_s': 2 * mib * 2**20 / row['measured_s'] / 1e12}

  def chain(x, w):
    for _ in range(_CHAIN.value):
      x = jnp.tanh(x @ w)
    return x
  row = measured_and_predicted(chain, (place((64, 64), jnp.bfloat16), place((64, 64), jnp.bfloat16, 1)),
                               gpu)
  yield {'what': f'chain of {_CHAIN.value} small matmuls', 'kernels': _CHAIN.value, **row,
         'per_kernel_s': row['measured_s'] / row['launches']}


def host_rows(gpu):
  device = jax.devices()[0]
  on = lambda kind: jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
  to_host = lambda a: jax.device_put(a, on('pinned_host'))
  from_host = lambda a: jax.device_put(a, on('device'))
  for mib in map(int, _HOST_MIB.value):
    x = place((mib * 2**20 // 4,), jnp.float32)
    on_host = jax.device_put(x, on('pinned_host'))
    for way, fn, args, moved in (('to host', to_host, (x,), 1), ('from host', from_host, (on_host,), 1),
                                 ('both ways', lambda a, b: (to_host(a), from_host(b)), (x, on_host), 2)):
      row = measured_and_predicted(fn, args, gpu)
      yield {'what': f'{way} {mib} MiB', 'way': way, 'bytes': moved * mib * 2**20, **row,
             'gb_per_s': moved * mib * 2**20 / row['measured_s'] / 1e9}


def attention_rows(gpu):
  N, K = map(int, _HEADS.value.split('/'))
  for H in map(int, _HEAD_DIMS.value):
    for S in map(int, _SEQ_LENS.value):
      B = max(1, _TOKENS.value // S)
      q, ct = place((B, S, N, H), jnp.bfloat16), place((B, S, N, H), jnp.bfloat16, 3)
      k, v = place((B, S, K, H), jnp.bfloat16, 1), place((B, S, K, H), jnp.bfloat16, 2)
      for impl in _IMPLS.value:
        if impl in ('cudnn', 'hopper') and jax.devices()[0].platform != 'gpu':
          continue  # the CPU tests interpret ours in Mosaic GPU at their own shapes
        if impl == 'hopper':
          call = lambda q, k, v: kernels.flash_attention(q, k, v, causal=True, hopper=True)
        else:
          call = lambda q, k, v, impl=impl: kernels.attention(q, k, v, causal=True,
                                                              implementation=impl)
        both = jax.grad(lambda q, k, v: (call(q, k, v).astype(jnp.float32) * ct).sum(), (0, 1, 2))
        what = f'{impl} attention H={H} S={S}'
        try:
          fwd = measured_and_predicted(call, (q, k, v), gpu)
          fwd_bwd = measured_and_predicted(both, (q, k, v), gpu)
        except Exception as e:  # xla's [L, S] scores may not fit: the rest of the table still counts
          yield {'what': what, 'error': f'{type(e).__name__}: {str(e)[:300]}'}
          continue
        forward_flops = 4 * B * N * S * S * H / 2
        if impl == 'cudnn':
          yield packed_row(gpu, q, k, v, ct, f'cudnn packed attention H={H} S={S}')
        yield {'what': what, 'impl': impl, 'head_dim': H, 'seq_len': S,
               'batch': B, 'heads': N, 'kv_heads': K, **fwd,
               'fwd_tflops': forward_flops / fwd['measured_s'] / 1e12,
               'fwd_bwd': fwd_bwd, 'bwd_measured_s': fwd_bwd['measured_s'] - fwd['measured_s'],
               'bwd_predicted_s': fwd_bwd['predicted_s'] - fwd['predicted_s'],
               'bwd_tflops': 2.5 * forward_flops / max(fwd_bwd['measured_s'] - fwd['measured_s'],
                                                       1e-9) / 1e12}


def packed_row(gpu, q, k, v, ct, what: str) -> dict:
  """cuDNN on packed rows (documents of S/6 tokens on average, the last row ending in padding):
  its packed layout (cudnn_segments=16) measured beside its dense mask (0), and the largest
  difference between their outputs and gradients."""
  B, S = q.shape[:2]
  rng, ids = np.random.default_rng(0), np.zeros((B, S), np.int32)
  for b in range(B):
    end, start, document = S - (S // 8 if b == B - 1 else 0), 0, 0
    while start < end:
      document += 1
      n = max(1, int(rng.exponential(S / 6)))
      ids[b, start:min(end, start + n)] = document
      start += n
  ids = jnp.asarray(ids)
  documents = int(ids.max())
  out = {'what': what, 'impl': 'cudnn packed', 'head_dim': q.shape[-1], 'seq_len': S,
         'batch': B, 'most_documents_in_a_row': documents}
  try:
    results = {}
    for label, segments in (('packed', 16), ('dense', 0)):
      call = lambda q, k, v, segments=segments: kernels.attention(
          q, k, v, causal=True, implementation='cudnn', segment_ids_BL=ids,
          cudnn_segments=segments)
      both = jax.grad(lambda q, k, v: (call(q, k, v).astype(jnp.float32) * ct).sum(), (0, 1, 2))
      results[label] = (jax.jit(call)(q, k, v), jax.jit(both)(q, k, v))
      out[label] = measured_and_predicted(call, (q, k, v), gpu)
      out[label]['fwd_bwd'] = measured_and_predicted(both, (q, k, v), gpu)
    leaves = [jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() for a, b in zip(
        jax.tree.leaves(results['packed']), jax.tree.leaves(results['dense']))]
    out['max_difference'] = [float(x) for x in leaves]  # output, dq, dk, dv
  except Exception as e:  # the rest of the table still counts
    out['error'] = f'{type(e).__name__}: {str(e)[:300]}'
  return out


def load_config(path: str):
  """`configs/llama.py:1b` → that file's get_config('1b')."""
  file, _, arg = path.partition(':')
  module = importlib.import_module(file.removesuffix('.py').replace('/', '.'))
  return module.get_config(arg) if arg else module.get_config()


def step_rows(gpu, path):
  for variant in _STEP_VARIANTS.value:
    for precision in _STEP_PRECISION.value:
      for attention in _STEP_ATTENTION.value:
        if attention == 'cudnn' and jax.devices()[0].platform != 'gpu':
          continue
        what = f'{path} {attention} {precision}' + ('' if variant == 'preset' else f' {variant}')
        try:
          yield {'what': what, **step_row(gpu, path, attention, precision, variant)}
        except Exception as e:  # one that does not fit must not lose the others
          yield {'what': what, 'error': f'{type(e).__name__}: {str(e)[:300]}'}


def override(config, assignment: str) -> None:
  """config[`a.b`] = value of `a.b=value` (a Python literal, else the text)."""
  key, _, text = assignment.partition('=')
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  *parents, leaf = key.split('.')
  for parent in parents:
    config = config[parent]
  config[leaf] = value


def step_config(path: str, attention: str, precision: str, variant: str = 'preset'):
  """(config, packed) of a step row: the config at `path` with its attention, matmul precision
  and the variant's overrides (`packed`: a batch with segment ids)."""
  config = load_config(path)
  config.model.attention, config.model.matmul_precision = attention, precision
  assignments = [] if variant == 'preset' else variant.split('+')
  for assignment in assignments:
    if assignment != 'packed':
      override(config, assignment)
  return config, 'packed' in assignments


def memory(compiled) -> dict:
  """A compiled program's memory plan per device (XLA's buffer assignment), bytes: arguments,
  outputs, temporaries, outputs in place of donated arguments, and the total (all − donated)."""
  m = compiled.memory_analysis()
  sizes = {'argument': m.argument_size_in_bytes, 'output': m.output_size_in_bytes,
           'temp': m.temp_size_in_bytes, 'alias': m.alias_size_in_bytes}
  return {**sizes, 'total': sizes['argument'] + sizes['output'] + sizes['temp'] - sizes['alias']}


def step_row(gpu, path: str, attention: str, precision: str, variant: str = 'preset') -> dict:
  config, packed = step_config(path, attention, precision, variant)
  prepared = inputs.prepare(config, packed=packed)
  predicted = timing.predict(prepared.train_step.as_text(), gpu)
  state, times = prepared.state, []
  for _ in range(2 + _STEP_ITERS.value):
    start = time.perf_counter()
    state, metrics = prepared.train_step(state, prepared.batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  measured = statistics.median(times[2:])

  def step():
    nonlocal state
    state, metrics = prepared.train_step(state, prepared.batch)
    return metrics
  banked = program(prepared.train_step, step)
  tokens = prepared.run.batch_size * prepared.run.seq_len
  n = prepared.setup.mesh.size
  model_flops = flops.flops_per_token(prepared.setup.model_cfg, prepared.run.seq_len)
  return {'config': path, 'attention': attention, 'matmul_precision': precision,
          'variant': variant, 'measured_s': measured, 'predicted_s': predicted.seconds,
          'ratio': measured / predicted.seconds, 'tokens_per_s_per_device': tokens / measured / n,
          'mfu': model_flops * tokens / n / measured / gpu.peak_bf16_flops,
          'predicted_mfu': model_flops * tokens / n / predicted.seconds / gpu.peak_bf16_flops,
          'predicted_breakdown': predicted.breakdown, 'compile_s': prepared.compile_s,
          'devices': n, 'memory': memory(prepared.train_step), PROGRAM: banked}


PARTS = {'gemm': gemm_rows, 'copy': copy_rows, 'host': host_rows, 'attention': attention_rows, 'steps': step_rows}


def parts() -> dict:
  """{name: rows(gpu)} of --parts; `steps` is a part for each of --step_configs (steps_125m…)."""
  chosen = {}
  for part in _PARTS.value:
    if part not in PARTS:
      raise ValueError(f'--parts: {part!r} is not one of {sorted(PARTS)}')
    if part == 'steps':
      for path in _STEP_CONFIGS.value:
        tag = path.partition(':')[2] or path.rpartition('/')[2].removesuffix('.py')
        chosen[f'steps_{tag}'] = lambda gpu, path=path: step_rows(gpu, path)
    else:
      chosen[part] = PARTS[part]
  return chosen


def refit(part: str, rows: list, gpu: gpus.GPU) -> dict:
  """The constants of planning/gpus.py these measurements imply, from what they measured alone
  (so rows measured under other constants merge): the largest GEMM of each precision, the
  largest pass, the chain's time a kernel, attention's TFLOP/s by kernel, head dim and keys."""
  ok = [r for r in rows if 'measured_s' in r]  # not the failed or skipped
  if part == 'gemm':
    out = {}
    for name, precision, peak in (('GEMM_EFFICIENCY', 'bf16', gpu.peak_bf16_flops),
                                  ('FP8_GEMM_EFFICIENCY', 'fp8', gpu.peak_fp8_flops)):
      if largest := max((r for r in ok if r['precision'] == precision), key=lambda r: r['flops'],
                        default=None):
        out[name] = largest['tflops'] * 1e12 / (
            peak * gpus.tile_waves(largest['m'], largest['n'], 1, gpu.sms))
    return out
  if part == 'copy':
    passes = [r for r in ok if 'bytes' in r]
    chain = next((r for r in ok if 'kernels' in r), None)
    out = {'HBM_EFFICIENCY': max(passes, key=lambda r: r['bytes'])['tb_per_s'] * 1e12
                             / gpu.memory_bandwidth} if passes else {}
    if chain:
      out['KERNEL_LAUNCH_S'] = chain['per_kernel_s']
    return out
  if part == 'host':  # GPU.host_bandwidth: the slower way of the largest copies made one way;
    # host_duplex_bandwidth: the two ways together, the largest copies made both ways at once
    out = {}
    for key, rows in (('host_bandwidth', [r for r in ok if r['way'] != 'both ways']),
                      ('host_duplex_bandwidth', [r for r in ok if r['way'] == 'both ways'])):
      if rows:
        largest = max(r['bytes'] for r in rows)
        out[key] = min(r['gb_per_s'] for r in rows if r['bytes'] == largest) * 1e9
    return out
  if part == 'attention':  # planning/gpus.py's table: {keys: (forward, backward) TFLOP/s}
    table = {}
    for r in sorted(ok, key=lambda r: r['seq_len']):
      if r['impl'] in gpus.ATTENTION_TFLOPS:
        table.setdefault(f'ATTENTION_TFLOPS[{r["impl"]!r}][{r["head_dim"]}]', {})[r['seq_len']] = (
            round(r['fwd_tflops'], 1), round(r['bwd_tflops'], 1))
    return table
  return {}


def take_programs(row: dict, what: str, programs: dict) -> None:
  """Moves the row's programs (its own and those of rows nested in it) into programs[what …]."""
  if PROGRAM in row:
    programs[what] = row.pop(PROGRAM)
  for key, value in row.items():
    if isinstance(value, dict):
      take_programs(value, f'{what} {key}', programs)


def merge(folders: list, out_dir: str) -> None:
  """Merges the parts in `folders` (in order) into out_dir's files of the same part and device:
  a row replaces the row of its `what`, its programs theirs; `command` lists every run's."""
  for folder in folders:
    for path in sorted(glob.glob(f'{folder}/calibrate_*.json')):
      new = json.loads(open(path).read())
      file = os.path.basename(path).removesuffix('.json')
      with gzip.open(f'{folder}/{file}.programs.json.gz') as f:
        new_bank = json.load(f)['programs']
      part = new['benchmark'].removeprefix('calibrate_')
      name = file.rpartition('-')[2]
      try:
        old = json.loads(open(f'{out_dir}/{file}.json').read())
      except FileNotFoundError:
        old = {**new, 'rows': [], 'command': [], 'seconds': 0.0}
      try:  # the first H100 runs banked their rows without programs: the rows still count
        with gzip.open(f'{out_dir}/{file}.programs.json.gz') as f:
          banked = json.load(f)['programs']
      except FileNotFoundError:
        banked = {}
      if (old['device'], old['jax']) != (new['device'], new['jax']):
        raise ValueError(f'--merge: {path} ran on {new["device"]}, jax {new["jax"]}; '
                         f'{out_dir}/{file}.json on {old["device"]}, jax {old["jax"]}')
      replaced = {r['what'] for r in new['rows']}
      # a run's "skipped" rows say where its budget ended: not true of the merged bank
      rows = [r for r in old['rows'] if r['what'] not in replaced and 'skipped' not in r]
      rows += [r for r in new['rows'] if 'skipped' not in r]
      # a row's programs are its `what` and its backward pass's: another row's name may begin
      # with this one's (`…125m cudnn default optimizer.offload_state=True`) and stays
      ours = replaced | {f'{what} fwd_bwd' for what in replaced}
      banked = {what: program for what, program in banked.items() if what not in ours} | new_bank
      commands = old['command'] if isinstance(old['command'], list) else [old['command']]
      gpu = gpus.find(name.upper()) or gpus.NOMINAL
      merged = {**old, 'rows': rows, 'refit': refit(part, rows, gpu),
                'seconds': old['seconds'] + new['seconds'], 'command': commands + [new['command']]}
      bank.write_part(out_dir, part, name, merged, banked)
      print(f'{out_dir}/{file}.json: {len(new["rows"])} rows of {path}, {len(rows)} in all')


def check(out_dir: str) -> None:
  checked = bank.check(out_dir)
  bank.print_check(checked)
  missing = bank.missing_goal(checked)
  report.emit({'benchmark': 'calibrate_check', 'programs': len(checked),
               'missing_goal': [{'bank': c.file, 'what': c.what, 'ratio': c.ratio} for c in missing],
               'ratios': {f'{c.file} {c.what}': round(c.ratio, 4) for c in checked}}, None)


def main(argv):
  del argv
  if _MERGE.value:
    return merge(_MERGE.value, _OUT_DIR.value)
  if _CHECK.value:
    return check(_OUT_DIR.value)
  device = jax.devices()[0]
  gpu = gpus.find(device.device_kind)
  name = gpu.name.lower() if gpu else device.platform
  gpu = gpu or gpus.NOMINAL
  results = {}
  for part, rows_of in parts().items():
    started, rows, programs = time.perf_counter(), [], {}
    print(f'\n{part}: measured on {device.device_kind}, predicted by the time model for {gpu.name}')
    print(f'{"":<44}{"measured":>12}{"predicted":>12}{"ratio":>8}')
    figures = {'benchmark': f'calibrate_{part}', 'device': device.device_kind,
               'platform': device.platform, 'jax': jax.__version__, 'model_for': gpu.name,
               'rows': rows, 'refit': {}, 'seconds': 0.0, 'command': report.command()}
    for row in rows_of(gpu):
      take_programs(row, row['what'], programs)
      rows.append(row)
      if 'error' in row:
        print(f'{row["what"]:<44}failed: {row["error"][:80]}', flush=True)
      elif 'measured_s' not in row:  # a comparison of programs: cudnn packed against its mask
        print(f'{row["what"]:<44}' + '  '.join(
            f'{k} {v["measured_s"] * 1e3:.3f}ms / {v["fwd_bwd"]["measured_s"] * 1e3:.3f}ms'
            for k, v in row.items() if isinstance(v, dict)), flush=True)
      else:
        print(f'{row["what"]:<44}{row["measured_s"] * 1e3:>10.3f}ms'
              f'{row["predicted_s"] * 1e3:>10.3f}ms{row["ratio"]:>8.2f}', flush=True)
      past_budget = time.perf_counter() - started > _BUDGET.value
      if past_budget:
        rows.append({'what': 'the rest of this part', 'skipped': f'past --part_budget_s='
                                                                  f'{_BUDGET.value:g}'})
        print(f'{part}: past {_BUDGET.value:g} s, the rest skipped')
      figures.update(refit=refit(part, rows, gpu), seconds=time.perf_counter() - started)
      bank.write_part(_OUT_DIR.value, part, name, figures, programs)  # banked as it goes
      if past_budget:
        break
    print(f'{part} refit: {figures["refit"]}')
    results[part] = figures
  report.emit({'benchmark': 'calibrate', 'device': device.device_kind, 'jax': jax.__version__,
               'parts': results, 'command': report.command()}, None)


if __name__ == '__main__':
  cli.run(main)
