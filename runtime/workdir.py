"""A run's workdir: created and proven writable before anything expensive happens, and held by
one run at a time; `writable_dir` proves any directory a run writes (the prepared data's too).

The hold is an exclusive OS lock (flock) on WORKDIR/.meshlm-lock, taken by process 0 for the
whole run. The kernel drops it when the process ends, however it ends (SIGKILL included), so a
lock is never stale. The file names the holder (pid, host, start time) for the error that a second
run or notebook on the same workdir stops with, before it compiles or writes anything.
"""

import contextlib
import fcntl
import os
import pathlib
import socket
import time

from runtime import faults

LOCK_FILE = '.meshlm-lock'


def writable_dir(path: str, setting: str) -> pathlib.Path:
  """Create `path` and prove it is writable, before anything expensive is done; the error names
  the setting to change."""
  directory = pathlib.Path(path).expanduser()
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f'.write-test-{os.getpid()}'
    probe.write_text('ok')
    probe.unlink()
  except OSError as e:
    raise ValueError(f'{setting}={path!r} is not a writable directory ({e}); pass '
                     f'--{setting}=DIR with a directory you can write') from None
  return directory


def prepare(workdir: str) -> pathlib.Path:
  """Create the workdir and prove it is writable, before anything expensive happens. An empty
  one is refused: it would be the current directory, and a run's files would land among the
  user's (settings.check_start says so first)."""
  if not workdir.strip():
    raise ValueError(EMPTY)
  return writable_dir(workdir, 'config.workdir')


EMPTY = ('config.workdir is empty; give the run a directory of its own for its checkpoints and '
         'metrics, e.g. --config.workdir=/tmp/meshlm-run')


def write_whole(path: pathlib.Path, text: str) -> None:
  """`text` into `path`, whole or not at all (a partial file renamed); a full or read-only disk is
  a Fault naming the file."""
  partial = path.with_name(f'.{path.name}.partial-{os.getpid()}')
  try:
    partial.write_text(text)
    partial.replace(path)
  except OSError as e:
    partial.unlink(missing_ok=True)
    raise faults.on_disk(e, where=f'config.workdir: writing {path}') or faults.Fault(
        f'config.workdir: writing {path} failed ({e})') from None


def _held(workdir: pathlib.Path, f) -> ValueError:
  f.seek(0)
  holder = f.read().strip() or 'a process that has not written its name yet'
  return ValueError(f'config.workdir={str(workdir)!r} is in use by another run ({holder}); '
                    'wait for it to end or stop it, or give this run another --config.workdir')


def check_free(workdir: str, enabled: bool = True) -> None:
  """ValueError naming the run that holds `workdir`, if one does; creates nothing. Asked before a
  run reads the workdir's checkpoints, which a live holder may be writing (process 0 of a job:
  another's would find its own job's process 0 holding it)."""
  path = pathlib.Path(workdir).expanduser() / LOCK_FILE
  if not enabled or not path.is_file():
    return
  with path.open('r') as f:
    try:
      fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held by another run
      raise _held(pathlib.Path(workdir), f) from None
    fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def hold(workdir: pathlib.Path, enabled: bool = True):
  """Holds `workdir` for the duration (process 0 of a job; the others pass enabled=False), or
  raises ValueError naming the run that holds it."""
  if not enabled:
    yield
    return
  path = workdir / LOCK_FILE
  with path.open('a+') as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by another run
      raise _held(workdir, f) from None
    f.seek(0)
    f.truncate()
    f.write(f'pid {os.getpid()} on {socket.gethostname()}, since '
            f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n')
    f.flush()
    try:
      yield
    finally:
      f.seek(0)
      f.truncate()  # nobody holds it now
      fcntl.flock(f, fcntl.LOCK_UN)
