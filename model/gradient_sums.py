"""The layer scan whose backward adds each layer's gradient to running sums, so that no stack of
one microbatch's gradients is ever held whole.

Over microbatches a step sums the gradients of the stacked weights. Autodiff through `lax.scan`
makes each microbatch's gradients of the whole stack first, one layer's slice an iteration of the
backward scan, and only then adds them to the sums: a buffer as large as the stack's trained
parameters (the 70b over 8 GPUs: 16 GiB of bf16 a GPU) beside the sums. Here the backward is our
own reverse scan with the sums in its carry, each layer's gradient added to its slice in place as
it is made (the same additions, in the same dtypes: sums + gradient).

The forward is the plain scan, each layer under `jax.vjp`: what the layer's remat policy saves
is kept per layer, as autodiff through the scan keeps it, except what is an input of the layer
(its weights' slices, the positions), which the backward reads from the stack itself rather than
from a copy. The gradient of `sums` is the new sums; the stacked weights get none of their own.

Unrolled, the sums can be one buffer a layer rather than a stack: a layer's gradient added to a
stack's slice is made as a copy of the slice and a write back into the stack (XLA does not fuse
the add into the in-place update when the gradient comes from a reduce-scatter), where added to a
buffer of its own it is one elementwise add, in place.
"""

import jax
import jax.numpy as jnp

from sharding.layouts import row_major


def scan(step, layers, sums, x, extras, unroll=1):
  """lax.scan of `step(x, layer, extras)` → (x, out) over the stacked `layers`, returning
  (x, outs): as `jax.lax.scan(lambda x, layer: step(x, layer, extras), x, layers)`. `sums`: the
  running gradient sums of the layers' trained parameters, a pytree whose leaves are those of
  `layers` at the same paths (the rest of `layers` is not trained); or, with `unroll=True`, a
  list of one such tree a layer, each leaf one layer's. Differentiated, the gradient of `sums` is
  sums + the gradient of those parameters (as `sums` is given), and the parameters' own is zero."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(layers)
  keys, leaves = [jax.tree_util.keystr(p) for p, _ in paths], [a for _, a in paths]
  per_layer = isinstance(sums, list)
  if per_layer and unroll is not True:
    raise ValueError('gradient_sums.scan: sums a layer apart are for unrolled layers')
  summed = [{jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(tree)}
            for tree in (sums if per_layer else [sums])]
  is_trained = [k in summed[0] for k in keys]
  if sum(is_trained) != len(summed[0]):
    raise ValueError('gradient_sums.scan: sums name parameters the layers do not have')
  trained = [a for a, t in zip(leaves, is_trained) if t]
  rest = [a for a, t in zip(leaves, is_trained) if not t]
  sums_leaves = [[s[k] for k in keys if k in s] for s in summed]  # in the layers' order
  sums_leaves = sums_leaves if per_layer else sums_leaves[0]

  def layer_of(t, r):
    t, r = iter(t), iter(r)
    return treedef.unflatten([next(t) if k else next(r) for k in is_trained])

  def one(x, t, r, extras):
    return step(x, layer_of(t, r), extras)

  def plain(trained, rest, sums, x, extras):
    return jax.lax.scan(lambda x, l: one(x, *l, extras), x, (trained, rest), unroll=unroll)

  run = jax.custom_vjp(plain)
  traced = {}  # the backward's view of the forward's residuals, found as the forward is traced

  def forward(trained, rest, sums, x, extras):
    def body(x, layer):
      t, r = layer
      (y, out), pullback = jax.vjp(lambda t, x: one(x, t, r, extras), t, x)
      residuals, traced['def'] = jax.tree.flatten(pullback)
      inputs = {id(a): (kind, k) for kind, tree in (('t', t), ('r', r), ('e', extras))
                for k, a in enumerate(jax.tree.leaves(tree))}
      # A residual that is one of the layer's inputs is read again where it is, not kept
      traced['from'] = [inputs.get(id(a)) for a in residuals]
      return y, (out, [a for a, at in zip(residuals, traced['from']) if at is None])
    y, (outs, kept) = jax.lax.scan(body, x, (trained, rest), unroll=unroll)
    return (y, outs), (trained, rest, sums, extras, kept)

  def pullback(t, r, extras, own, ct_x, ct_out):
    """(the layer's trained parameters' gradient, its input's) from its saved residuals."""
    inputs = {'t': jax.tree.leaves(t), 'r': jax.tree.leaves(r), 'e': jax.tree.leaves(extras)}
    own = iter(own)
    residuals = [next(own) if at is None else inputs[at[0]][at[1]] for at in traced['from']]
    return jax.tree.unflatten(traced['def'], residuals)((ct_x, ct_out))

  def backward(saved, cotangents):
    trained, rest, sums, extras, kept = saved
    ct_x, ct_outs = cotangents
    n = jax.tree.leaves(trained)[0].shape[0]
    if per_layer:  # unrolled: layer i's slices taken at a static index, its sums its own
      sums = list(sums)
      for i in reversed(range(n)):
        t, r, own, ct_out = jax.tree.map(lambda a: a[i], (trained, rest, kept, ct_outs))
        ct_t, ct_x = pullback(t, r, extras, own, ct_x, ct_out)
        sums[i] = row_major([s + g for s, g in zip(sums[i], ct_t)])
      return None, None, sums, ct_x, None

    def body(carry, layer):
      ct_x, sums = carry
      i, t, r, own, ct_out = layer
      ct_t, ct_x = pullback(t, r, extras, own, ct_x, ct_out)
      sums = [jax.lax.dynamic_update_index_in_dim(
          s, jax.lax.dynamic_index_in_dim(s, i, keepdims=False) + g, i, 0)
              for s, g in zip(sums, ct_t)]
      return (ct_x, row_major(sums)), None  # row-major: see sharding/layouts.py
    (ct_x, sums), _ = jax.lax.scan(body, (ct_x, sums),
                                   (jnp.arange(n), trained, rest, kept, ct_outs),
                                   reverse=True, unroll=unroll)
    return None, None, sums, ct_x, None

  run.defvjp(forward, backward)
  return run(trained, rest, sums_leaves, x, extras)
