"""Pipeline parallelism, compiled deviceless for --target GPUs (planning/gpu_compiler.py): the
schedule's bubble, and a preset over nodes with its stages across them against FSDP over all.

  python -m benchmarks.pipeline --config=configs/llama.py:8b --devices=16 \\
      --layouts='fsdp=16;stage=2,fsdp=8' --microbatches=2,4 --virtual_stages=1,2

Bubble: for P stages, V virtual stages and M microbatches, a small model's step is compiled for P
GPUs and the schedule's ticks T are read from the program (how many times the stage-to-stage
collective-permute runs); the bubble is (T − V·M)/T, next to (P − 1)/(V·M + P − 1).

Layouts: the preset's step for --devices GPUs, the GPU's gpus_per_node a node (the mesh's devices
in order, as a multi-process job orders them: by process), the mesh's first axes spanning nodes.
Per device: memory, bytes sent per step, the bytes of collectives whose devices span nodes (those
run at the NIC's speed, planning/gpus.py node_bandwidth; the rest at NVLink's), and the time
model's prediction of the compiled step (planning/timing.py: the bubble is in its kernels, every
stage running its layers at every tick; communication is what the schedule leaves exposed), with
the MFU it implies.
"""

import itertools
import sys

import jax
from absl import flags
from ml_collections import config_flags

from benchmarks import report
from configs import base
from model import pipeline
from planning import gpu_compiler, gpus
from runtime import cli
from sharding import collectives
import sharding
from training import programs
from training import settings
from training.programs import compile_and_plan
from training.state import build

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/llama.py:8b', 'Config file.',
                                          lock_config=True)
_LAYOUTS = flags.DEFINE_string('layouts', 'fsdp=16;stage=2,fsdp=8',
                               'Meshes to compare, `;`-separated `axis=size,…`.')
_MICROBATCHES = flags.DEFINE_string('microbatches', '2,4', 'Microbatch counts for meshes with '
                                    'stages (the config\'s own for the rest).')
_VIRTUAL = flags.DEFINE_string('virtual_stages', '1,2', 'Virtual stage counts V (chunks a stage) '
                               'of the bubble table and of the meshes with stages.')
_STAGES = flags.DEFINE_string('stages', '4,8', 'Stage counts P of the bubble table.')
_BUBBLE_MICROBATCHES = flags.DEFINE_string('bubble_microbatches', '8,16,32',
                                           'Microbatch counts M of the bubble table.')
_TARGET = flags.DEFINE_string('target', 'H100', f'GPU to compile for: {sorted(gpus.GPUS)}.')
_DEVICES = flags.DEFINE_integer('devices', 16, 'How many GPUs the layouts span.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def stage_ticks(hlo: str, stage_of) -> int:
  """How many ticks the compiled schedule runs: executions of its forward collective-permute."""
  return max(c.executions for c in collectives.executed(hlo)
             if c.op == 'collective-permute' and c.crosses(stage_of))


def bubble(gpu, stages: int, microbatches: int, virtual: int) -> dict:
  config = base.get_config()  # a layer a chunk, a row a microbatch: the schedule is the point
  config.mesh.update(data=1, stage=stages, fsdp=1, tensor=1, sequence=1)
  config.model.n_layers, config.model.vocab_size = stages * virtual, 384
  config.model.virtual_stages = virtual
  config.batch_size, config.microbatches = microbatches, microbatches
  setup = build(settings.resolve(config, gpu_compiler.devices(gpu, stages)))
  hlo = programs.compile_train_step(setup, config.batch_size, config.seq_len, 0.0,
                                    microbatches=microbatches).as_text()
  ticks = stage_ticks(hlo, lambda device: device)
  return {'stages': stages, 'virtual_stages': virtual, 'microbatches': microbatches,
          'ticks': ticks, 'bubble': (ticks - virtual * microbatches) / ticks,
          'analytic': pipeline.bubble_fraction(microbatches, stages, virtual)}


def layout(config, mesh: dict, microbatches: int, virtual: int) -> dict:
  config = config.copy_and_resolve_references()
  config.mesh.update(mesh)
  config.microbatches, config.model.virtual_stages = microbatches, virtual
  config = settings.resolve(config)
  setup = build(config)
  _, plan = compile_and_plan(setup)
  return {'mesh': mesh, 'microbatches': microbatches, 'virtual_stages': virtual,
          'memory_bytes': plan.total_bytes,
          'argument_bytes': plan.argument_bytes, 'temp_bytes': plan.temp_bytes,
          'fits': plan.fits, 'sent_bytes': plan.collective_bytes,
          'across_nodes_bytes': plan.across_nodes_bytes, 'predicted': plan.time,
          'bubble': pipeline.bubble_fraction(microbatches, mesh['stage'], virtual),
          'collectives': plan.collectives}


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.pipeline', *sys.argv[1:]])
  gpu = gpus.get(_TARGET.value)
  gib = lambda b: b / 2**30

  print(f'Bubble: a small model compiled for P × {gpu.device_kind} (deviceless)')
  print(f'{"P":>3}{"V":>3}{"M":>5}{"ticks":>7}{"bubble":>9}{"(P-1)/(V·M+P-1)":>17}')
  bubbles = []
  virtuals = [int(x) for x in _VIRTUAL.value.split(',')]
  for stages in (int(x) for x in _STAGES.value.split(',')):
    for virtual in virtuals:
      for microbatches in (int(x) for x in _BUBBLE_MICROBATCHES.value.split(',')):
        r = bubble(gpu, stages, microbatches, virtual)
        bubbles.append(r)
        print(f'{stages:>3}{virtual:>3}{microbatches:>5}{r["ticks"]:>7}{r["bubble"]:>9.3f}'
              f'{r["analytic"]:>17.3f}', flush=True)

  config = _CONFIG.value.copy_and_resolve_references()
  config.plan.target, config.plan.devices = _TARGET.value, _DEVICES.value
  config.dry_run = True  # plans: for GPUs that are not here
  nodes = _DEVICES.value // gpu.gpus_per_node
  m = config.model
  print(f'\n{_DEVICES.value} × {gpu.device_kind} (deviceless) as {nodes} nodes; d_model '
        f'{m.d_model}, {m.n_layers} layers, batch {config.batch_size} × {config.seq_len}, remat '
        f'{m.remat_policy}, {m.attention} attention; per device')
  print(f'{"mesh":<52}{"V":>3}{"M":>3}{"GiB":>8}{"fits":>6}{"temp GiB":>10}{"sent GiB":>10}'
        f'{"across nodes GiB":>18}{"bubble":>8}{"step s":>8}{"MFU":>7}{"comm s":>8}  (predicted)')
  layouts = []
  for mesh in (report.parse_mesh(x) for x in _LAYOUTS.value.split(';') if x.strip()):
    staged = mesh['stage'] > 1
    counts = [int(x) for x in _MICROBATCHES.value.split(',')] if staged else [config.microbatches]
    for virtual, microbatches in itertools.product(virtuals if staged else [1], counts):
      try:
        r = layout(config, mesh, microbatches, virtual)
      except sharding.MeshMismatch as e:
        print(f'{sharding.describe(mesh):<52}{virtual:>3}{microbatches:>3}  does not divide: {e}')
        continue
      layouts.append(r)
      print(f'{sharding.describe(mesh):<52}{virtual:>3}{microbatches:>3}'
            f'{gib(r["memory_bytes"]):>8.2f}'
            f'{"yes" if r["fits"] else "no":>6}{gib(r["temp_bytes"]):>10.2f}'
            f'{gib(r["sent_bytes"]):>10.2f}{gib(r["across_nodes_bytes"]):>18.2f}'
            f'{r["bubble"]:>8.3f}{r["predicted"]["seconds"]:>8.3f}{r["predicted"]["mfu"]:>7.1%}'
            f'{r["predicted"]["breakdown"]["communication"]["s"]:>8.3f}', flush=True)
  report.emit({'benchmark': 'pipeline', 'compiled_for': gpu.device_kind, 'deviceless': True,
               'n_devices': _DEVICES.value, 'gpus_per_node': gpu.gpus_per_node,
               'node_bandwidth': gpu.node_bandwidth, 'link_bandwidth': gpu.link_bandwidth,
               'jax': jax.__version__, 'config': config_flags.get_config_filename(
                   flags.FLAGS['config']), 'model': m.to_dict(), 'bubble': bubbles,
               'layouts': layouts, 'command': report.command()}, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
