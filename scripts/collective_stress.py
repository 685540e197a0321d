"""XLA's CPU collectives between 8 simulated devices under stress (docs/testing.md).

  python scripts/collective_stress.py                    # XLA's default threads: aborts
  PJRT_NPROC=128 python scripts/collective_stress.py     # 16 threads a device: finishes

Each step runs six matmuls, each followed by three independent collectives (a psum, an
all-gather and an all-to-all), so many collectives are ready at once. Prints the steps done, or
XLA aborts the process after 40 s ("Termination timeout for …").
"""

import os
import sys
import time

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def body(a_RD, w_DD):
  outs = []
  for i in range(6):
    y_RD = jnp.tanh(a_RD @ w_DD + i)
    outs += [jax.lax.psum(y_RD.sum(0), 'x'), jax.lax.all_gather(y_RD[:4], 'x'),
             jax.lax.all_to_all(y_RD[:64], 'x', 0, 0, tiled=True)]
  return sum(o.sum() for o in outs)[None]


def main(steps: int = 2000):
  mesh = jax.make_mesh((8,), ('x',))
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P('x'), P()), out_specs=P('x')))
  a = jax.device_put(jnp.ones((8 * 256, 256)), NamedSharding(mesh, P('x')))
  w = jax.device_put(jnp.full((256, 256), 0.01), NamedSharding(mesh, P()))
  start = time.time()
  for i in range(steps):
    out = step(a, w)
    if i % 250 == 0:
      out.block_until_ready()
      print(f'step {i} at {time.time() - start:.1f} s', flush=True)
  out.block_until_ready()
  print(f'finished {steps} steps in {time.time() - start:.1f} s '
        f'(PJRT_NPROC={os.environ.get("PJRT_NPROC", "XLA default")})')


if __name__ == '__main__':
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
