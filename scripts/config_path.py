"""Where the raw config goes: every call, from `training.loop.run` down, that is handed a config
(an ml-collections ConfigDict: the whole config or a section of it), counted by module.

  python scripts/config_path.py              # a short run of configs/base.py on this machine
  python scripts/config_path.py --dry_run    # the dry run's path instead

A *visit* is a call into a module other than the caller's with a config among its arguments; a
*climb* is such a call into a package on a higher floor than the caller's (DEVELOPERS.md), which
only a function handed down as an argument can make. Below the entry points, modules should take
the resolved settings they need, not the config to look things up again. Prints a table of
visits by module, then one JSON line.
"""

import collections
import json
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.test_structure import FLOOR  # noqa: E402  (the floors the structure test holds)


def module_of(frame) -> str | None:
  """The repository module a frame runs in ('training.loop'), or None for a library's."""
  try:
    path = pathlib.Path(frame.f_code.co_filename).resolve().relative_to(REPO)
  except ValueError:
    return None
  if path.suffix != '.py' or path.parts[0] not in FLOOR:
    return None
  return '.'.join(path.with_suffix('').parts)


def trace(run) -> tuple[list, list]:
  """(visits, climbs) while `run()` runs: (caller module, callee module, function) each."""
  import ml_collections
  visits, climbs = [], []

  def profile(frame, event, _):
    if event != 'call':
      return
    callee, caller = module_of(frame), module_of(frame.f_back) if frame.f_back else None
    if callee is None or caller is None or callee == caller:
      return
    code = frame.f_code
    arguments = [frame.f_locals.get(name) for name in
                 code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
    if any(isinstance(a, ml_collections.ConfigDict) for a in arguments):
      visit = (caller, callee, code.co_name)
      visits.append(visit)
      if FLOOR[callee.split('.')[0]] > FLOOR[caller.split('.')[0]]:
        climbs.append(visit)

  sys.setprofile(profile)
  try:
    run()
  finally:
    sys.setprofile(None)
  return visits, climbs


def main(argv) -> None:
  from configs import base
  from training import dry_run, loop
  config = base.get_config()
  config.train_steps, config.eval_every, config.eval_batches = 2, 2, 1
  config.dry_run = '--dry_run' in argv
  with tempfile.TemporaryDirectory(prefix='meshlm-config-path-') as workdir:
    config.workdir = workdir
    visits, climbs = trace(lambda: (dry_run.plan if config.dry_run else loop.run)(config))
  by_module = collections.Counter(callee for _, callee, _ in visits)
  print(f'{"module":<28}{"visits":>7}  functions')
  for module, count in by_module.most_common():
    names = sorted({name for _, callee, name in visits if callee == module})
    print(f'{module:<28}{count:>7}  {", ".join(names)}')
  for caller, callee, name in climbs:
    print(f'climb: {caller} → {callee}.{name}')
  print(json.dumps({'visits': len(visits), 'modules': len(by_module), 'climbs': len(climbs),
                    'dry_run': config.dry_run}))


if __name__ == '__main__':
  main(sys.argv)
