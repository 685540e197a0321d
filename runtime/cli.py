"""What the entry points (train.py, sample.py, export.py, data.train_tokenizer, benchmarks/) share
as programs: absl's app.run, where an expected failure ends the program with one line naming the
file or setting and the fix, and exit status 2, not a traceback; where SIGTERM outside training
ends it with one line too, and Ctrl-C anywhere (the second one, in training) by SIGINT at once; and
where libraries log warnings and errors only (orbax logs every save at INFO) unless --verbosity
asks for more.

Expected failures are: a flag that does not exist or does not parse; a config file that is
missing, does not parse or import, raises, or has no get_config; an override of a setting the
config does not have; a `faults.Fault`; a ValueError that names a setting (`config.…` or
`--flag`), which is how meshlm reports bad settings; and a disk that is full, read-only or not
ours (`faults.on_disk`). Any other error keeps its traceback: it is a bug, not a setting.
"""

import os
import re
import signal
import sys
import traceback
import warnings

from absl import app, flags
from absl import logging as absl_logging

from runtime import faults

EXIT_BAD_SETTINGS = 2


def run(main, log_level: int = absl_logging.WARNING) -> None:
  """app.run(main), with bad settings reported as above and absl's logs from `log_level` up."""
  def quiet_then_main(argv):
    if not flags.FLAGS['verbosity'].present:
      absl_logging.set_verbosity(log_level)
    warnings.formatwarning = _one_line
    sys.unraisablehook = _without_closed_loops(sys.unraisablehook)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # training installs its own
      signal.signal(signal.SIGTERM, _terminated)
    try:
      try:
        result = _reported(main, argv)
      finally:
        _close_checkpoints()
    except KeyboardInterrupt:
      _interrupted()
    if _TERMINATED:  # the handler's SystemExit was swallowed where it ran (a finalizer's frame)
      sys.exit(128 + _TERMINATED[0])
    return result
  app.run(quiet_then_main, flags_parser=_parse)


def _interrupted() -> None:
  """Ctrl-C (or training's second SIGINT, runtime/preemption.py) has unwound the program: every
  file being written was closed or removed on the way, and orbax's saves were waited for. End by
  SIGINT now, as an interrupted program does, with one line and without the interpreter's
  teardown, where native threads still running (XLA's, tensorstore's) can abort the process
  ('terminate called without an active exception') and bury the line under a fatal error."""
  print(f'{os.path.basename(sys.argv[0])}: stopped by SIGINT', file=sys.stderr, flush=True)
  sys.stdout.flush()
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  os.kill(os.getpid(), signal.SIGINT)


def _close_checkpoints() -> None:
  """orbax's threads, stopped before the interpreter is (else they print their own traceback)."""
  if checkpoint := sys.modules.get('runtime.checkpoint'):  # never imported here for its own sake
    checkpoint.close_all()


def fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(EXIT_BAD_SETTINGS)


def _one_line(message, category, filename, lineno, line=None) -> str:
  """A warning as the user reads it: one line, without the source line that raised it."""
  return f'warning: {" ".join(str(message).split())}\n'


def _without_closed_loops(unraisablehook):
  """tensorstore's writes still in flight when orbax closes its event loop after a failed save
  print 'Event loop is closed' each: the save's failure is reported once, by the Checkpointer."""
  def hook(unraisable):
    if not (unraisable.exc_type is RuntimeError and
            str(unraisable.exc_value) == 'Event loop is closed'):
      unraisablehook(unraisable)
  return hook


_TERMINATED = []  # the SIGTERM received, which the program's exit status must say


def _terminated(signum, frame):
  if not _TERMINATED:
    print(f'{os.path.basename(sys.argv[0])}: stopped by SIGTERM', file=sys.stderr, flush=True)
  _TERMINATED.append(signum)
  # SystemExit unwinds: files being written are removed by their owners. Python runs a handler
  # wherever the main thread next runs bytecode, which may be a finalizer that swallows it: then
  # `run` ends the program with the same status once main returns.
  sys.exit(128 + signum)


def names_a_setting(message: str) -> bool:
  return bool(re.search(r'config\.\w|--\w', message))


def _parse(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if required := re.search(r'Flag (--\w+) must have a value other than None', str(e)):
      fail(f'{required.group(1)} is required ({flags.FLAGS[required.group(1)[2:]].help})')
    if 'Traceback' in str(e):  # a config file's own error, as the text of its traceback
      fail(_config_message(argv, e))
    fail(str(e))
  except Exception as e:  # loading the config file, or applying an override to it
    fail(_config_message(argv, e))


def _reported(main, argv):
  try:
    return main(argv)
  except (app.UsageError, faults.Fault) as e:
    fail(str(e))
  except ValueError as e:
    if not names_a_setting(str(e)):
      raise
    fail(str(e))
  except OSError as e:
    if 'Failed loading config file' in str(e):  # ml_collections loads a config at first use
      fail(_config_message(sys.argv, e))
    if not (fault := faults.on_disk(e)):
      raise
    fail(str(fault))


def _config_message(argv, error: BaseException) -> str:
  """One line for a config file or override that ml_collections could not use."""
  config_flag = next((a for a in argv[1:] if a.startswith('--config=')), '--config')
  text = str(error)
  if raised := _raised_in_config_file(config_flag, error):
    return raised
  if isinstance(error, (AttributeError, KeyError)) and (key := re.match(r"\W*'?([\w.]+)", text)) \
      and 'get_config' not in text:  # an override of a setting the config does not have
    key = key.group(1).strip("'\\")
    given = next((a.split('=')[0] for a in argv[1:]
                  if re.match(rf'--config\.([\w]+\.)*{re.escape(key)}(=|$)', a)), f'--config.{key}')
    hint = re.search(r'Did you mean "([\w.]+)"', text)
    return (f'{given}: the config has no setting {key!r}'
            f'{f"; did you mean {hint.group(1)}?" if hint else ""} (configs/base.py lists every '
            'setting)')
  if isinstance(error, SyntaxError):
    return f'{config_flag}: the config file does not parse: {error.msg} (line {error.lineno})'
  if 'get_config' in text:
    return (f'{config_flag}: the config file has no get_config(); it must define one that '
            'returns the config (see configs/base.py)')
  if 'No such file' in text:
    return f'{config_flag}: no such config file'
  return f'{config_flag}: the config file does not load ({type(error).__name__}: {text})'


def _raised_in_config_file(config_flag: str, error: BaseException) -> str | None:
  """'--config=F: the config file raises …' if the error comes from the config file's own code
  (a typo in it is the file's, not an override the user never gave), else None."""
  path = config_flag.partition('=')[2].split(':')[0]
  if not path:
    return None
  path = os.path.realpath(path)
  frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(error.__traceback__)]
  frames += [(f, int(n), name) for f, n, name in  # absl hands some over as a traceback's text
             re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(error))]
  ours = [frame for frame in frames if os.path.realpath(frame[0]) == path]
  if not ours:
    return None
  _, line, function = ours[-1]
  last = (str(error).strip().splitlines()[-1] if 'Traceback' in str(error) else
          f'{type(error).__name__}: {error}')
  if '\\n' in last:  # ConfigDict's KeyError: the repr of a message with a hint
    last = re.sub(r"^(\w+): '(.*)'$", r'\1: \2', last.replace('\\n', '; ').replace("\\'", "'"))
  if last.startswith('ValueError: '):  # raised on purpose, naming the fix (a preset unknown)
    return f'{config_flag}: {last.removeprefix("ValueError: ")}'
  where = 'at import' if function == '<module>' else f'in {function}()'
  return f'{config_flag}: the config file raises {last} (line {line}, {where}); fix the file'
