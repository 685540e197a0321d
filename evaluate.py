"""Evaluate a run's checkpoint on lm-evaluation-harness tasks (evaluation/harness.py).

  python evaluate.py --workdir=/tmp/meshlm-default --tasks=stdlib_next_line,stdlib_complete
  python evaluate.py --workdir=/tmp/meshlm-default --step=100 --tasks=stdlib_next_line --limit=50

Two tasks ship with meshlm (evaluation/tasks/, built from the stdlib's source: no download):
stdlib_next_line (which of four lines comes next: acc, acc_norm) and stdlib_complete (complete a
line, greedy: exact_match). Any other lm-eval task runs where its data can be read: a task of
lm-eval's own by name once its dataset is in the Hugging Face cache, or a task directory of your
own with --include_path (docs/evaluation.md). Prints lm-eval's table, and ends with one JSON line:
each task's metrics, the checkpoint and the command; --output also writes lm-eval's whole result
(every setting, and with --log_samples each example's answers) there.
"""

import json
import pathlib
import shlex
import sys

from absl import app, flags

from evaluation import task_manager
from runtime import cli
from runtime.workdir import write_whole

_WORKDIR = flags.DEFINE_string('workdir', None, "A run's workdir, checkpoints/ or "
                               'checkpoints/STEP.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint step; default: the newest.')
_TASKS = flags.DEFINE_list('tasks', None, 'lm-eval task or group names.', required=True)
_INCLUDE_PATH = flags.DEFINE_list('include_path', [], 'More directories of lm-eval task YAMLs '
                                  '(evaluation/tasks/ is always included).')
_LIMIT = flags.DEFINE_float('limit', 0, 'Examples a task at most (a fraction below 1); 0: all.')
_NUM_FEWSHOT = flags.DEFINE_integer('num_fewshot', None, "Examples in each prompt; default: the "
                                    "task's own.")
_BATCH_SIZE = flags.DEFINE_integer('batch_size', 16, 'Rows a forward.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of sampled generations and few-shot draws.')
_OUTPUT = flags.DEFINE_string('output', None, "A JSON file for lm-eval's whole result; an "
                              'existing file is refused.')
_LOG_SAMPLES = flags.DEFINE_bool('log_samples', False, "With --output: each example's prompt "
                                 'and answers too.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not _TASKS.value or '' in _TASKS.value:
    raise ValueError(f'--tasks={",".join(_TASKS.value)!r} names no task; give lm-eval task '
                     'names, e.g. --tasks=stdlib_next_line,stdlib_complete')
  if _BATCH_SIZE.value < 1 or not 0 <= _LIMIT.value:
    raise ValueError(f'--batch_size={_BATCH_SIZE.value} must be at least 1 and '
                     f'--limit={_LIMIT.value:g} at least 0 (0: every example)')
  if _NUM_FEWSHOT.value is not None and _NUM_FEWSHOT.value < 0:
    raise ValueError(f'--num_fewshot={_NUM_FEWSHOT.value} must be at least 0 (leave it out: each '
                     "task's own)")
  include_paths = [str(pathlib.Path(path).expanduser()) for path in _INCLUDE_PATH.value]
  if missing := [path for path in include_paths if not pathlib.Path(path).is_dir()]:
    raise ValueError(f'--include_path: {", ".join(missing)} is not a directory (of lm-eval task '
                     'YAMLs); give one that exists')
  output = pathlib.Path(_OUTPUT.value) if _OUTPUT.value else None
  if output and output.exists():
    raise ValueError(f'--output={output} exists; name a new file (nothing is overwritten)')
  if output and not output.parent.is_dir():
    raise ValueError(f'--output={output}: its directory {output.parent} does not exist')
  if _LOG_SAMPLES.value and not output:
    raise ValueError('--log_samples needs --output=FILE to write them to')
  import lm_eval  # the harness and its dependencies load only once the flags are good
  from evaluation.harness import MeshLM, metrics
  from inference import sampling
  tasks = task_manager(tuple(_TASKS.value), tuple(include_paths))
  if unknown := [t for t in _TASKS.value if t not in tasks.all_tasks]:
    raise ValueError(f'--tasks: no lm-eval task named {", ".join(unknown)} (meshlm ships '
                     f'stdlib_next_line and stdlib_complete; a directory of your own: '
                     f'--include_path)')
  model = MeshLM(loaded=sampling.load(_WORKDIR.value, _STEP.value), batch_size=_BATCH_SIZE.value,
                 seed=_SEED.value)
  print(f'# {model.loaded.checkpoint}: {", ".join(_TASKS.value)}', flush=True)
  results = lm_eval.simple_evaluate(
      model=model, tasks=_TASKS.value, task_manager=tasks, num_fewshot=_NUM_FEWSHOT.value,
      limit=_LIMIT.value or None, log_samples=_LOG_SAMPLES.value, random_seed=_SEED.value,
      numpy_random_seed=_SEED.value, fewshot_random_seed=_SEED.value)
  print(lm_eval.utils.make_table(results))
  command = ' '.join(['python', *map(shlex.quote, sys.argv)])
  if output:
    write_whole(output, json.dumps({**results, 'checkpoint': model.loaded.checkpoint,
                                    'command': command}, indent=2, default=str) + '\n')
  print(json.dumps({'checkpoint': model.loaded.checkpoint, 'results': metrics(results),
                    'command': command}))


if __name__ == '__main__':
  cli.run(main)
