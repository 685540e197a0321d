"""After training: lm-eval's tasks on a run's checkpoint (harness.py) or during it (during.py)."""

import functools
import pathlib

TASKS_DIR = pathlib.Path(__file__).resolve().parent / 'tasks'  # the tasks meshlm ships


@functools.cache
def task_manager(names: tuple[str, ...], include_paths: tuple[str, ...] = ()):
  """lm-eval's TaskManager over meshlm's tasks and `include_paths`, which knows `names` if any
  does. lm-eval's own tasks (thousands of YAMLs: some 6 s to index) are indexed only when a name
  is not among those."""
  from lm_eval.tasks import TaskManager  # the harness loads only when tasks are asked for
  paths = [str(TASKS_DIR), *include_paths]
  manager = TaskManager(include_path=paths, include_defaults=False)
  if all(name in manager.all_tasks for name in names):
    return manager
  return TaskManager(include_path=paths)
