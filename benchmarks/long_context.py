"""Long context: what fits, at what length, on which mesh, with all-gathered keys and values or a
ring; compiled deviceless for --target GPUs (planning/gpu_compiler.py), so memory and collectives
are the GPU compiler's.

  python -m benchmarks.long_context --config=configs/llama.py:8b-128k \\
      --lengths=32768,65536,131072 --meshes='sequence=8;fsdp=2,sequence=4'

Each (length, mesh, context_parallel) is compiled once for --devices GPUs, with one row per
data×fsdp shard (the batch the mesh splits least). Bytes are what each device sends per step
(sharding/collectives.py), against planning/communication.py's ideal for that choice; 'ring' is
the collective-permutes alone against the ideal of the sequence term. Step time and MFU are the
time model's prediction of the compiled step (planning/timing.py), not measurements.
"""

import sys

import jax
from absl import flags
from ml_collections import config_flags

from benchmarks import report
from planning import communication, gpu_compiler, gpus
from runtime import cli
import sharding
from training import settings
from training.programs import compile_and_plan
from training.state import build

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/llama.py:8b-128k', 'Config file.',
                                          lock_config=True)
_LENGTHS = flags.DEFINE_string('lengths', '32768,65536,131072', 'Sequence lengths, comma-separated.')
_MESHES = flags.DEFINE_string('meshes', 'sequence=8;fsdp=2,sequence=4',
                              'Meshes to compile, `;`-separated `axis=size,…`.')
_MODES = flags.DEFINE_string('context_parallel', 'all_gather,ring', 'Choices to compare.')
_TARGET = flags.DEFINE_string('target', 'H100', f'GPU to compile for: {sorted(gpus.GPUS)}.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'How many GPUs each mesh spans.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def measure(config, length: int, mesh: dict, mode: str) -> dict:
  config = config.copy_and_resolve_references()
  config.mesh.update(mesh)
  config.seq_len, config.batch_size = length, mesh['data'] * mesh['fsdp']
  config.model.context_parallel = mode
  config = settings.resolve(config)
  setup = build(config)
  plan = compile_and_plan(setup)[1]
  ideal = communication.ideal_bytes(
      setup.model_cfg, mesh, config.batch_size, config.seq_len, config.microbatches,
      config.model.remat_policy, setup.model_cfg.reduce_dtype.itemsize)
  ring = plan.collectives.get('collective-permute', {}).get('bytes', 0)
  return {'seq_len': length, 'mesh': mesh, 'context_parallel': mode,
          'batch_size': config.batch_size, 'memory_bytes': plan.total_bytes, 'fits': plan.fits,
          'budget_bytes': plan.memory_bytes, 'collectives': plan.collectives,
          'sent_bytes': plan.collective_bytes, 'ideal': ideal, 'ideal_bytes': sum(ideal.values()),
          'ring_bytes': ring, 'ring_ratio': ring / ideal['sequence'] if mode == 'ring' else None,
          'predicted': plan.time}


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.long_context', *sys.argv[1:]])
  config = _CONFIG.value.copy_and_resolve_references()
  config.plan.target, config.plan.devices = _TARGET.value, _DEVICES.value
  config.dry_run = True  # plans: for GPUs that are not here
  config.model.attention = 'pallas'
  kind = gpus.get(_TARGET.value).device_kind
  m = config.model
  print(f'{_DEVICES.value} × {kind} (deviceless); d_model {m.d_model}, '
        f'{m.n_layers} layers, pallas attention, remat {m.remat_policy}; one row per data×fsdp '
        'shard; GiB per device')
  print(f'{"length":>7}  {"mesh":<40}{"context":<11}{"memory":>8}{"fits":>6}{"sent":>8}'
        f'{"ideal":>8}{"ratio":>7}{"ring/ideal":>11}{"step s":>8}{"MFU":>7}  (predicted)')
  results = []
  for length in (int(x) for x in _LENGTHS.value.split(',')):
    for mesh in (report.parse_mesh(x) for x in _MESHES.value.split(';') if x.strip()):
      for mode in _MODES.value.split(','):
        r = measure(config, length, mesh, mode)
        results.append(r)
        gib = lambda b: b / 2**30
        ring = f'{r["ring_ratio"]:.2f}' if r['ring_ratio'] is not None else '-'
        print(f'{length:>7}  {sharding.describe(mesh):<40}{mode:<11}{gib(r["memory_bytes"]):>8.2f}'
              f'{"yes" if r["fits"] else "no":>6}{gib(r["sent_bytes"]):>8.2f}'
              f'{gib(r["ideal_bytes"]):>8.2f}{r["sent_bytes"] / r["ideal_bytes"]:>7.2f}'
              f'{ring:>11}{r["predicted"]["seconds"]:>8.2f}{r["predicted"]["mfu"]:>7.1%}',
              flush=True)
  report.emit({'benchmark': 'long_context', 'compiled_for': kind,
               'deviceless': True, 'n_devices': _DEVICES.value, 'jax': jax.__version__,
               'config': config_flags.get_config_filename(flags.FLAGS['config']),
               'model': m.to_dict(), 'results': results, 'command': report.command()}, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
