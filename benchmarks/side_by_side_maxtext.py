"""MaxText's train step timed on the devices it runs on: the child process of
benchmarks/side_by_side.py, run by a Python that imports MaxText (on a lent GPU, the image's
Python with the unpacked wheels of `scripts/calibrate_on_device.sh wheels` on its path).

  python benchmarks/side_by_side_maxtext.py OUT_DIR STEPS WARMUP PROFILE_CALLS [setting=value …]

Compiles MaxText's step as benchmarks/peers_maxtext.py does (its own code, its config from base.yml
and the settings given), on a mesh of this machine's devices; fills its state and batch with random
values of their shapes and shardings (a step's time does not depend on them: parameters and
optimizer moments small normals, counters zero, tokens random ids, positions 0…L−1, one segment a
row); runs WARMUP steps, then STEPS each waited for. Writes OUT_DIR/hlo.txt.gz (the optimized
program) and OUT_DIR/profile.json (the kernels of PROFILE_CALLS more steps), and prints one JSON
line: the step times, the compiled memory, the device's peak memory, the shapes.
"""

import gzip
import json
import pathlib
import sys
import time

import peers_maxtext  # noqa: E402  (beside this file; it puts the repository on the path)

import profiled  # noqa: E402  (beside this file too: jax and the stdlib only)


def filled(args, shardings, vocab: int):
  """Concrete arrays of the abstract `args`, placed by `shardings`."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  leaves, tree = jax.tree_util.tree_flatten_with_path(args)
  keys = iter(jax.random.split(jax.random.key(0), len(leaves)))

  def make(path, leaf):
    name, key = jax.tree_util.keystr(path), next(keys)
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.split(key, leaf.shape) if leaf.shape else key
    if jnp.issubdtype(leaf.dtype, jnp.integer):
      if 'position' in name:
        return jnp.broadcast_to(jnp.arange(leaf.shape[-1], dtype=leaf.dtype), leaf.shape)
      if 'segmentation' in name:
        return jnp.ones(leaf.shape, leaf.dtype)
      if name.endswith(("['inputs']", "['targets']")):
        return jax.random.randint(key, leaf.shape, 0, vocab, leaf.dtype)
      return jnp.zeros(leaf.shape, leaf.dtype)
    if 'opt_state' in name or 'optimizer' in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    return (0.02 * jax.random.normal(key, leaf.shape, np.float32)).astype(leaf.dtype)

  return jax.device_put(jax.tree_util.tree_unflatten(tree, [make(p, leaf) for p, leaf in leaves]),
                        shardings)


def main(argv) -> None:
  out, steps, warmup, profile_calls = pathlib.Path(argv[1]), *map(int, argv[2:5])
  settings = argv[5:]
  import jax
  config, mesh, compiled, args, shardings, compile_s = peers_maxtext.compile_step(
      settings, jax.devices)
  state, batch = filled(tuple(args), tuple(shardings), config.vocab_size)
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    if i >= warmup:
      times.append(time.perf_counter() - start)

  def step():
    nonlocal state
    state, metrics = compiled(state, batch)
    return metrics
  profile = profiled.kernels(step, profile_calls)
  with gzip.open(out / 'hlo.txt.gz', 'wt') as f:
    f.write(compiled.as_text())
  (out / 'profile.json').write_text(json.dumps(profile))
  m = compiled.memory_analysis()
  stats = jax.devices()[0].memory_stats() or {}
  loss = metrics.get('scalar', {}).get('learning/loss') if isinstance(metrics, dict) else None
  print(json.dumps({'times_s': times, 'compile_s': compile_s, 'jax': jax.__version__,
                    'argument_bytes': m.argument_size_in_bytes,
                    'output_bytes': m.output_size_in_bytes, 'temp_bytes': m.temp_size_in_bytes,
                    'alias_bytes': m.alias_size_in_bytes,
                    'peak_bytes': stats.get('peak_bytes_in_use'),
                    'loss': None if loss is None else float(loss),
                    **peers_maxtext.shapes(config, mesh)}))


if __name__ == '__main__':
  main(sys.argv)
