"""Runs docs/multi-host.md's two-process job as written (two train.py processes of 4 simulated
CPU devices each, joined by jax.distributed over localhost) and the same run as one process of 8
devices, and compares their losses step by step.

  python -m benchmarks.two_processes --out=benchmarks/results/two_processes-cpu.json

Should show: the same losses to bf16 rounding (sums taken in another order across processes);
process 0 prints the log, process 1 nothing of its own. The figures keep process 0's log lines,
which docs/multi-host.md shows (scripts/doc_figures.py: two_processes).

Method: configs/default.py with --config.train_steps=6 --config.log_every=1, each run in a
workdir of its own under a temporary folder (removed after), a free port for the coordinator;
the losses read from each run's metrics.jsonl.
"""

import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks import report
from reporting.metrics import print_table
from runtime.distributed import free_port

_STEPS = flags.DEFINE_integer('steps', 6, 'Training steps of each run.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')

REPO = pathlib.Path(__file__).resolve().parents[1]


def train(workdir: pathlib.Path, devices_each: int, processes: int) -> tuple[list[str], float]:
  """Process 0's output lines and the job's seconds; exits the benchmark if a process fails."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1',
         'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices_each}'}
  flags_ = ['--config=configs/default.py', f'--config.workdir={workdir}',
            f'--config.train_steps={_STEPS.value}', '--config.log_every=1']
  port = free_port()
  logs = [workdir.parent / f'{workdir.name}-process{i}.txt' for i in range(processes)]
  start = time.perf_counter()
  running = []
  for i, log in enumerate(logs):
    dist = [f'--config.distributed.coordinator_address=localhost:{port}',
            f'--config.distributed.num_processes={processes}',
            f'--config.distributed.process_id={i}'] if processes > 1 else []
    with log.open('w') as out:
      running.append(subprocess.Popen([sys.executable, 'train.py', *flags_, *dist], cwd=REPO,
                                      env=env, stdout=out, stderr=subprocess.STDOUT))
  codes = [p.wait(timeout=900) for p in running]
  seconds = time.perf_counter() - start
  texts = [log.read_text() for log in logs]
  if any(codes):
    sys.exit(f'{processes} process(es) × {devices_each} devices exited {codes}:\n'
             + texts[codes.index(next(c for c in codes if c))][-3000:])
  return texts[0].splitlines(), seconds


def losses(workdir: pathlib.Path) -> list[float]:
  records = map(json.loads, (workdir / 'metrics.jsonl').read_text().splitlines())
  return [r['loss'] for r in sorted((r for r in records if 'loss' in r), key=lambda r: r['step'])]


def main(argv):
  del argv
  folder = pathlib.Path(tempfile.mkdtemp(prefix='meshlm-2proc-'))
  try:
    log, two_s = train(folder / 'two', 4, 2)
    _, one_s = train(folder / 'one', 8, 1)
    two, one = losses(folder / 'two'), losses(folder / 'one')
  finally:
    shutil.rmtree(folder)
  if len(two) != _STEPS.value or len(one) != _STEPS.value:
    sys.exit(f'expected {_STEPS.value} losses from each run, got {len(two)} and {len(one)}')
  # meshlm's own lines (gloo's connection logs are not what the docs show), the workdir named as
  # the docs' command names it
  ours = [line.replace(str(folder / 'two'), '/tmp/meshlm-2proc') for line in log
          if line.startswith(('meshlm:', 'compiled in', 'data:', 'initialised in', 'step '))]
  largest = max(abs(a - b) / abs(b) for a, b in zip(two, one))
  figures = {'benchmark': 'two_processes', 'config': 'configs/default.py', 'steps': _STEPS.value,
             'platform': 'cpu', 'machine': platform.processor() or platform.machine(),
             'cpus': os.cpu_count(), 'jax': importlib.metadata.version('jax'),
             'python': platform.python_version(), 'two_process_losses': two,
             'one_process_losses': one, 'largest_relative_difference': largest,
             'two_process_s': two_s, 'one_process_s': one_s, 'process0_log': ours,
             'command': report.command()}
  print_table([(f'step {i + 1}', f'{a:.4f} (2 × 4 devices)  {b:.4f} (1 × 8 devices)')
               for i, (a, b) in enumerate(zip(two, one))]
              + [('largest relative difference', f'{largest:.1e}'),
                 ('job time', f'{two_s:.1f} s (2 processes), {one_s:.1f} s (1 process)')])
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  app.run(main)
