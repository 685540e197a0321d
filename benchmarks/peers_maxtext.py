"""MaxText's train step compiled for compile-only GPUs: the child process of benchmarks/peers.py,
run by the Python of MaxText's own environment (which has no meshlm on its path), with the GPU
compiler of planning/gpu_compiler.py on it.

  python benchmarks/peers_maxtext.py OUT_DIR GPUS [MaxText setting=value ...]

MaxText's own ahead-of-time entry (maxtext.trainers.pre_train.train_compile) builds its mesh from
`jax.devices()` when the target is a GPU, which needs GPUs; here the mesh is made of compile-only
H100s (planning/gpu_compiler.devices), and the rest are MaxText's own steps in train_compile.main's
order: its config (base.yml and the settings given), its abstract state and shardings, its
`train.train_step` jitted and compiled. Writes OUT_DIR/hlo.txt.gz, the optimized program, and prints
the compiled memory figures as one JSON line.
"""

import gzip
import json
import os
import pathlib
import sys
import time

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # planning/, after MaxText's

from planning import gpu_compiler, gpus  # noqa: E402  (stdlib-only modules)


def compile_step(settings: list[str], devices):
  """(MaxText's config, mesh, compiled train step, its abstract arguments and their shardings,
  seconds to compile) for `settings` on the devices `devices()` gives (made after MaxText's
  config, as in its own order), by MaxText's own steps in train_compile.main's order."""
  import jax
  from flax.core.spmd import logical_axis_rules
  from jax.sharding import AxisType, Mesh
  import maxtext
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train, train_compile
  from maxtext.utils import maxtext_utils, sharding

  config = pyconfig.initialize(
      [None, os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'), *settings])
  jax.config.update('jax_remove_size_one_mesh_axis_from_type',
                    config.remove_size_one_mesh_axis_from_type)
  mesh = Mesh(maxtext_utils.create_device_mesh(config, devices()), config.mesh_axes,
              axis_types=(AxisType.Auto,) * len(config.mesh_axes))
  start = time.perf_counter()
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
  param_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
      config, state_shardings)
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings,
                                                                    param_shardings)
  step, in_shardings, out_shardings, static, donate = (
      maxtext_utils.get_functional_train_with_signature(
          train.train_step, sharding.get_input_data_sharding(config, mesh), input_shardings,
          model, config, param_shardings))
  compiled = train_compile.jit_and_compile(step, args, kwargs, mesh, in_shardings, out_shardings,
                                           static, donate, config,
                                           logical_axis_rules(config.logical_axis_rules))
  return config, mesh, compiled, args, in_shardings, time.perf_counter() - start


def shapes(config, mesh) -> dict:
  """The work a compiled step does, to hold against meshlm's."""
  return {'mesh': {k: v for k, v in mesh.shape.items() if v > 1},
          'batch_size': config.global_batch_size_to_train_on,
          'microbatches': config.gradient_accumulation_steps,
          'seq_len': config.max_target_length}


def main(argv) -> None:
  out, n, settings = pathlib.Path(argv[1]), int(argv[2]), argv[3:]
  import jax
  config, mesh, compiled, _, _, seconds = compile_step(
      settings, lambda: gpu_compiler.devices(gpus.get('H100'), n))
  with gzip.open(out / 'hlo.txt.gz', 'wt') as f:
    f.write(compiled.as_text())
  m = compiled.memory_analysis()
  print(json.dumps({'argument_bytes': m.argument_size_in_bytes,
                    'output_bytes': m.output_size_in_bytes, 'temp_bytes': m.temp_size_in_bytes,
                    'alias_bytes': m.alias_size_in_bytes, 'compile_s': seconds,
                    'jax': jax.__version__, **shapes(config, mesh)}))


if __name__ == '__main__':
  main(sys.argv)
