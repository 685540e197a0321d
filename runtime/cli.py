"""What the entry points (train.py, sample.py, benchmarks/) share as programs: absl's app.run,
where a mistake in the settings ends the program with one line naming it and exit status 2, not a
traceback, and where libraries log warnings and errors only (orbax logs every save at INFO)
unless --verbosity asks for more.

Mistakes in the settings are: a flag that does not exist or does not parse; a config file that is
missing, does not import, or has no get_config; an override of a setting the config does not have;
and any ValueError that names a setting (`config.…` or `--flag`), which is how meshlm reports
bad settings. Any other error keeps its traceback: it is a bug or a failure, not a setting.
"""

import re
import sys

from absl import app, flags
from absl import logging as absl_logging

EXIT_BAD_SETTINGS = 2


def run(main, log_level: int = absl_logging.WARNING) -> None:
  """app.run(main), with bad settings reported as above and absl's logs from `log_level` up."""
  def quiet_then_main(argv):
    if not flags.FLAGS['verbosity'].present:
      absl_logging.set_verbosity(log_level)
    return _reported(main, argv)
  app.run(quiet_then_main, flags_parser=_parse)


def fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(EXIT_BAD_SETTINGS)


def names_a_setting(message: str) -> bool:
  return bool(re.search(r'config\.\w|--\w', message))


def _parse(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if required := re.search(r'Flag (--\w+) must have a value other than None', str(e)):
      fail(f'{required.group(1)} is required ({flags.FLAGS[required.group(1)[2:]].help})')
    # A config file's own error arrives as the text of its traceback: keep the last line.
    fail(str(e).strip().splitlines()[-1] if 'Traceback' in str(e) else str(e))
  except (AttributeError, KeyError, SyntaxError, ImportError) as e:
    fail(_config_message(argv, e))


def _reported(main, argv):
  try:
    return main(argv)
  except app.UsageError as e:
    fail(str(e))
  except ValueError as e:
    if not names_a_setting(str(e)):
      raise
    fail(str(e))
  except OSError as e:  # ml_collections reports a config file it could not load at first use
    if 'Failed loading config file' not in str(e):
      raise
    fail(_config_message(sys.argv, e))


def _config_message(argv, error: BaseException) -> str:
  """One line for a config file or override that ml_collections could not use."""
  config_flag = next((a for a in argv[1:] if a.startswith('--config=')), '--config')
  text = str(error)
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
