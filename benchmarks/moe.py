"""The experts' grouped matmul (kernels/grouped_matmul.py) at an MoE layer's shapes: what each
implementation takes of a GPU, compiled deviceless (planning/gpu_compiler.py: no GPU needed), and
on a GPU how fast each runs.

  python -m benchmarks.moe                     # H100, Mixtral's shapes: resources, temporaries
  python -m benchmarks.moe --sweep             # every candidate tile's resources, and the rule's pick
  python -m benchmarks.moe --measure           # on a GPU: TFLOP/s of ours, ragged_dot, one GEMM
  python -m benchmarks.moe --plans             # the MoE presets' steps on 16 H100s, per layout

The shape is one forward and backward (y, dx and dw) of M routed rows (tokens × experts per
token) of width K against G experts' [K, N] weights, bf16, rows spread evenly over the experts;
the defaults are Mixtral's: M = 8192 (4096 tokens × 2), K = 4096, N = 1792 (a tensor=8 share of
its 14,336), G = 8.

Deviceless, for each implementation: temporaries of the compiled program (XLA's memory analysis:
ragged_dot's dense products show here), and for ours each kernel's launch grid, threads, shared
memory per block, registers and spills (`ptxas -v` on XLA's PTX). A variant the compiler rejects
is a row with its message.

--sweep compiles ours for every candidate tile (bm 64/128 × bk 32/64 × bn 64/128 × num_warps
4/8 × num_stages 2/3) and picks, among those without spills that fit shared memory, the largest
bm × bn (fewer programs, more reuse of each loaded tile), then the larger bk, then more stages,
then fewer warps. The pick is printed beside kernels.grouped_matmul.Blocks' defaults, which change
only on a measurement: taller tiles waste more masked rows where a group ends mid-tile, which
resources cannot show and a fine-grained MoE's small groups make common.

--measure (a GPU only) times each implementation's forward and backward, and one dense [M, K] ×
[K, N] GEMM's forward and backward (the same FLOPs: 3 · 2·M·K·N), as the median of --repeats
runs after a warm-up; TFLOP/s counts those FLOPs.

--plans compiles each of --presets (configs/moe.py) for --devices GPUs (deviceless) at each of
--layouts (`axis=size,…` of the mesh, and `expert_buffer=f`): memory, the ragged all-to-all's
bytes against the ideal's all-to-all term and every other collective's against the rest of the
ideal (planning/communication.py), the bytes crossing nodes, and the time model's step and MFU.
"""

import dataclasses
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import report
from configs import moe as moe_configs
from kernels.grouped_matmul import IMPLEMENTATIONS, Blocks, grouped_matmul
from planning import communication, gpu_compiler, gpus
from runtime import cli
from training import settings
from training.programs import compile_and_plan
from training.state import build

_TARGET = flags.DEFINE_string('target', 'H100', f'GPU to compile for: {sorted(gpus.GPUS)}.')
_SHAPE = flags.DEFINE_string('shape', '8192,4096,1792,8', 'M,K,N,G: rows, width, out, experts.')
_SWEEP = flags.DEFINE_bool('sweep', False, 'Compile every candidate tile; pick as documented.')
_MEASURE = flags.DEFINE_bool('measure', False, 'Time each implementation on this GPU.')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed runs per implementation (--measure).')
_PLANS = flags.DEFINE_bool('plans', False, 'Plan the MoE presets at --layouts instead.')
_PRESETS = flags.DEFINE_string('presets', 'mixtral-8x7b,qwen3-30b-a3b', 'configs/moe.py presets.')
_LAYOUTS = flags.DEFINE_string(
    'layouts', 'fsdp=16;fsdp=2,expert=8;fsdp=2,expert=8,expert_buffer=2',
    '`;`-separated layouts: `axis=size,…` and optionally `expert_buffer=f`.')
_DEVICES = flags.DEFINE_integer('devices', 16, 'GPUs the --plans layouts span.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')

KERNELS = ('grouped_matmul', 'grouped_matmul_dw')


def shape() -> tuple[int, int, int, int]:
  M, K, N, G = map(int, _SHAPE.value.split(','))
  return M, K, N, G


def step(implementation: str, blocks: Blocks = Blocks()):
  """y, dx and dw of one grouped matmul: the gradient of sum(y) in both operands."""
  def loss(x, w, sizes):
    y = grouped_matmul(x, w, sizes, implementation=implementation, blocks=blocks)
    return y.astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, (0, 1)))


def dense_step():
  return jax.jit(jax.grad(lambda x, w: jnp.dot(x, w).astype(jnp.float32).sum(), (0, 1)))


def abstract(device, M, K, N, G):
  place = jax.sharding.SingleDeviceSharding(device)
  return (jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=place),
          jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16, sharding=place),
          jax.ShapeDtypeStruct((G,), jnp.int32, sharding=place))


def resources(device, implementation: str, blocks: Blocks = Blocks()) -> dict:
  """{temp_bytes, kernels: {name: resources}} of one compiled step, or {error}."""
  try:
    lowered = gpu_compiler.lower(device, step(implementation, blocks), *abstract(device, *shape()))
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    found = {k.name: dataclasses.asdict(k) for k in gpu_compiler.kernels(lowered)
             if k.name in KERNELS}
  except Exception as e:  # the compiler's refusal (shared memory, say) is a row, not the end
    return {'error': str(e).strip().splitlines()[0][:300]}
  return {'temp_bytes': temp, 'kernels': found}


def spills(r: dict) -> bool:
  return any(k['spill_stores'] or k['spill_loads'] for k in r.get('kernels', {}).values())


def choose(rows: list[dict]) -> dict | None:
  """The module docstring's rule over the tiles that compiled without spilling."""
  ok = [r for r in rows if 'kernels' in r and not spills(r)]
  return max(ok, key=lambda r: (r['bm'] * r['bn'], r['bk'], r['num_stages'], -r['num_warps']),
             default=None)


def print_row(label: str, r: dict) -> None:
  if 'error' in r:
    print(f'{label:<26}compile failed: {r["error"]}', flush=True)
    return
  names = [n for n in KERNELS if n in r['kernels']] or ['-']
  for i, name in enumerate(names):
    k = r['kernels'].get(name)
    lead = f'{label:<26}{r["temp_bytes"] / 2**20:>9.1f}' if i == 0 else ' ' * 35
    if k is None:
      print(lead, flush=True)
      continue
    grid = '×'.join(map(str, k['grid']))
    print(f'{lead}  {name:<18}{grid:>12}{k["threads"]:>8}{k["shared_memory"] / 1024:>9.1f}'
          f'{k["registers"]:>6}{k["spill_stores"]:>7}{k["spill_loads"]:>7}', flush=True)


def operands(M, K, N, G):
  """bf16 x, w and rows spread evenly over the experts (the last takes the remainder)."""
  keys = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (G, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
  sizes = np.full(G, M // G, np.int32)
  sizes[-1] += M - sizes.sum()
  return x, w, jnp.asarray(sizes)


def timed(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure(device) -> dict:
  """Measured seconds and TFLOP/s of each implementation and of one dense GEMM, on `device`."""
  M, K, N, G = shape()
  x, w, sizes = jax.device_put(operands(M, K, N, G), device)
  flops = 3 * 2 * M * K * N
  out = {}
  for implementation in IMPLEMENTATIONS:
    s = timed(step(implementation), (x, w, sizes), _REPEATS.value)
    out[implementation] = {'seconds': s, 'tflops': flops / s / 1e12}
  s = timed(dense_step(), (x, w[0]), _REPEATS.value)
  out['dense_gemm'] = {'seconds': s, 'tflops': flops / s / 1e12}
  return out


def plan(preset: str, layout: str) -> dict:
  """One preset's compiled step at one layout: the module docstring's --plans figures."""
  fields = dict(part.split('=') for part in layout.split(','))
  buffer = float(fields.pop('expert_buffer', 0))
  config = moe_configs.get_config(preset)
  config.mesh.update(report.parse_mesh(','.join(f'{k}={v}' for k, v in fields.items())))
  config.model.expert_buffer = buffer
  config.plan.target, config.plan.devices, config.dry_run = _TARGET.value, _DEVICES.value, True
  config = settings.resolve(config)
  setup = build(config)
  _, the_plan = compile_and_plan(setup)
  ideal = communication.ideal_bytes(setup.model_cfg, dict(setup.mesh.shape), config.batch_size,
                                    config.seq_len, config.microbatches,
                                    config.model.remat_policy, setup.model_cfg.reduce_dtype.itemsize)
  ragged = the_plan.collectives.get('ragged-all-to-all', {}).get('bytes', 0)
  return {'preset': preset, 'layout': layout, 'mesh': dict(setup.mesh.shape),
          'expert_buffer': buffer, 'memory_bytes': the_plan.total_bytes, 'fits': the_plan.fits,
          'all_to_all_bytes': ragged, 'ideal_all_to_all_bytes': ideal['all_to_all'],
          'other_bytes': the_plan.collective_bytes - ragged,
          'ideal_other_bytes': sum(ideal.values()) - ideal['all_to_all'],
          'across_nodes_bytes': the_plan.across_nodes_bytes, 'predicted': the_plan.time}


def plans() -> None:
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.moe', *sys.argv[1:]])
  gib = lambda b: f'{b / 2**30:.2f}'
  print(f'{_DEVICES.value} × {_TARGET.value} (deviceless); bytes sent per device per step, GiB; '
        'step and MFU predicted by the time model')
  print(f'{"preset":<15}{"layout":<34}{"GiB":>7}{"fits":>6}{"all-to-all":>11}{"ideal":>8}'
        f'{"other":>8}{"ideal":>8}{"across":>8}{"step s":>8}{"MFU":>7}{"comm s":>8}')
  rows = []
  for preset in _PRESETS.value.split(','):
    for layout in _LAYOUTS.value.split(';'):
      r = plan(preset, layout)
      rows.append(r)
      t = r['predicted']
      print(f'{preset:<15}{layout:<34}{gib(r["memory_bytes"]):>7}{str(r["fits"]):>6}'
            f'{gib(r["all_to_all_bytes"]):>11}{gib(r["ideal_all_to_all_bytes"]):>8}'
            f'{gib(r["other_bytes"]):>8}{gib(r["ideal_other_bytes"]):>8}'
            f'{gib(r["across_nodes_bytes"]):>8}{t["seconds"]:>8.3f}{t["mfu"]:>7.1%}'
            f'{t["breakdown"]["communication"]["s"]:>8.3f}', flush=True)
  report.emit({'benchmark': 'moe_plans', 'target': _TARGET.value, 'devices': _DEVICES.value,
               'deviceless': True, 'jax': jax.__version__, 'plans': rows,
               'command': report.command()}, _OUT.value)


def main(argv):
  del argv
  if _PLANS.value:
    return plans()
  M, K, N, G = shape()
  if _MEASURE.value:
    device = jax.devices()[0]
    if device.platform != 'gpu':
      raise ValueError(f'--measure times a GPU, and this machine\'s device is '
                       f'{device.platform}; run it on a GPU (the deviceless figures need none)')
    print(f'measured on {device.device_kind}: M={M} K={K} N={N} G={G}, bf16, forward and backward')
    timings = measure(device)
    for name, t in timings.items():
      print(f'{name:<12}{t["seconds"] * 1e3:>10.3f} ms{t["tflops"]:>10.1f} TFLOP/s (measured)')
    report.emit({'benchmark': 'moe', 'measured_on': device.device_kind, 'jax': jax.__version__,
                 'shape': [M, K, N, G], 'timings': timings, 'command': report.command()},
                _OUT.value)
    return
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.moe', *sys.argv[1:]])
  device, = gpu_compiler.devices(gpus.get(_TARGET.value), 1)
  print(f'compiled for {device.device_kind} (deviceless): M={M} K={K} N={N} G={G}, bf16, '
        'forward and backward')
  print(f'{"variant":<26}{"temp MiB":>9}  {"kernel":<18}{"grid":>12}{"threads":>8}'
        f'{"smem KiB":>9}{"regs":>6}{"spillS":>7}{"spillL":>7}')
  figures = {'benchmark': 'moe', 'compiled_for': device.device_kind, 'deviceless': True,
             'jax': jax.__version__, 'shape': [M, K, N, G], 'command': report.command()}
  if _SWEEP.value:
    rows = []
    for bm, bk, bn, warps, stages in itertools.product((64, 128), (32, 64), (64, 128), (4, 8),
                                                       (2, 3)):
      blocks = Blocks(bm, bk, bn, warps, stages)
      r = {**blocks._asdict(), **resources(device, 'pallas', blocks)}
      print_row(f'pallas {bm}×{bk}×{bn} w{warps} s{stages}', r)
      rows.append(r)
    best = choose(rows)
    figures.update(results=rows, spilling_variants=sum(map(spills, rows)),
                   chosen=best and {k: best[k] for k in Blocks._fields})
    print(f'chosen: {figures["chosen"]} (defaults: {Blocks()._asdict()})')
  else:
    results = {}
    for implementation in IMPLEMENTATIONS:
      results[implementation] = resources(device, implementation)
      print_row(implementation, results[implementation])
    figures['results'] = results
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
