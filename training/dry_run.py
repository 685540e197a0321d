"""A dry run: the train step compiled for the GPUs planned for (config.plan), its plan reported,
nothing allocated, prepared or trained. `python train.py --config.dry_run=True` enters here.

Where this process cannot compile for those GPUs, a child process that can (the GPU compiler's,
planning/gpu_compiler.py) runs this module's `main` on the config and hands its plan back."""

import json
import pathlib
import sys

import jax
import ml_collections

from planning import gpu_compiler
from planning import plan as plan_lib
from runtime import distributed
from training import layout, settings
from training.programs import compile_and_plan
from training.state import build

CHILD = 'training.dry_run'  # the module the GPU compiler's process runs: main()


def plan(config, devices=None) -> dict:
  """Plans `config` (dry_run set) and prints the plan; returns its figures (Plan.as_dict)."""
  distributed.initialize(config.distributed)
  devices = jax.devices() if devices is None else list(devices)
  config, target = settings.resolve(config, devices)  # the tokenizer checked, as training would
  if target.in_child:
    return gpu_compiler.plan_in_compiler_process(target.for_child(config), CHILD)
  if config.mesh.auto:
    config, _ = layout.choose(config, target,
                              log=print if jax.process_index() == 0 else lambda *a: None)
  _, the_plan = compile_and_plan(build(config, target.devices), config, target)
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
