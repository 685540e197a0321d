"""After training: lm-eval's tasks on a run's checkpoint (harness.py) or during it (during.py)."""

import pathlib

TASKS_DIR = pathlib.Path(__file__).resolve().parent / 'tasks'  # the tasks meshlm ships
