"""One run per workdir, held by an OS lock that dies with its process; nothing is created in a
workdir before the settings are known to be good."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from runtime import workdir as workdir_lib
from tests.conftest import SMALL_CORPUS, tiny_config
from training import loop

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, 'PYTHONUNBUFFERED': '1'}


def command(workdir):
  return [sys.executable, 'train.py', '--config=configs/base.py', f'--config.workdir={workdir}',
          f'--config.data.paths={SMALL_CORPUS}', '--config.data.validation_fraction=0.1']


def read_until(process, prefix):
  seen = []
  for line in process.stdout:
    if line.startswith(prefix):
      return line
    seen.append(line)
  raise AssertionError(f'the process ended before printing {prefix!r}:\n{"".join(seen[-80:])}')

# A holder that is only the hold: a live training run holding it is the fault probe's case
# ('workdir: held by a live run'), which trains first.
HOLDER = ('import pathlib, sys, time; from runtime import workdir\n'
          'with workdir.hold(pathlib.Path(sys.argv[1])):\n'
          '  print("held", flush=True); time.sleep(600)')


def test_a_second_run_on_a_live_workdir_stops_at_once_naming_the_holder(tmp_path):
  first = subprocess.Popen([sys.executable, '-c', HOLDER, str(tmp_path)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
  try:
    read_until(first, 'held')
    t0 = time.perf_counter()
    second = subprocess.run(command(tmp_path), cwd=REPO, capture_output=True, text=True,
                            timeout=300, env=ENV)
    assert second.returncode == 2, second.stderr[-3000:]
    assert time.perf_counter() - t0 < 60  # refused before compiling, not after training
    assert f'pid {first.pid} on ' in second.stderr and str(tmp_path) in second.stderr
    assert 'Traceback' not in second.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [workdir_lib.LOCK_FILE]  # nothing made
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
  with workdir_lib.hold(tmp_path):  # the killed holder left no stale lock
    pass


def test_a_held_workdir_is_refused_in_the_same_process_too(tmp_path):
  """A notebook that starts a second run while its first holds the workdir."""
  with workdir_lib.hold(tmp_path):
    with pytest.raises(ValueError, match=r"config.workdir=.* is in use by another run \(pid "):
      with workdir_lib.hold(tmp_path):
        pass
  with workdir_lib.hold(tmp_path):  # released with the first
    pass


def test_a_held_workdir_is_told_before_its_checkpoints_are_read(tmp_path):
  """check_free, asked before a run reads the workdir's checkpoints (which the holder may be
  writing): the holder named while it holds, nothing said or created otherwise."""
  workdir_lib.check_free(str(tmp_path / 'new'))
  assert not (tmp_path / 'new').exists()
  with workdir_lib.hold(tmp_path):
    with pytest.raises(ValueError, match=r"config.workdir=.* is in use by another run \(pid "):
      workdir_lib.check_free(str(tmp_path))
    workdir_lib.check_free(str(tmp_path), enabled=False)  # a job's other processes
  workdir_lib.check_free(str(tmp_path))


def test_bad_data_paths_fail_before_the_workdir_is_created(tmp_path):
  config = tiny_config(fsdp=8)
  config.workdir, config.data.paths = str(tmp_path / 'run'), str(tmp_path / 'no-such-corpus')
  with pytest.raises(ValueError, match='config.data.paths: .* does not exist'):
    loop.run(config)
  assert not (tmp_path / 'run').exists()
