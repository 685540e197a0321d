"""Across nodes at a fraction of the bytes: a preset's step under each partition of
config.partition (sharding/hierarchical.py), compiled deviceless for --target GPUs
(planning/gpu_compiler.py), at each of --devices.

  python -m benchmarks.partition --config=configs/llama.py:8b --devices=16,32
  python -m benchmarks.partition --config=configs/llama.py:70b --devices=32,64 --replica_gpus=16 \\
      --config.model.grad_reduce_dtype=bfloat16

For N GPUs in nodes of the GPU's gpus_per_node, the schemes, each a mesh and config.partition:
  flat            FSDP over all N (data=1): ZeRO-3, every layer gathered across nodes
  hsdp            data=N/R replicas of R = --replica_gpus GPUs (one node by default), parameters
                  replicated over data, the optimizer state split only within a replica (MaxText's
                  dcn_data_parallelism, torchtitan's HSDP)
  hierarchical    the same mesh with the state split over every device and the compute copy
                  gathered across data once a step (hpZ)
  +int8 weights   and that gather in int8 blocks (qwZ)
  +int8 grads     and the gradients' reduction across data in int8 blocks too (qgZ)
The preset's batch grows with N (its rows a device kept); its remat policy and microbatches kept.

Per device: memory, what it sends per step, what the collectives spanning nodes send against
the ideal's (planning/communication.py: across_nodes) and against flat's, and the time model's
step and MFU (predicted, planning/timing.py; cross-node collectives at the node's bandwidth).
"""

import dataclasses
import sys

import jax
from absl import flags
from ml_collections import config_flags

from benchmarks import report
from configs import llama
from model import ModelConfig
from planning import communication, gpu_compiler, gpus
from runtime import cli
import sharding
from training import settings
from training.programs import compile_and_plan
from training.state import build

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/llama.py:8b', 'Config file.',
                                          lock_config=True)
_DEVICES = flags.DEFINE_string('devices', '16,32', 'GPU counts to plan for, comma-separated.')
_REPLICA_GPUS = flags.DEFINE_integer('replica_gpus', 0, 'GPUs of a data replica; 0: a node.')
_SCHEMES = flags.DEFINE_string('schemes', 'flat,hsdp,hierarchical,+int8 weights,+int8 grads',
                               'Which of the docstring\'s schemes to plan.')
_TARGET = flags.DEFINE_string('target', 'H100', f'GPU to compile for: {sorted(gpus.GPUS)}.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')

PARTITIONS = {'flat': {}, 'hsdp': {}, 'hierarchical': dict(hierarchical=True),
              '+int8 weights': dict(hierarchical=True, weights='int8'),
              '+int8 grads': dict(hierarchical=True, weights='int8', gradients='int8')}


def plan(devices: int, scheme: str, replica: int, gpus_per_node: int) -> dict:
  """One scheme's compiled step on `devices` GPUs: the module docstring's figures."""
  config = _CONFIG.value.copy_and_resolve_references()
  preset = config_flags.get_config_filename(flags.FLAGS['config']).partition(':')[2]
  config.batch_size = config.batch_size * devices // llama.GPUS.get(preset, devices)
  flat = scheme == 'flat'
  config.mesh.update(data=1 if flat else devices // replica, fsdp=devices if flat else replica)
  config.partition.update(PARTITIONS[scheme])
  config.plan.target, config.plan.devices, config.dry_run = _TARGET.value, devices, True
  config = settings.resolve(config)
  setup = build(config)
  _, the_plan = compile_and_plan(setup)
  mesh = dict(setup.mesh.shape)
  ideal = communication.ideal_bytes(setup.model_cfg, mesh, config.batch_size, config.seq_len,
                                    config.microbatches, config.model.remat_policy,
                                    setup.model_cfg.reduce_dtype.itemsize, config.partition)
  return {'devices': devices, 'scheme': scheme, 'mesh': mesh,
          'partition': dataclasses.asdict(config.partition), 'batch_size': config.batch_size,
          'microbatches': config.microbatches, 'memory_bytes': the_plan.total_bytes,
          'fits': the_plan.fits, 'sent_bytes': the_plan.collective_bytes,
          'across_nodes_bytes': the_plan.across_nodes_bytes,
          'ideal_across_nodes_bytes': communication.across_nodes(ideal, mesh, gpus_per_node),
          'predicted': the_plan.time}


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.partition', *sys.argv[1:]])
  gpu = gpus.get(_TARGET.value)
  replica = _REPLICA_GPUS.value or gpu.gpus_per_node
  m = _CONFIG.value.model
  reduced = ModelConfig.from_config(m).reduce_dtype.name  # 'auto' on these GPUs: the compute's
  print(f'{_TARGET.value} (deviceless), nodes of {gpu.gpus_per_node}, data replicas of {replica} '
        f'GPUs; d_model {m.d_model}, {m.n_layers} layers, remat {m.remat_policy}, gradients '
        f'reduced in {reduced}; per device per step, GiB; step and MFU predicted by '
        'the time model')
  print(f'{"GPUs":>5}  {"scheme":<15}{"GiB":>7}{"fits":>6}{"sent":>9}{"across":>9}{"ideal":>9}'
        f'{"÷ flat":>8}{"step s":>8}{"MFU":>7}{"comm s":>8}')
  rows, gib = [], lambda b: b / 2**30
  for devices in (int(n) for n in _DEVICES.value.split(',')):
    flat = None
    for scheme in _SCHEMES.value.split(','):
      try:
        r = plan(devices, scheme, replica, gpu.gpus_per_node)
      except sharding.MeshMismatch as e:
        print(f'{devices:>5}  {scheme:<15}does not divide: {e}')
        continue
      rows.append(r)
      flat = r['across_nodes_bytes'] if scheme == 'flat' else flat
      share = f'{r["across_nodes_bytes"] / flat:>8.3f}' if flat else f'{"":>8}'
      t = r['predicted']
      print(f'{devices:>5}  {scheme:<15}{gib(r["memory_bytes"]):>7.2f}'
            f'{"yes" if r["fits"] else "no":>6}{gib(r["sent_bytes"]):>9.2f}'
            f'{gib(r["across_nodes_bytes"]):>9.2f}{gib(r["ideal_across_nodes_bytes"]):>9.2f}'
            f'{share}{t["seconds"]:>8.3f}{t["mfu"]:>7.1%}'
            f'{t["breakdown"]["communication"]["s"]:>8.3f}', flush=True)
  report.emit({'benchmark': 'partition', 'compiled_for': gpu.device_kind, 'deviceless': True,
               'gpus_per_node': gpu.gpus_per_node, 'replica_gpus': replica,
               'node_bandwidth': gpu.node_bandwidth, 'jax': jax.__version__,
               'config': config_flags.get_config_filename(flags.FLAGS['config']),
               'model': m.to_dict(), 'plans': rows, 'command': report.command()}, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
