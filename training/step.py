"""The train and eval steps as functions of (state, batch): what one step computes, in order.
training/programs.py compiles them ahead, with explicit shardings and the state donated."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import kernels
from model import Transformer, draft, moe, pipeline
from model.layers import Draft, constrain, split_adapters
from sharding import hierarchical
import sharding
from training.state import Setup, TrainState, trained

def weighted_losses(nll_BL, logz_BL, weights_BL, z_loss: float, total=None):
  """Mean next-token cross-entropy over weighted tokens, and the z-loss z_loss·mean(log Z)², in
  fp32, from the model's per-token losses. `total` is the weight the means divide by (default:
  this batch's); a microbatch passes its whole batch's, so that the microbatches' terms add up to
  the batch's."""
  if total is None:
    total = jnp.maximum(weights_BL.sum(), 1.0)
  ce = (nll_BL * weights_BL).sum() / total
  return ce, z_loss * (jnp.square(logz_BL) * weights_BL).sum() / total


def context_layout(setup: Setup, batch: dict) -> dict:
  """The batch as the model expects it: under ring attention over a sequence split, every [B, L]
  array in the zigzag order (kernels/context_parallel.py), so each device has equal causal work;
  the loss, a sum over tokens, is unchanged. Otherwise the batch itself."""
  n = setup.mesh.shape['sequence']
  if setup.model_cfg.context_parallel != 'ring' or n == 1:
    return batch
  order = kernels.zigzag_order(next(iter(batch.values())).shape[1], n)
  with nnx.logical_axis_rules(sharding.activation_rules()):
    return {k: constrain(x_BL[:, order], ('batch', 'length')) for k, x_BL in batch.items()}


def _token_losses(graphdef, params, batch, microbatches=1, frozen=None):
  """(−log p(target), log Z) [B, L] of the batch, from the model's head and loss together; the
  MoE layers' router stats ({} for a dense model), their weighted losses (model/moe.py), and the
  draft heads' sums (draft_sums; {} without heads). `frozen`: the parameters not in `params`
  (under LoRA, the base)."""
  # Activations are pinned through ACTIVATION_RULES while the model is traced.
  with nnx.logical_axis_rules(sharding.activation_rules()):
    model = nnx.merge(graphdef, params, *([frozen] if frozen is not None else []))
    # A batch without segment ids holds one document a row (no packing mask to apply).
    nll_BL, logz_BL, stats = model(batch['inputs'], batch['positions'], batch.get('segment_ids'),
                                   microbatches, targets_BL=batch['targets'])
    stats = dict(stats)
    drafted = draft_sums(stats.pop('draft', None), batch)
    return nll_BL, logz_BL, stats, moe.aux_loss(stats, model.cfg), drafted


def draft_sums(losses, batch) -> dict:
  """The draft heads' weighted sums over the batch, [K] each: nats, top-1 hits and the weight
  of the tokens they guess ({} without heads). Sums, so microbatches and data replicas add."""
  if losses is None:
    return {}
  nll_KBL, gap_KBL = losses
  w_KBL = draft.weights(batch['weights'], batch.get('segment_ids'), nll_KBL.shape[0])
  return {'nats': (nll_KBL * w_KBL).sum((1, 2)), 'hits': ((gap_KBL == 0) * w_KBL).sum((1, 2)),
          'tokens': w_KBL.sum((1, 2))}


def draft_metrics(sums: dict) -> dict:
  """Each head's mean loss and top-1 accuracy over the tokens it guessed: draft1_loss, …"""
  if not sums:
    return {}
  tokens_K = jnp.maximum(sums['tokens'], 1.0)
  out = {}
  for k in range(tokens_K.shape[0]):
    out[f'draft{k + 1}_loss'] = sums['nats'][k] / tokens_K[k]
    out[f'draft{k + 1}_accuracy'] = sums['hits'][k] / tokens_K[k]
  return out


def _loss(graphdef, params, batch, z_loss, total=None, microbatches=1, share=1.0, frozen=None):
  """(loss, (ce, z-loss, router stats, draft sums)); the router's losses and stats count
  `share` of theirs: a microbatch's part of the batch. The draft heads' losses join the loss
  per token of the batch, as the base's does (their gradients reach only the heads)."""
  nll_BL, logz_BL, stats, aux, drafted = _token_losses(graphdef, params, batch, microbatches,
                                                       frozen)
  total = jnp.maximum(batch['weights'].sum(), 1.0) if total is None else total
  ce, zl = weighted_losses(nll_BL, logz_BL, batch['weights'], z_loss, total)
  heads = drafted['nats'].sum() / total if drafted else 0.0
  return ce + zl + share * aux + heads, (ce, zl, jax.tree.map(lambda a: a * share, stats),
                                         drafted)


def split_microbatches(batch, microbatches: int):
  """[B, L] → [M, B/M, L] with microbatch m = rows m, m+M, m+2M, …: each device's rows hold an
  equal share of every microbatch, so splitting moves no data (B divides by M × data × fsdp)."""
  def split(x_BL):
    with nnx.logical_axis_rules(sharding.activation_rules()):
      return constrain(pipeline.split(x_BL, microbatches), (None, 'batch', 'length'))
  return jax.tree.map(split, batch)


def loss_and_grads(graphdef, params, batch, z_loss: float, microbatches: int = 1,
                   pipelined: bool = False, total=None, frozen=None):
  """((loss, (ce, z_loss, router stats, draft sums)), grads) of the batch; with microbatches > 1,
  accumulated over a `lax.scan` of microbatches (only one microbatch's activations live at a
  time), giving the same result as one pass over the whole batch. `pipelined`: the model's
  pipeline stages take the microbatches instead (model/pipeline.py), in one pass. `total`: the
  weight the losses divide by (default: the batch's). `frozen`: parameters the model uses and
  no gradient is taken of (under LoRA or draft_only, the base: its weights' gradients are never
  computed)."""
  if total is None:
    total = jnp.maximum(batch['weights'].sum(), 1.0)
  if microbatches == 1 or pipelined:
    return jax.value_and_grad(lambda p: _loss(graphdef, p, batch, z_loss, total,
                                              microbatches=microbatches, frozen=frozen),
                              has_aux=True)(params)
  grad_fn = jax.value_and_grad(
      lambda p, mb: _loss(graphdef, p, mb, z_loss, total, share=1 / microbatches, frozen=frozen),
      has_aux=True)
  batches = split_microbatches(batch, microbatches)

  def accumulate(carry, microbatch):
    return jax.tree.map(jnp.add, carry, grad_fn(params, microbatch)), None

  shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], batches))
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
  return jax.lax.scan(accumulate, zeros, batches)[0]


def across_data(setup: Setup, master, batch, z_loss: float, microbatches: int):
  """loss_and_grads over data replicas (sharding/hierarchical.py): with
  config.partition.hierarchical the compute copy is gathered across data from the master's
  shards once; each replica runs its own rows' microbatches in a region manual over data, its
  gradients kept in its shards; their sum is reduce-scattered to the master's shards once (or,
  the parameters replicated over data, all-reduced once). The losses are the whole batch's.

  The region is untyped (check_vma=False): the copy is the same on every replica, and typed so,
  autodiff would sum each use's gradient over the replicas there and then, every microbatch.

  A hierarchical copy and its gradients are held in the gradient reduction dtype (norm scales in
  their own): the values the model computes with are the master's in the compute dtype either
  way."""
  h, cfg = setup.hierarchy, setup.model_cfg
  axis = hierarchical.AXIS

  def to_compute(w, spec, dim, block, matrix):
    if not h.split:  # replicated over data: the parameters themselves
      return w
    scheme, dtype = (h.weights, cfg.dtype) if matrix else ('exact', w.dtype)
    return hierarchical.to_compute(w, spec, dim, scheme, dtype, block).astype(
        cfg.reduce_dtype if matrix else w.dtype)

  def region(compute, batch):
    total = jnp.maximum(jax.lax.psum(batch['weights'].sum(), axis), 1.0)
    (loss, (ce, zl, router, drafted)), grads = loss_and_grads(
        setup.graphdef, compute, batch, z_loss, microbatches, pipeline_stages(setup) > 1, total)
    # Summed across data in the reduction dtype, as inside the replica (norm scales in fp32).
    grads = jax.tree.map(lambda g, matrix: (g.astype(cfg.reduce_dtype) if matrix else g)[None],
                         grads, h.matrix)
    return jax.lax.psum((loss, ce, zl, drafted), axis), router, grads

  compute = jax.tree.map(to_compute, master, h.specs, h.dims, h.blocks, h.matrix)
  (loss, ce, zl, drafted), router, grads_d = jax.shard_map(
      region, mesh=setup.mesh, in_specs=(P(), P(axis)), out_specs=(P(), P(), P(axis)),
      axis_names={axis}, check_vma=False)(compute, batch)
  grads = jax.tree.map(
      lambda w, g_d, spec, dim, block, matrix: hierarchical.reduce(
          g_d, spec, dim, h.gradients if matrix else 'exact', block).astype(w.dtype),
      master, grads_d, h.specs, h.dims, h.blocks, h.matrix)
  return (loss, (ce, zl, router, drafted)), grads


def pipeline_stages(setup: Setup) -> int:
  """How many pipeline stages the layers are split into (>1: they take the microbatches)."""
  return setup.mesh.shape['stage']


def gradient_norms(cfg, grads):
  """(the norm of all the gradients, the metrics that replace it where draft heads train beside
  the model: grad_norm the model's alone, as it would be without them, and draft_grad_norm)."""
  if not cfg.draft_heads or cfg.draft_only:
    return optax.tree.norm(grads), {}
  drafts, model = split_adapters(grads, Draft)
  model_norm, drafts_norm = optax.tree.norm(model), optax.tree.norm(drafts)
  return jnp.hypot(model_norm, drafts_norm), {'grad_norm': model_norm,
                                              'draft_grad_norm': drafts_norm}


def make_train_step(setup: Setup, z_loss: float, microbatches: int = 1):
  def train_step(state: TrainState, batch):
    batch = context_layout(setup, batch)
    params, frozen = trained(setup.model_cfg, state.params)
    if setup.hierarchy is not None:
      (loss, (ce, zl, router, drafted)), grads = across_data(setup, params, batch, z_loss,
                                                              microbatches)
    else:
      (loss, (ce, zl, router, drafted)), grads = loss_and_grads(
          setup.graphdef, params, batch, z_loss, microbatches, pipeline_stages(setup) > 1,
          frozen=frozen if setup.model_cfg.frozen_base else None)
    grad_norm, norms = gradient_norms(setup.model_cfg, grads)
    old_opt_state = state.opt_state
    if setup.opt_compute_shardings is not None:  # kept in host memory: bring it in for the update
      old_opt_state = jax.device_put(old_opt_state, setup.opt_compute_shardings)
    updates, opt_state = setup.tx.update(grads, old_opt_state, params)
    params = nnx.merge_state(optax.apply_updates(params, updates), frozen)
    if setup.model_cfg.router_bias_rate:  # not a gradient's: the router's balancing bias
      model = nnx.merge(setup.graphdef, params)
      model.balanced(router['tokens_per_expert'], setup.model_cfg.router_bias_rate)
      params = nnx.state(model)
    # A step whose loss or gradient is not finite is not applied: parameters and optimizer state
    # (its step count too, so the schedule waits) stay as they were. The selects fuse into the
    # update's elementwise loops, so they cost no extra memory.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    bad_steps = state.bad_steps + jnp.where(finite, 0, 1).astype(jnp.int32)
    metrics = {'loss': ce, 'z_loss': zl, 'grad_norm': grad_norm,
               'learning_rate': setup.schedule(state.step - state.bad_steps),
               'skipped': ~finite, 'bad_steps': bad_steps, **moe.metrics(router),
               **norms, **draft_metrics(drafted)}
    return TrainState(step=state.step + 1, params=keep_if_bad(params, state.params),
                      opt_state=keep_if_bad(opt_state, old_opt_state),
                      bad_steps=bad_steps), metrics
  return train_step


def make_eval_step(setup: Setup, token_bytes_V, microbatches: int = 1):
  """Sums over the batch's weighted targets: nats, tokens, and the bytes of text they stand for
  (`token_bytes_V[id]`, from the tokenizer), so a pass can report loss and bits per byte.
  `microbatches` matter only to pipeline stages (the batch runs whole otherwise)."""
  microbatches = microbatches if pipeline_stages(setup) > 1 else 1
  token_bytes_V = jnp.asarray(token_bytes_V, jnp.float32)
  graphdef = setup.graphdef
  if setup.model_cfg.experts:  # every token routed: a score never depends on the batch
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: Transformer(setup.model_cfg.dropless(), rngs=nnx.Rngs(0))))

  def eval_step(params, batch):
    batch = context_layout(setup, batch)
    nll_BL = _token_losses(graphdef, params, batch, microbatches)[0]
    weights_BL = batch['weights']
    return {'nats': (nll_BL * weights_BL).sum(), 'tokens': weights_BL.sum(),
            'bytes': (token_bytes_V[batch['targets']] * weights_BL).sum()}
  return eval_step
