"""What a step computes, top to bottom: the batch laid out, the parameters split into trained and
frozen, the forward, the loss of the model's output, its gradients (`gradients`; `microbatched`
and the data replicas' region wrap it where the run asks), the update, and the guard against
non-finite steps. A loss is an object of one signature (`LanguageModel` here; training/dpo.py's
`DPO` on preference records), the draft heads' and the routers' terms are added to it from the
model's output (training/draft_heads.py, model/moe.py). training/programs.py compiles the steps
ahead."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import kernels
from model import Transformer, moe, pipeline
from configs.base import MAX_LOGIT
from model.layers import constrain
from sharding import hierarchical
import sharding
from training import draft_heads, dpo
from training.optimizer import trained
from training.state import Setup, TrainState


@dataclasses.dataclass(frozen=True)
class LanguageModel:
  """The next-token loss: cross-entropy over the weighted tokens plus z_loss · log Z²."""
  z_loss: float

  def prepare(self, params, frozen, reference, batch, microbatches: int):
    return batch  # nothing beyond the batch

  def sums(self, out, rows) -> dict:
    return loss_sums(out, rows, self.z_loss)

  def weight(self, rows) -> jax.Array:
    """What the batch's sums are divided by: its weighted tokens."""
    return rows['weights'].sum()

  def terms(self, sums: dict, total) -> dict:
    return {'loss': sums['nats'] / total,  # next-token cross-entropy, per weighted token
            'z_loss': self.z_loss * sums['log_z2'] / total}  # keeps the normaliser near 1


def loss_sums(out, rows, z_loss: float) -> dict:
  """The loss's sums over a batch's weighted tokens, in fp32, from the model's Output: the loss
  nats + z_loss · log Z² (the one differentiated: the head makes its gradient with it), and its
  parts nats (−log p(target)) and log Z², with the draft heads' if the model has them. Sums:
  microbatches, pipeline stages and data replicas add theirs."""
  loss, nats, log_z2 = out.loss_sums(rows['targets'], rows['weights'], z_loss)
  sums = {'loss': loss, 'nats': nats, 'log_z2': log_z2}
  if out.model.cfg.draft_heads:
    sums['draft'] = draft_heads.sums(out, rows)
  return sums


def loss_for(setup: Setup, z_loss: float):
  """The run's loss: DPO's on preference records, else the language model's."""
  if prefers(setup):
    return dpo.DPO(setup.run.dpo, setup.graphdef, pipeline_stages(setup) > 1)
  return LanguageModel(z_loss)


def make_train_step(setup: Setup, z_loss: float, microbatches: int = 1, loss=None):
  """(state, batch) → (state, metrics). `z_loss`: the weight of log(Z)²; `microbatches`: slices
  of the batch the step runs in turn (pipeline stages take them themselves); `loss`: another than
  the run's (loss_for), of LanguageModel's signature."""
  return functools.partial(train_step, setup,
                           make_gradient_step(setup, z_loss, microbatches, loss))


def train_step(setup: Setup, gradient_step, state: TrainState, batch):
  grads, router, finite, metrics = gradient_step(state, batch)
  params, frozen = trained(setup.model_cfg, state.params)
  old_opt_state = state.opt_state
  if setup.opt_compute_shardings is not None:  # kept in host memory: brought in for the update
    old_opt_state = jax.device_put(old_opt_state, setup.opt_compute_shardings)
  updates, opt_state = setup.tx.update(grads, old_opt_state, params)
  params = balanced(setup, nnx.merge_state(optax.apply_updates(params, updates), frozen), router)
  params = qk_clipped(setup.model_cfg, params, router)
  # A step whose loss or gradient is not finite is not applied: parameters and optimizer state
  # (its step count too, so the schedule waits) stay as they were. The selects fuse into the
  # update's elementwise loops, so they cost no extra memory.
  keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  return state.replace(step=state.step + 1, params=keep_if_bad(params, state.params),
                       opt_state=keep_if_bad(opt_state, old_opt_state),
                       bad_steps=metrics['bad_steps']), metrics


def make_gradient_step(setup: Setup, z_loss: float, microbatches: int = 1, loss=None):
  """(state, batch) → (the trained parameters' gradients, the routers' statistics, whether the
  step is finite, its metrics): the step up to its update, which make_train_step applies (or,
  with the state off the devices, training/tiers.py). Arguments as make_train_step's. The
  gradient function, wrapped where the run asks: over microbatches, and with the data replicas
  run apart."""
  loss = loss or loss_for(setup, z_loss)
  staged = pipeline_stages(setup) > 1  # the stages take the microbatches themselves
  grad_fn = functools.partial(gradients, setup, loss, microbatches if staged else 1)
  if microbatches > 1 and not staged:
    cfg = setup.model_cfg
    unrolled = not cfg.scan_layers and cfg.virtual_stages == 1
    matrices = cast_once(setup) if setup.hierarchy is None and unrolled else None
    grad_fn = microbatched(grad_fn, loss, microbatches,
                           widened=copy_of_master(setup) or matrices is not None,
                           per_layer=unrolled)
    if matrices is not None:
      grad_fn = in_reduce_dtype(grad_fn, matrices, cfg.reduce_dtype)
  if setup.hierarchy is not None:
    grad_fn = replicas_apart(setup, loss, grad_fn)
  return functools.partial(gradient_step, setup, grad_fn)


def loss_of(setup: Setup, loss, microbatches: int, params, frozen, reference, batch, total,
            share, sums=None):
  """(loss, (its terms, router stats, draft sums)) of `batch`, its terms over the weight `total`
  of the whole batch (`share` of which it is: its router terms count that much). `sums`: the
  layer stacks' running gradient sums, which the backward adds to (model/gradient_sums.py)."""
  with nnx.logical_axis_rules(sharding.activation_rules()):  # activations pinned while traced
    batch = loss.prepare(params, frozen, reference, batch, microbatches)
    model = nnx.merge(setup.graphdef, params, frozen)
    if pipeline_stages(setup) > 1:  # each stage its share of the microbatches
      sums, stats = model(batch['inputs'], batch['positions'], batch.get('segment_ids'),
                          microbatches, then=loss.sums, rows=batch)
    else:
      out, stats = model.output(batch['inputs'], batch['positions'], batch.get('segment_ids'),
                                sums=sums)
      sums = loss.sums(out, batch)
  aux = share * moe.aux_loss(stats, setup.model_cfg)  # the routers' balancing losses (0: dense)
  drafted = sums.get('draft', {})  # the draft heads' sums: their loss reaches only them
  heads = drafted['nats'].sum() / total if drafted else 0.0
  value = sums['loss'] / total + aux + heads  # sums['loss']: the one with the gradient
  return value, (loss.terms(sums, total), shared(stats, share), drafted)


def shared(stats: dict, share):
  """A batch slice's statistics as its `share` of the batch's: the routers' weighted by it (the
  slices' are then summed: `accumulate`), QK-clip's maxima as they are."""
  return {key: a if key == MAX_LOGIT else jax.tree.map(lambda x: x * share, a)
          for key, a in stats.items()}


def accumulate(outputs, more):
  """Two batch slices' outputs (loss, terms, statistics) as one's: summed, QK-clip's maxima
  (MAX_LOGIT) the larger."""
  def add(path, a, b):
    maximum = any(getattr(k, 'key', None) == MAX_LOGIT for k in path)
    return jnp.maximum(a, b) if maximum else a + b
  return jax.tree_util.tree_map_with_path(add, outputs, more)


def gradients(setup: Setup, loss, microbatches: int, params, frozen, reference, batch,
              total=None, share=1.0, sums=None):
  """((loss, parts), gradients) of the batch (loss_of's); with `sums`, the gradients of the
  layer stacks are the new sums (the backward added each layer's to them)."""
  total = jnp.maximum(loss.weight(batch), 1.0) if total is None else total
  at = functools.partial(loss_of, setup, loss, microbatches)
  if sums is None:
    return jax.value_and_grad(at, has_aux=True)(params, frozen, reference, batch, total, share)
  return jax.value_and_grad(at, argnums=(0, 6), has_aux=True)(params, frozen, reference, batch,
                                                              total, share, sums)


def microbatched(grad_fn, loss, microbatches: int, widened: bool = False,
                 per_layer: bool = False):
  """`grad_fn` accumulated over `microbatches` slices of the batch by a scan (only one's
  activations live at a time): the same as one pass over the batch. The layer stacks' sums go
  through the model, whose backward adds each layer's gradient to them as it makes it, so no
  microbatch's gradients of a whole stack are held. `widened`: bf16 gradients summed in fp32
  (the parameters a compute-dtype copy of master weights kept off the devices). `per_layer`
  (unrolled layers): each layer's sums a buffer of its own until the microbatches are done,
  which its gradient is added to in place (model/gradient_sums.py), stacked once at the end."""
  def accumulated(params, frozen, reference, batch, total=None):
    total = jnp.maximum(loss.weight(batch), 1.0) if total is None else total
    slices = split_microbatches(batch, microbatches)
    stacks = [name for name in Transformer.STACKS if jax.tree.leaves(params.get(name, {}))]
    shapes = jax.eval_shape(grad_fn, params, frozen, reference,
                            jax.tree.map(lambda x: x[0], slices), total, 1 / microbatches)
    wider = (lambda dtype: jnp.promote_types(dtype, jnp.float32)
             if widened and jnp.issubdtype(dtype, jnp.floating) else dtype)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, wider(a.dtype)), shapes)
    step = functools.partial(add_microbatch, grad_fn, stacks, params, frozen, reference, total,
                             1 / microbatches)
    if not per_layer:
      return jax.lax.scan(step, zeros, slices)[0]
    outputs, grads = zeros
    rest = {key: a for key, a in keyed(grads).items() if not key.startswith(stack_keys(stacks))}
    layered = {name: [jax.tree.map(lambda a: a[0], grads[name])] * layers(grads[name])
               for name in stacks}
    (outputs, rest, layered), _ = jax.lax.scan(
        functools.partial(add_microbatch_per_layer, grad_fn, params, frozen, reference, total,
                          1 / microbatches), (outputs, rest, layered), slices)
    for name in stacks:  # each leaf's layers stacked again
      per = [keyed(layer) for layer in layered[name]]
      prefix = stack_keys([name])[0]
      rest.update({prefix + key: jnp.stack([p[key] for p in per]) for key in per[0]})
    return outputs, jax.tree_util.tree_map_with_path(
        lambda path, _: rest[jax.tree_util.keystr(path)], grads)
  return accumulated


def keyed(tree) -> dict:
  """{path as keystr: leaf}."""
  return {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(tree)}


def stack_keys(stacks) -> tuple:
  return tuple(jax.tree_util.keystr((jax.tree_util.DictKey(name),)) for name in stacks)


def layers(stack) -> int:
  return jax.tree.leaves(stack)[0].shape[0]


def add_microbatch_per_layer(grad_fn, params, frozen, reference, total, share, carry,
                             microbatch):
  """add_microbatch's, the stacks' sums one tree a layer (`layered`), the rest's by path."""
  outputs, rest, layered = carry
  outputs_mb, (grads, layered) = grad_fn(params, frozen, reference, microbatch, total, share,
                                         layered)
  grads = keyed(grads)
  rest = {key: s + grads[key] for key, s in rest.items()}
  return sharding.row_major((accumulate(outputs, outputs_mb), rest, layered)), None


def cast_once(setup: Setup):
  """Where a step's microbatches would each cast the same fp32 weights to the gradient reduction
  dtype (and a remat policy cast them again in the backward), a tree as the trained parameters
  saying which to cast once a step instead; else None. The weights it names are the ones the
  model reads only so cast (`model.layers.weight`): everything of a dense model but its norm
  scales, which it reads in fp32 (an MoE router is read in fp32 too: MoE models keep the casts).
  The values the step computes with, and their gradients, are the same either way."""
  cfg = setup.model_cfg
  if cfg.experts or jnp.dtype(cfg.reduce_dtype) == jnp.dtype(cfg.param_dtype):
    return None
  return hierarchical.matrices(trained(cfg, setup.abstract_state.params)[0])


def in_reduce_dtype(grad_fn, matrices, dtype):
  """`grad_fn` (microbatched, its sums fp32) of the trained parameters with `matrices` cast to
  `dtype` once, before the microbatches, rather than in each."""
  def cast(params, frozen, reference, batch, total=None):
    compute = jax.tree.map(lambda w, matrix: w.astype(dtype) if matrix else w, params, matrices)
    return grad_fn(compute, frozen, reference, batch, total)
  return cast


def add_microbatch(grad_fn, stacks, params, frozen, reference, total, share, carry, microbatch):
  """The scan's body: one microbatch's outputs and gradients added to the carry's."""
  outputs, sums = carry
  into = {name: sums[name] for name in stacks}
  outputs_mb, (grads, into) = grad_fn(params, frozen, reference, microbatch, total, share, into)
  added = {jax.tree_util.keystr((jax.tree_util.DictKey(name), *path)): a
           for name in stacks for path, a in jax.tree_util.tree_leaves_with_path(into[name])}

  def summed(path, s, g):  # the stacks' as their backward added them; the rest added here
    key = jax.tree_util.keystr(path)
    return added[key] if key in added else s + g
  sums = jax.tree_util.tree_map_with_path(summed, sums, grads)
  # Row-major, the outputs' layout: made in place, not copied out of the loop transposed
  return sharding.row_major((accumulate(outputs, outputs_mb), sums)), None


def replicas_apart(setup: Setup, loss, grad_fn):
  """`grad_fn` run by the data replicas apart, their gradients summed across data once a step
  (sharding/hierarchical.py: apart)."""
  cfg = setup.model_cfg

  def apart(params, frozen, reference, batch):
    return hierarchical.apart(setup.hierarchy, setup.mesh, functools.partial(
        with_frozen, grad_fn, frozen), params, batch, cfg.dtype, cfg.reduce_dtype, reference,
        weight=loss.weight)
  return apart


def with_frozen(grad_fn, frozen, compute, reference, rows, total):
  """grad_fn of a replica's compute copy, with the frozen parameters beside it."""
  return grad_fn(compute, frozen, reference, rows, total)


def gradient_step(setup: Setup, grad_fn, state: TrainState, batch):
  """(the trained parameters' gradients, the router's statistics, whether the step is finite,
  the step's metrics): everything of a step but the update."""
  cfg = setup.model_cfg
  batch = context_layout(setup, batch)  # ring attention's zigzag rows, else as it is
  params, frozen = trained(cfg, state.params)  # what the optimizer holds; the frozen rest
  reference = getattr(state, 'reference', None)  # DPO's, where no frozen base stands for it
  (loss, (terms, router, drafted)), grads = grad_fn(params, frozen, reference, batch)
  grad_norm, norms = draft_heads.gradient_norms(cfg, grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  bad_steps = state.bad_steps + jnp.where(finite, 0, 1).astype(jnp.int32)
  metrics = {**terms, 'grad_norm': grad_norm,
             'learning_rate': setup.schedule(state.step - state.bad_steps),
             'skipped': ~finite, 'bad_steps': bad_steps, **moe.metrics(router),
             **norms, **draft_heads.metrics(drafted), **qk_metrics(cfg, router)}
  return grads, router, finite, metrics


def qk_scales(cfg, max_logit_LN):
  """(Wq's [L, N], Wk's [L, K]) factors of QK-clip: a head whose measure m exceeded τ
  (cfg.qk_clip) has its logits scaled by γ = τ / m, the others by 1. A key head serves G query
  heads, so it takes √ of its group's smallest γ and each query head the rest of its own."""
  L, N = max_logit_LN.shape
  G = N // cfg.n_kv_heads
  gamma_LN = cfg.qk_clip / jnp.maximum(max_logit_LN, cfg.qk_clip)
  root_LK = jnp.sqrt(gamma_LN.reshape(L, cfg.n_kv_heads, G).min(axis=-1))
  return gamma_LN / jnp.repeat(root_LK, G, axis=1), root_LK


def qk_clipped(cfg, params, router: dict):
  """The parameters with QK-clip's scales applied to every layer's Wq [D, N, H] and Wk [D, K, H]
  where cfg.qk_clip asks (MuonClip: after the update, so each head this step measured over τ
  starts the next with its logits scaled by τ/m); the layers' measures in execution order over
  the stacks."""
  if not cfg.qk_clip:
    return params
  q_LN, k_LK = qk_scales(cfg, router[MAX_LOGIT])
  first = {'dense_blocks': 0, 'blocks': cfg.dense_layers if cfg.experts else 0}

  def scaled(path, x):
    keys = [getattr(k, 'key', None) for k in path]
    if keys[0] not in first or keys[-2:] not in (['attn', 'wq'], ['attn', 'wk']):
      return x
    start = first[keys[0]]
    factor = (q_LN if keys[-1] == 'wq' else k_LK)[start:start + x.shape[0]]
    return x.replace(x.get_value() * factor[:, None, :, None].astype(x.dtype))
  return jax.tree_util.tree_map_with_path(scaled, params,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


def qk_metrics(cfg, router: dict) -> dict:
  """QK-clip's metrics: the largest measure over layers and heads, and the heads it scales."""
  if MAX_LOGIT not in router:
    return {}
  m = router[MAX_LOGIT]
  return {'qk_max_logit': m.max(), 'qk_clipped_heads': (m > cfg.qk_clip).sum()}


def copy_of_master(setup: Setup) -> bool:
  """Whether the devices' parameters are a compute-dtype copy of master weights kept off them
  (training/tiers.py)."""
  return setup.run.optimizer.tiered and not setup.run.optimizer.master_on_devices


def prefers(setup: Setup) -> bool:
  """Whether the run trains on preference pairs, by DPO's loss."""
  return setup.run.data.preference


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
  loss and bits per byte; on preference records DPO's (training/dpo.py) against `reference`
  (the state's, or None: the frozen base). `microbatches` matter only to pipeline stages (the
  batch runs whole otherwise)."""
  graphdef = setup.graphdef
  if setup.model_cfg.experts:  # every token routed: a score never depends on the batch
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: Transformer(setup.model_cfg.dropless(), rngs=nnx.Rngs(0))))
  scored = (dpo.DPO(setup.run.dpo, setup.graphdef, pipeline_stages(setup) > 1) if prefers(setup)
            else Scored(jnp.asarray(token_bytes_V, jnp.float32)))
  return functools.partial(eval_step, setup, graphdef, scored,
                           microbatches if pipeline_stages(setup) > 1 else 1)


@dataclasses.dataclass(frozen=True)
class Scored:
  """An evaluation's sums of a batch: nats, tokens and the bytes of text they stand for."""
  token_bytes_V: jax.Array

  def prepare(self, params, frozen, reference, batch, microbatches: int):
    return batch

  def sums(self, out, rows) -> dict:
    weights_BL = rows['weights']
    return {'nats': (out.token_losses(rows['targets'])[0] * weights_BL).sum(),
            'tokens': weights_BL.sum(),
            'bytes': (self.token_bytes_V[rows['targets']] * weights_BL).sum()}


def eval_step(setup: Setup, graphdef, scored, microbatches: int, params, reference, batch):
  batch = context_layout(setup, batch)
  with nnx.logical_axis_rules(sharding.activation_rules()):
    batch = scored.prepare(*trained(setup.model_cfg, params), reference, batch, microbatches)
    model = nnx.merge(graphdef, params)
    if pipeline_stages(setup) > 1:
      return model(batch['inputs'], batch['positions'], batch.get('segment_ids'), microbatches,
                   then=scored.sums, rows=batch)[0]
    out, _ = model.output(batch['inputs'], batch['positions'], batch.get('segment_ids'))
    return scored.sums(out, batch)
