"""The embedding lookup's backward (model/embedding.py): sharded, either way of moving the sums
gives one device's gradient, in the table's own sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from model.embedding import lookup
from sharding import collectives
from tests.conftest import tiny_config

D = 16


def table_grad(rules=()):
  def f(table_VD, tokens_BL, r_BLD):
    with nnx.logical_axis_rules(rules):
      return jnp.sum(lookup(table_VD, table_VD, tokens_BL) * r_BLD)
  return jax.grad(f)


# 4 tokens a device against 40 rows: the exchange; 32 tokens a device against 4 rows (of 8 split
# over tensor): the reduce-scatter.
@pytest.mark.parametrize('V,B,L,op', [(40, 4, 8, 'all-to-all'), (8, 16, 16, 'reduce-scatter')])
def test_sharded_table_gradient_equals_one_devices(V, B, L, op):
  keys = jax.random.split(jax.random.key(0), 3)
  table_VD = jax.random.normal(keys[0], (V, D), jnp.float32)
  tokens_BL = jax.random.randint(keys[1], (B, L), 0, V // 2)  # repeated rows, some never used
  r_BLD = jax.random.normal(keys[2], (B, L, D), jnp.float32)
  expected = table_grad()(table_VD, tokens_BL, r_BLD)
  mesh = sharding.make_mesh(tiny_config(fsdp=2, sequence=2, tensor=2).mesh)
  with jax.set_mesh(mesh):
    put = lambda a, *names: jax.device_put(a, jax.NamedSharding(mesh, jax.P(*names)))
    args = (put(table_VD, 'tensor', ('fsdp', 'sequence')), put(tokens_BL, 'fsdp', 'sequence'),
            put(r_BLD, 'fsdp', 'sequence'))
    f = jax.jit(table_grad(sharding.ACTIVATION_RULES))
    got = f(*args)
    hlo = f.lower(*args).compile().as_text()
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)  # sums in another order
  assert got.sharding.spec == jax.P('tensor', ('fsdp', 'sequence'))
  # The gradient's sums move one way only, and no device gathers all the tokens' gradients.
  ops = {c.op: c for c in collectives.executed(hlo) if c.op != 'all-reduce'}
  assert op in ops and {'all-to-all', 'reduce-scatter'} - {op} - set(ops)
  assert all(dtype == 's32' for c in ops.values() if c.op == 'all-gather'
             for dtype, _ in c.arrays), ops
