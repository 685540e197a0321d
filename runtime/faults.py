"""Expected failures: what a user or their machine got wrong, as opposed to a bug in meshlm.

A `Fault` (or a ValueError naming a setting, `config.…` or `--flag`) says in its message which
file or setting is at fault and how to fix it; the entry points (runtime/cli.py) print it as one
line and exit 2. A disk that is full, read-only or not ours is the machine's fault: `on_disk`
turns such an OSError into a Fault naming the file.
"""

import errno
import os
import re


def available_host_memory() -> int:
  """What this machine's memory can still give without swapping (Linux's MemAvailable; else
  its free pages)."""
  try:
    for line in open('/proc/meminfo'):
      if line.startswith('MemAvailable:'):
        return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


class Fault(Exception):
  """An expected failure, its message naming the file or setting and the fix."""


class NonFiniteSteps(Fault, FloatingPointError):
  """config.max_bad_steps steps in a row had a non-finite loss or gradient."""


# What the user can do about each way a disk refuses a write.
DISK_FIXES = {
    errno.ENOSPC: 'free space on that disk, or write somewhere else',
    errno.EDQUOT: 'free space within your quota, or write somewhere else',
    errno.EFBIG: 'raise the file size limit (ulimit -f), or write somewhere else',
    errno.EROFS: 'the file system is read-only: write somewhere else',
    errno.EACCES: 'you may not write there: fix its permissions, or write somewhere else',
    errno.EPERM: 'you may not write there: fix its permissions, or write somewhere else',
}


def on_disk(error: BaseException, where: str | None = None) -> Fault | None:
  """A Fault for an OSError of a refusing disk (found in `error` or its causes, or as the
  errno in the text of a library's error), else None. It names `where` (a setting), else the
  file being written."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    code = error.errno if isinstance(error, OSError) else None
    if found := re.search(r"os_error_code='(\d+)'|os error (\d+)", str(error)):
      code = int(found.group(1) or found.group(2))  # tensorstore's, safetensors'
    elif code is None and (named := [c for c in DISK_FIXES if os.strerror(c) in str(error)]):
      code = named[0]  # array_record's: the C library's words, without the number
    if code in DISK_FIXES:
      filename = getattr(error, 'filename', None)
      where = where or (f'writing {filename}' if filename else 'writing')
      return Fault(f'{where}: {os.strerror(code)}; {DISK_FIXES[code]}')
    error = error.__cause__ or error.__context__
  return None
