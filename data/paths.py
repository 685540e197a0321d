"""Directories a run writes to, checked before anything expensive happens (standard library only,
so training/ can use it on machines without the data stack)."""

import os
import pathlib


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
