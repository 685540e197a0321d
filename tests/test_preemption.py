"""Preemption on a multi-process job: a signal to one process stops every process at the same
step (JAX's preemption service agrees on it), whether it is a scheduler's SIGTERM or a Ctrl-C."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.conftest import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]

WORKER = '''
import os, sys, time
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
import jax
port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f'localhost:{port}', num_processes=2, process_id=pid,
                           initialization_timeout=60)
from runtime.preemption import StopSignals
with StopSignals() as stop:
  print('ready', flush=True)
  for step in range(1, 1_000_000):
    time.sleep(0.005 * (1 + 2 * pid))  # the processes run at different speeds
    if stop.requested(step):
      print('stopped at', step, flush=True)
      break
jax.distributed.shutdown()
'''


@pytest.mark.integration
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_a_signal_to_one_process_stops_all_at_the_same_step(signum):
  port = free_port()
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': str(REPO)}
  processes = [subprocess.Popen([sys.executable, '-c', WORKER, str(port), str(pid)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=env) for pid in (0, 1)]
  try:
    for p in processes:
      assert p.stdout.readline().strip() == 'ready'
    processes[1].send_signal(signum)
    stops = [p.communicate(timeout=60)[0].strip() for p in processes]  # a hang fails here
  finally:
    for p in processes:
      p.kill()
  assert [p.returncode for p in processes] == [0, 0]
  assert stops[0].startswith('stopped at ') and stops[0] == stops[1], stops


SWALLOWED = '''
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from runtime import cli

def main(argv):
  try:  # where Python ran the handler may swallow its SystemExit (a finalizer's frame does)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)
  except SystemExit:
    pass
  print('finished the work')

cli.run(main)
'''


def test_a_sigterm_outside_training_ends_the_program_with_its_status_even_if_swallowed():
  """An entry point (sample.py, export.py, evaluate.py) stopped by SIGTERM says so in one line
  and exits 128 + 15, even where the handler's SystemExit was caught on its way out."""
  result = subprocess.run([sys.executable, '-c', SWALLOWED, str(REPO)], capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 128 + signal.SIGTERM, result
  assert result.stderr.strip().splitlines()[-1].endswith('stopped by SIGTERM'), result.stderr
