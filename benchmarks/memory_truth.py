"""Are the memory figures of a compile without a GPU the GPU's own? Each train step that
benchmarks/calibrate.py measured on a GPU keeps the memory plan its GPU's compile made; this
compiles the same step here for the same GPU with no GPU present (planning/gpu_compiler.py) and
sets the two side by side, per device: arguments, outputs, temporaries, outputs in place of donated
arguments, and the total (all − donated). Both are XLA's buffer assignment, so a ratio other
than 1 means the two compiles made different programs (another scheduler limit, say).

  python -m benchmarks.memory_truth          # every banked steps file (benchmarks/results)
  python -m benchmarks.memory_truth --files=benchmarks/results/calibrate_steps_1b-h100.json

Rows banked before calibrate kept memory, and those that failed, are counted as skipped. A bank
made by another jax than this one is compared all the same, and the table says so.
"""

import glob
import json
import sys

import jax
from absl import flags

from benchmarks import calibrate, report
from planning import gpu_compiler, gpus
from reporting.metrics import print_table
from runtime import cli
from training import programs, settings
from training.state import build

_FILES = flags.DEFINE_list('files', sorted(glob.glob('benchmarks/results/calibrate_steps_*.json')),
                           'calibrate steps files whose rows to compile again.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')

GIB = 2**30


def deviceless_memory(row: dict, gpu: str) -> dict:
  """The memory plan of `row`'s step compiled here for `row['devices']` of `gpu`."""
  config, packed = calibrate.step_config(row['config'], row['attention'],
                                         row['matmul_precision'], row.get('variant', 'preset'))
  config.plan.target, config.plan.devices, config.dry_run = gpu, row['devices'], True
  run = settings.resolve(config, log=lambda *_: None)
  setup = build(run)
  compiled = programs.compile_train_step(setup, run.batch_size, run.seq_len, run.loss.z_loss,
                                         packed=packed, microbatches=run.microbatches)
  return calibrate.memory(compiled)


def compared(path: str) -> tuple[list[dict], int]:
  """(a row for each step of the file at `path` that kept its GPU's memory, how many did not)."""
  try:
    banked = json.loads(open(path).read())
  except (OSError, ValueError) as e:
    raise SystemExit(f'--files: cannot read {path} ({e}); name calibrate steps files, '
                     'benchmarks/results/calibrate_steps_<config>-<gpu>.json') from None
  gpu = gpus.find(path.rpartition('-')[2].removesuffix('.json').upper())
  if gpu is None:
    raise SystemExit(f'--files: {path} was not measured on a GPU of planning/gpus.py')
  rows, skipped = [], 0
  for row in banked['rows']:
    if 'memory' not in row:
      skipped += 1
      continue
    here = deviceless_memory(row, gpu.name)
    rows.append({'file': path, 'what': row['what'], 'jax': banked['jax'], 'gpu': row['memory'],
                 'deviceless': here, 'ratio': here['total'] / row['memory']['total']})
  return rows, skipped


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.memory_truth', *sys.argv[1:]])
  rows, skipped = [], 0
  for path in _FILES.value:
    found, left = compared(path)
    rows += found
    skipped += left
  table = [('step', 'GPU compile GiB · deviceless GiB · deviceless ÷ GPU')]
  for r in rows:
    other = '' if r['jax'] == jax.__version__ else f'  (banked with jax {r["jax"]})'
    table.append((r['what'], f'{r["gpu"]["total"] / GIB:.2f} · {r["deviceless"]["total"] / GIB:.2f}'
                             f' · {r["ratio"]:.4f}{other}'))
  print_table(table)
  print(f'{len(rows)} step(s) compared, {skipped} banked without their GPU\'s memory or failed')
  report.emit({'benchmark': 'memory_truth', 'jax': jax.__version__, 'compared': rows,
               'skipped': skipped, 'command': report.command()}, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
