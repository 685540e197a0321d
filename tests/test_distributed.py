"""Multi-process jobs: two local processes × 4 CPU devices (gloo over localhost) train exactly as
one process × 8 devices, score lm-eval's tasks during training as it does, save a checkpoint one
process resumes, and a killed process makes the
other exit with an error within the heartbeat timeout instead of hanging."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

from configs import base
from evaluation import during
from runtime import distributed
from runtime.checkpoint import Checkpointer, CheckpointWarning
from tests.conftest import FAST_COMPILE, SMALL_CORPUS, free_port
from training import loop, settings
from training.state import build

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 6


def default_overrides(workdir):
  return {'workdir': str(workdir), 'train_steps': STEPS, 'log_every': 1, 'eval_every': 0,
          'checkpoint_every': 3, 'batch_size': 8, 'data.paths': SMALL_CORPUS,
          'data.validation_fraction': 0.1}


def launch(config_file, overrides, n=2, devices_each=4, heartbeat_s=10, logs=None):
  """`n` train.py processes joined by jax.distributed on this machine."""
  port = free_port()
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1',
         'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices_each}{FAST_COMPILE}'}
  flags = [f'--config.{k}={v}' for k, v in overrides.items()]
  processes = []
  for i in range(n):
    dist = [f'--config.distributed.coordinator_address=localhost:{port}',
            f'--config.distributed.num_processes={n}', f'--config.distributed.process_id={i}',
            f'--config.distributed.heartbeat_timeout_s={heartbeat_s}']
    out = open(logs / f'process{i}.txt', 'w')
    processes.append(subprocess.Popen([sys.executable, 'train.py', f'--config={config_file}',
                                       *flags, *dist], cwd=REPO, env=env, stdout=out,
                                      stderr=subprocess.STDOUT))
  return processes


# The shipped generation task, scored at the last step: its prompts' forwards and the KV-cached
# sampler both span the processes (the log-likelihood task's forwards are the prompts' kind).
TASKS = {'lm_eval.tasks': 'stdlib_complete', 'lm_eval.limit': 4,
         'lm_eval.batch_size': 8}


def task_scores(workdir):
  lines = (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()
  return [{k: v for k, v in r.items() if '/' in k}
          for r in map(json.loads, lines) if 'lm_eval_time_s' in r]


def losses(workdir):
  lines = (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()
  return {r['step']: r['loss'] for r in map(json.loads, lines) if 'loss' in r}


@pytest.mark.integration
def test_two_processes_train_as_one_and_their_checkpoint_resumes_on_one(tmp_path):
  def config(workdir, **more):
    c = base.get_config()
    c.update_from_flattened_dict({**default_overrides(workdir), **more})
    return c

  loop.run(config(tmp_path / 'one', **TASKS), tasks=during.TaskScores)  # one process × 8 devices
  reference, reference_scores = losses(tmp_path / 'one'), task_scores(tmp_path / 'one')
  assert len(reference_scores) == 1 and 'stdlib_complete/exact_match' in reference_scores[0]

  processes = launch('configs/base.py', {**default_overrides(tmp_path / 'two'), **TASKS},
                     logs=tmp_path)
  codes = [p.wait(timeout=600) for p in processes]
  logs = [(tmp_path / f'process{i}.txt').read_text() for i in range(2)]
  assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  two = losses(tmp_path / 'two')
  assert sorted(two) == list(range(1, STEPS + 1))
  for step in reference:  # bf16 compute: the reduction order across processes differs slightly
    assert two[step] == pytest.approx(reference[step], rel=2e-4), step
  # Only process 0 logs and writes metrics.
  assert 'step 6/6' in logs[0] and not any(l.startswith('step') for l in logs[1].splitlines())
  # Both processes scored the tasks together (each forward spans both), as one process does.
  [scores] = task_scores(tmp_path / 'two')
  assert scores == pytest.approx(reference_scores[0], rel=1e-3, abs=1e-6)

  # Process 1's part of checkpoint 6 damaged: both processes find it so (each reads its own
  # shards), set it aside once, resume from step 3 and train as before: here with Adam's moments
  # off the devices (training/tiers.py), each process keeping its own shards, in memory and in
  # files (the master weights stay: off the devices, a bf16 copy would train a little otherwise).
  for f in (tmp_path / 'two' / 'checkpoints' / str(STEPS) / 'state').rglob('*'):
    if f.is_file() and 'ocdbt.process_1/d/' in str(f):
      f.write_bytes(f.read_bytes()[:f.stat().st_size // 3])
  nvme = tmp_path / 'nvme'
  tiers = {'optimizer.mu_tier': 'host', 'optimizer.nu_tier': f'nvme:{nvme}'}
  processes = launch('configs/base.py', {**default_overrides(tmp_path / 'two'), **tiers},
                     logs=tmp_path)
  codes = [p.wait(timeout=600) for p in processes]
  logs = [(tmp_path / f'process{i}.txt').read_text() for i in range(2)]
  assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  assert 'resuming from step 3' in logs[0] and f'checkpoints/{STEPS} is damaged' in logs[0]
  assert sorted(p.name for p in (tmp_path / 'two' / 'checkpoints-damaged').iterdir()) == ['6']
  again = losses(tmp_path / 'two')
  assert sorted(again) == list(range(1, STEPS + 1))
  for step in range(4, STEPS + 1):
    assert again[step] == pytest.approx(reference[step], rel=2e-4), step
  assert not nvme.exists() or list(nvme.iterdir()) == []  # the processes' files removed

  # Each process wrote the pieces of its own shards of the moments off the devices, and its
  # share of their checksums (runtime/pieces.py): one process reads them all, intact.
  tiered = tmp_path / 'two' / 'checkpoints' / str(STEPS)
  assert sorted(p.name for p in (tiered / 'pieces').glob('checksums-*')) == [
      'checksums-0.json', 'checksums-1.json']
  with warnings.catch_warnings():
    warnings.simplefilter('error', CheckpointWarning)
    restored = Checkpointer(tiered.parent, read_only=True).restore_latest(
        build(settings.resolve(config(tmp_path / 'two'))).checkpoint_state, base.get_config().model)
  assert restored[0] == STEPS

  # Both processes' data rows went into the checkpoint: one process resumes it exactly.
  shutil.rmtree(tiered)
  loop.run(config(tmp_path / 'two'))
  resumed = losses(tmp_path / 'two')
  for step in range(4, STEPS + 1):
    assert resumed[step] == pytest.approx(reference[step], rel=2e-4), step


@pytest.mark.integration
@pytest.mark.parametrize('victim', [1, 0], ids=['worker-killed', 'coordinator-killed'])
def test_killing_one_process_stops_the_other_within_the_heartbeat_timeout(tmp_path, victim):
  heartbeat_s = 10
  overrides = {'workdir': str(tmp_path / 'run'), 'train_steps': 100_000, 'log_every': 1,
               'eval_every': 0, 'checkpoint_every': 0, 'data.paths': SMALL_CORPUS,
               'data.validation_fraction': 0.1}
  processes = launch('configs/base.py', overrides, heartbeat_s=heartbeat_s, logs=tmp_path)
  log0 = tmp_path / 'process0.txt'
  try:
    deadline = time.monotonic() + 300
    while not re.search(r'^step +3/', log0.read_text(), re.M):
      assert time.monotonic() < deadline and processes[0].poll() is None, log0.read_text()[-3000:]
      time.sleep(0.2)
    processes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = processes[1 - victim]
    code = survivor.wait(timeout=heartbeat_s + 30)  # a hang fails here
    took = time.monotonic() - killed
  finally:
    for p in processes:
      p.kill()
  log = (tmp_path / f'process{1 - victim}.txt').read_text()
  assert code != 0
  assert took < heartbeat_s + 15, took
  # The survivor says why it stopped. Which thread notices first is a race: the collective that
  # loses its peer raises in Python (our line), or the coordination client's poll thread ends the
  # process with JAX's own line (seen in CI when the coordinator was killed).
  ours = f'meshlm: process {1 - victim} of 2 failed'
  jaxs = 'the JAX distributed service detected fatal errors. This most likely indicates that ' \
         'another task died'
  assert ours in log or jaxs in log, log[-3000:]


def test_scheduler_detection_reads_what_jax_reads():
  slurm = {'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_NTASKS': '16',
           'SLURM_PROCID': '3', 'SLURM_LOCALID': '3'}
  assert distributed.scheduler_process_count(slurm) == ('SLURM', 16)
  # sbatch's own shell (no srun step) is not a multi-process job
  assert distributed.scheduler_process_count({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '16'}) is None
  ompi = {'OMPI_MCA_orte_hnp_uri': '1234.0;tcp://10.0.0.1:5000', 'OMPI_COMM_WORLD_SIZE': '4'}
  assert distributed.scheduler_process_count(ompi) == ('Open MPI', 4)
  assert distributed.scheduler_process_count({}) is None


@pytest.mark.parametrize('settings, field', [
    ({'num_processes': 2, 'process_id': 0}, 'coordinator_address'),
    ({'coordinator_address': 'node1', 'num_processes': 2, 'process_id': 0}, 'host:port'),
    ({'coordinator_address': 'node1:1234', 'num_processes': 2, 'process_id': 2}, 'process_id'),
    ({'coordinator_address': 'node1:1234', 'num_processes': 0, 'process_id': 0}, 'num_processes'),
    ({'heartbeat_timeout_s': 0}, 'heartbeat_timeout_s'),
])
def test_bad_distributed_settings_are_named(settings, field):
  c = base.get_config()
  c.distributed.update(settings)
  with pytest.raises(ValueError, match=field):
    loop.run(c)  # raised before jax.distributed or anything else starts


FAKE_SRUN = '''#!/usr/bin/env bash
# srun's stand-in: run the command once per task with the variables srun sets for it.
while [[ $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NODELIST=localhost SLURM_STEP_NUM_NODES=1 "$@" &
  pids+=($!)
done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=1; done
exit $code
'''


@pytest.mark.integration
def test_the_sbatch_script_runs_a_slurm_job(tmp_path):
  """scripts/slurm/train.sbatch under a stand-in srun (two tasks on this machine): its XLA flags
  are accepted by this jaxlib, and JAX finds the job from SLURM's variables."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'srun').write_text(FAKE_SRUN)
  (bin_dir / 'srun').chmod(0o755)
  (bin_dir / 'python').write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this venv's
  (bin_dir / 'python').chmod(0o755)
  env = {**os.environ, 'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'SLURM_JOB_ID': '4242',
         'SLURM_NTASKS': '2', 'SLURM_SUBMIT_DIR': str(REPO), 'JAX_PLATFORMS': 'cpu',
         'JAX_COORDINATOR_PORT': str(free_port()),
         'XLA_FLAGS': f'--xla_force_host_platform_device_count=4{FAST_COMPILE}'}
  result = subprocess.run(
      ['bash', str(REPO / 'scripts/slurm/train.sbatch'), '--config=configs/base.py',
       f'--config.workdir={tmp_path / "run"}', '--config.train_steps=3', '--config.log_every=1',
       '--config.eval_every=0', f'--config.data.paths={SMALL_CORPUS}',
       '--config.data.validation_fraction=0.1'],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert 'on 8 cpu devices' in result.stdout and 'step 3/3' in result.stdout
  assert (tmp_path / 'run' / 'checkpoints' / '3').is_dir()
