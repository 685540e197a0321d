"""The train and eval steps as functions of (state, batch). `make_train_step` is the step on one
page, in order: the batch laid out, the parameters split into trained and frozen, the forward and
the loss (computed here from the model's output), its gradients (microbatches accumulated, or the
data replicas run apart), the update, and the guard against non-finite steps. What a feature
adds enters by the small named parts below it. training/programs.py compiles the steps ahead."""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import kernels
from model import Transformer, draft, moe, pipeline
from model.layers import Draft, constrain, split_adapters
from sharding import hierarchical
import sharding
from training.optimizer import trained
from training.state import Setup, TrainState


def make_train_step(setup: Setup, z_loss: float, microbatches: int = 1):
  """(state, batch) → (state, metrics). `z_loss`: the weight of log(Z)²; `microbatches`: slices
  of the batch the step runs in turn (pipeline stages take them themselves). On preference
  records (config.data.record='preference') the loss is DPO's (preference_sums)."""
  cfg = setup.model_cfg
  gradient_step = make_gradient_step(setup, z_loss, microbatches)

  def train_step(state: TrainState, batch):
    grads, router, finite, metrics = gradient_step(state, batch)
    params, frozen = trained(cfg, state.params)
    old_opt_state = state.opt_state
    if setup.opt_compute_shardings is not None:  # kept in host memory: brought in for the update
      old_opt_state = jax.device_put(old_opt_state, setup.opt_compute_shardings)
    updates, opt_state = setup.tx.update(grads, old_opt_state, params)
    params = balanced(setup, nnx.merge_state(optax.apply_updates(params, updates), frozen),
                      router)
    # A step whose loss or gradient is not finite is not applied: parameters and optimizer state
    # (its step count too, so the schedule waits) stay as they were. The selects fuse into the
    # update's elementwise loops, so they cost no extra memory.
    keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return state.replace(step=state.step + 1, params=keep_if_bad(params, state.params),
                         opt_state=keep_if_bad(opt_state, old_opt_state),
                         bad_steps=metrics['bad_steps']), metrics
  return train_step


def make_gradient_step(setup: Setup, z_loss: float, microbatches: int = 1):
  """(state, batch) → (the trained parameters' gradients, the routers' statistics, whether the
  step is finite, its metrics): the step up to its update, which make_train_step applies (or,
  with the state off the devices, training/tiers.py). Arguments as make_train_step's."""
  cfg, graphdef = setup.model_cfg, setup.graphdef
  scanned = 1 if pipeline_stages(setup) > 1 else microbatches  # slices the step runs in turn
  dpo = setup.run.dpo if prefers(setup) else None
  copy_of_master = setup.run.optimizer.tiered and not setup.run.optimizer.master_on_devices

  def loss_of(params, frozen, reference, batch, total, share, sums=None):
    """(loss, (its terms, router stats, draft sums)) of `batch`, its terms over the weight
    `total` of the whole batch (`share` of which it is: its router terms count that much).
    `sums`: the layer stacks' running gradient sums, which the backward adds to (Transformer)."""
    with nnx.logical_axis_rules(sharding.activation_rules()):  # activations pinned while traced
      if dpo:  # the reference model's log-probabilities of the answers, no gradient
        batch = {**batch, 'reference': reference_logps(
            setup, params, frozen, reference, batch, microbatches if scanned == 1 else 1)}
      model = nnx.merge(graphdef, params, frozen)
      then = (functools.partial(preference_sums, dpo=dpo) if dpo else
              functools.partial(loss_sums, z_loss=z_loss))
      sums, stats = model(batch['inputs'], batch['positions'], batch.get('segment_ids'),
                          microbatches if scanned == 1 else 1, then=then, rows=batch,
                          sums=sums)
    aux = share * moe.aux_loss(stats, cfg)  # the routers' balancing losses (0: dense)
    drafted = sums.get('draft', {})  # the draft heads' sums: their loss reaches only them
    heads = drafted['nats'].sum() / total if drafted else 0.0
    loss = sums['loss'] / total + aux + heads  # sums['loss']: the one with the gradient
    terms = ({k: v / total for k, v in sums.items() if k != 'pairs'} if dpo else
             {'loss': sums['nats'] / total,  # next-token cross-entropy, per weighted token
              'z_loss': z_loss * sums['log_z2'] / total})  # keeps the normaliser near 1
    return loss, (terms, jax.tree.map(lambda a: a * share, stats), drafted)

  def gradients(params, frozen, reference, batch, total=None):
    """((loss, parts), gradients) of the batch, accumulated over `scanned` microbatches by a
    scan (only one's activations live at a time): the same as one pass over the batch."""
    total = batch_weight(batch, dpo) if total is None else total
    grad_of = jax.value_and_grad(loss_of, has_aux=True)
    if scanned == 1:
      return grad_of(params, frozen, reference, batch, total, 1.0)
    slices = split_microbatches(batch, scanned)
    shapes = jax.eval_shape(grad_of, params, frozen, reference,
                            jax.tree.map(lambda x: x[0], slices), total, 1 / scanned)

    # The layer stacks' sums go through the model, whose backward adds each layer's gradient
    # to them as it makes it, so that no microbatch's gradients of a whole stack are held
    stacks = [name for name in Transformer.STACKS if jax.tree.leaves(params.get(name, {}))]
    sum_of = jax.value_and_grad(loss_of, argnums=(0, 6), has_aux=True)

    def accumulate(carry, microbatch):
      outputs, sums = carry
      into = {name: sums[name] for name in stacks}
      outputs_mb, (grads, into) = sum_of(params, frozen, reference, microbatch, total,
                                         1 / scanned, into)
      added = {jax.tree_util.keystr((jax.tree_util.DictKey(name), *path)): a
               for name in stacks for path, a in jax.tree_util.tree_leaves_with_path(into[name])}

      def summed(path, s, g):  # the stacks' as their backward added them; the rest added here
        key = jax.tree_util.keystr(path)
        return added[key] if key in added else s + g
      sums = jax.tree_util.tree_map_with_path(summed, sums, grads)
      # Row-major, the outputs' layout: made in place, not copied out of the loop transposed
      return sharding.row_major((jax.tree.map(jnp.add, outputs, outputs_mb), sums)), None
    # Where the parameters here are a compute-dtype copy of master weights kept off the devices
    # (training/tiers.py), their bf16 gradients are summed in fp32, as the master's would be
    wider = (lambda dtype: jnp.promote_types(dtype, jnp.float32)
             if copy_of_master and jnp.issubdtype(dtype, jnp.floating) else dtype)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, wider(a.dtype)), shapes)
    return jax.lax.scan(accumulate, zeros, slices)[0]

  def gradient_step(state: TrainState, batch):
    """(the trained parameters' gradients, the router's statistics, whether the step is finite,
    the step's metrics): everything of a step but the update."""
    batch = context_layout(setup, batch)  # ring attention's zigzag rows, else as it is
    params, frozen = trained(cfg, state.params)  # what the optimizer holds; the frozen rest
    reference = getattr(state, 'reference', None)  # DPO's, where no frozen base stands for it
    if setup.hierarchy is None:
      (loss, (terms, router, drafted)), grads = gradients(params, frozen, reference, batch)
    else:  # data replicas run apart, their gradients summed across data once a step
      (loss, (terms, router, drafted)), grads = hierarchical.apart(
          setup.hierarchy, setup.mesh, lambda compute, reference, rows, total: gradients(
              compute, frozen, reference, rows, total), params, batch, cfg.dtype,
          cfg.reduce_dtype, reference, weight=pair_rows_sum if dpo else None)
    grad_norm, norms = gradient_norms(cfg, grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    bad_steps = state.bad_steps + jnp.where(finite, 0, 1).astype(jnp.int32)
    metrics = {**terms, 'grad_norm': grad_norm,
               'learning_rate': setup.schedule(state.step - state.bad_steps),
               'skipped': ~finite, 'bad_steps': bad_steps, **moe.metrics(router),
               **norms, **draft_metrics(drafted)}
    return grads, router, finite, metrics

  return gradient_step


def loss_sums(out, rows, z_loss: float) -> dict:
  """The loss's sums over a batch's weighted tokens, in fp32, from the model's Output: the loss
  nats + z_loss · log Z² (the one differentiated: the head makes its gradient with it), and its
  parts nats (−log p(target)) and log Z², with the draft heads' (draft_sums) if the model has
  them. Sums: microbatches, pipeline stages and data replicas add theirs."""
  loss, nats, log_z2 = out.loss_sums(rows['targets'], rows['weights'], z_loss)
  sums = {'loss': loss, 'nats': nats, 'log_z2': log_z2}
  if out.model.cfg.draft_heads:
    sums['draft'] = draft_sums(out.draft_losses(rows['targets']), rows)
  return sums


def prefers(setup: Setup) -> bool:
  """Whether the run trains on preference pairs, by DPO's loss."""
  return setup.run.data.preference


def pair_rows_B(rows):
  """[B] 1.0 where a row holds a whole pair (answers of both: segment 1 chosen, 2 rejected; an
  evaluation pass pads its last batch with empty rows), else 0."""
  answers = lambda segment: (rows['weights'] * (rows['segment_ids'] == segment)).sum(1) > 0
  return (answers(1) & answers(2)).astype(jnp.float32)


def pair_rows_sum(rows) -> jax.Array:
  """The pairs among `rows` (data replicas apart add theirs for the batch's weight)."""
  return pair_rows_B(rows).sum()


def batch_weight(batch, dpo) -> jax.Array:
  """What a batch's sums are divided by: its weighted tokens, or with DPO its pairs."""
  return jnp.maximum(pair_rows_B(batch).sum() if dpo else batch['weights'].sum(), 1.0)


def answer_logps(out, rows):
  """log p of each weighted target, 0 elsewhere, fp32 [B, L]: the answers' tokens."""
  return -out.token_losses(rows['targets'])[0] * rows['weights']


def reference_logps(setup: Setup, params, frozen, reference, batch, microbatches: int = 1):
  """DPO's reference model's answer_logps of the batch, no gradient: the run's starting model,
  `reference` (held in the state), or under LoRA the frozen base with its adapters at zero
  (which adds nothing to a projection), so no second copy is held. Under pipeline stages each
  stage scores its share of the rows (the model sums the stages' results), so each puts its
  rows' log-probabilities in their places of a [B, L] of zeros."""
  if reference is None:
    reference = nnx.merge_state(jax.tree.map(jnp.zeros_like, params), frozen)
  model = nnx.merge(setup.graphdef, reference)
  then, rows = answer_logps, batch
  if pipeline_stages(setup) > 1:
    B, L = batch['inputs'].shape
    rows = {**batch, 'row': jnp.broadcast_to(jnp.arange(B)[:, None], (B, L))}

    def then(out, share):
      logps_bL = answer_logps(out, share)
      return jnp.zeros((B, L), logps_bL.dtype).at[share['row'][:, 0]].set(logps_bL)
  logps_BL, _ = model(batch['inputs'], batch['positions'], batch.get('segment_ids'),
                      microbatches, then=then, rows=rows)
  return jax.lax.stop_gradient(logps_BL)


def preference_sums(out, rows, dpo) -> dict:
  """DPO's sums over a batch's pairs (Rafailov et al. 2023), fp32: with h the margin
  β·((log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)), the loss
  −(1−ε)·log σ(h) − ε·log σ(−h) (ε the label smoothing), and for the metrics how often h > 0
  (reward accuracy), h itself, each answer's implicit reward β·(log π − log π_ref), and the pairs.
  rows['reference']: the reference's answer_logps. Sums, so microbatches add theirs."""
  gain_BL = answer_logps(out, rows) - rows['reference']
  chosen_B = dpo.beta * jnp.where(rows['segment_ids'] == 1, gain_BL, 0.0).sum(1)
  rejected_B = dpo.beta * jnp.where(rows['segment_ids'] == 2, gain_BL, 0.0).sum(1)
  margin_B, pair_B = chosen_B - rejected_B, pair_rows_B(rows)
  eps = dpo.label_smoothing
  loss_B = -(1 - eps) * jax.nn.log_sigmoid(margin_B) - eps * jax.nn.log_sigmoid(-margin_B)
  summed = lambda x_B: jax.lax.stop_gradient((x_B * pair_B).sum())
  return {'loss': (loss_B * pair_B).sum(), 'reward_accuracy': summed(margin_B > 0),
          'reward_margin': summed(margin_B), 'chosen_reward': summed(chosen_B),
          'rejected_reward': summed(rejected_B), 'pairs': summed(jnp.ones_like(margin_B))}


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


def split_microbatches(batch, microbatches: int):
  """[B, L] → [M, B/M, L] with microbatch m = rows m, m+M, m+2M, …: each device's rows hold an
  equal share of every microbatch, so splitting moves no data (B divides by M × data × fsdp)."""
  def split(x_BL):
    with nnx.logical_axis_rules(sharding.activation_rules()):
      return constrain(pipeline.split(x_BL, microbatches), (None, 'batch', 'length'))
  return jax.tree.map(split, batch)


def pipeline_stages(setup: Setup) -> int:
  """How many pipeline stages the layers are split into (>1: they take the microbatches)."""
  return setup.mesh.shape['stage']


def draft_sums(losses, rows) -> dict:
  """The draft heads' weighted sums over the batch, [K] each: nats, top-1 hits and the weight
  of the tokens they guess. Sums, so microbatches and data replicas add."""
  nll_KBL, gap_KBL = losses
  w_KBL = draft.weights(rows['weights'], rows.get('segment_ids'), nll_KBL.shape[0])
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


def gradient_norms(cfg, grads):
  """(the norm of all the gradients, the metrics that replace it where draft heads train beside
  the model: grad_norm the model's alone, as it would be without them, and draft_grad_norm)."""
  if not cfg.draft_heads or cfg.draft_only:
    return optax.tree.norm(grads), {}
  drafts, model = split_adapters(grads, Draft)
  model_norm, drafts_norm = optax.tree.norm(model), optax.tree.norm(drafts)
  return jnp.hypot(model_norm, drafts_norm), {'grad_norm': model_norm,
                                              'draft_grad_norm': drafts_norm}


def balanced(setup: Setup, params, router: dict):
  """The parameters with the sigmoid router's balancing bias stepped (not a gradient's: the
  aux-loss-free balancing of model/moe.py), where config.model.router_bias_rate sets it."""
  if not setup.model_cfg.router_bias_rate:
    return params
  model = nnx.merge(setup.graphdef, params)
  model.balanced(router['tokens_per_expert'], setup.model_cfg.router_bias_rate)
  return nnx.state(model)


def make_eval_step(setup: Setup, token_bytes_V, microbatches: int = 1):
  """(params, reference, batch) → sums over the batch's weighted targets: nats, tokens, and the
  bytes of text they stand for (`token_bytes_V[id]`, from the tokenizer), so a pass can report
  loss and bits per byte; on preference records DPO's (preference_sums) against `reference`
  (the state's, or None: the frozen base). `microbatches` matter only to pipeline stages (the
  batch runs whole otherwise)."""
  microbatches = microbatches if pipeline_stages(setup) > 1 else 1
  token_bytes_V = jnp.asarray(token_bytes_V, jnp.float32)
  graphdef = setup.graphdef
  if setup.model_cfg.experts:  # every token routed: a score never depends on the batch
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: Transformer(setup.model_cfg.dropless(), rngs=nnx.Rngs(0))))

  def scored(out, rows):
    weights_BL = rows['weights']
    return {'nats': (out.token_losses(rows['targets'])[0] * weights_BL).sum(),
            'tokens': weights_BL.sum(),
            'bytes': (token_bytes_V[rows['targets']] * weights_BL).sum()}

  if prefers(setup):
    scored = functools.partial(preference_sums, dpo=setup.run.dpo)

  def eval_step(params, reference, batch):
    batch = context_layout(setup, batch)
    with nnx.logical_axis_rules(sharding.activation_rules()):
      if prefers(setup):
        batch = {**batch, 'reference': reference_logps(setup, *trained(setup.model_cfg, params),
                                                       reference, batch, microbatches)}
      model = nnx.merge(graphdef, params)
      return model(batch['inputs'], batch['positions'], batch.get('segment_ids'), microbatches,
                   then=scored, rows=batch)[0]
  return eval_step
