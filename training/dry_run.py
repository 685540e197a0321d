"""A dry run: the train step compiled for the GPUs planned for (config.plan), its plan reported,
nothing allocated, prepared or trained. `python train.py --config.dry_run=True` enters here.

Where this process cannot compile for those GPUs, a child process that can (the GPU compiler's,
planning/gpu_compiler.py) runs this module's `main` on the config and hands its plan back."""

import json
import pathlib
import sys

import ml_collections

from planning import gpu_compiler
from planning import plan as plan_lib
from training import settings
from training.programs import compile_and_plan
from training.state import build

CHILD = 'training.dry_run'  # the module the GPU compiler's process runs: main()


def plan(config, devices=None, tasks=None) -> dict:
  """Plans `config` (dry_run set) and prints the plan; returns its figures (Plan.as_dict).
  `tasks`: the hook that would score config.lm_eval.tasks (training.loop.train's), whose check
  a dry run makes too."""
  run = settings.resolve(config, devices)  # the tokenizer checked, as training would
  if tasks and run.lm_eval.task_names:
    tasks.check(run)
  if run.target.in_child:  # its settings, for as many GPUs as planned here
    settings_dict = run.replace(plan={'devices': run.target.n_devices}).as_dict()
    return gpu_compiler.plan_in_compiler_process(settings_dict, CHILD)
  _, the_plan = compile_and_plan(build(run))
  plan_lib.report(the_plan)
  return the_plan.as_dict()


def main(argv) -> None:
  """The GPU compiler's child process (gpu_compiler.plan_in_compiler_process): `plan` of a JSON
  config."""
  try:
    plan(ml_collections.ConfigDict(json.loads(pathlib.Path(argv[1]).read_text())))
  except ValueError as e:  # a bad setting (a MeshMismatch too): the parent raises it as one line
    sys.exit(f'ValueError: {e}')


if __name__ == '__main__':
  main(sys.argv)
