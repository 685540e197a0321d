"""AdamW or Muon (`make_muon`: each stacked matrix orthogonalised whole on one device) with
linear warmup, then a cosine decay or warmup-stable-decay, and global-norm clipping (draft heads
clipped apart from the model they draft for, so that they never change how it trains), which
parameters it trains (`trained`: all of them, or under LoRA the adapters), and where its state
lives between steps: the fp32 master weights and each of Adam's moments on the devices (the
compiled step updates them), in host memory, or in files on NVMe (training/tiers.py updates
them outside the step, a group at a time)."""

import itertools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from configs.base import NEWTON_SCHULZ
from model.layers import ADDED, Draft, split_adapters
from model.moe import RouterBias


def make_schedule(opt_config, train_steps: int) -> optax.Schedule:
  """The learning rate at each step: a linear warmup from 0 to learning_rate over warmup_steps,
  then a cosine decay to learning_rate × min_lr_ratio at train_steps, or with schedule 'wsd' the
  peak held until the last decay_fraction of train_steps and a decay (linear, or 1 − √progress)
  to the same floor over them. A wsd run's rate before its decay does not depend on train_steps,
  so one resumed from its plateau with more steps trained as if it had always had them."""
  warmup = min(opt_config.warmup_steps, train_steps)
  peak, floor = opt_config.learning_rate, opt_config.learning_rate * opt_config.min_lr_ratio
  if opt_config.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(train_steps, warmup + 1), end_value=floor)
  start = max(warmup, train_steps - round(opt_config.decay_fraction * train_steps))
  length = max(train_steps - start, 1)

  def decay(step):
    progress = jnp.clip(step / length, 0.0, 1.0)
    left = 1.0 - (jnp.sqrt(progress) if opt_config.decay_shape == 'sqrt' else progress)
    return floor + (peak - floor) * left

  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, max(warmup, 1)), optax.constant_schedule(peak), decay],
      [warmup, start])


def trained(cfg, params):
  """(the parameters the optimizer trains, the frozen rest) of the model `cfg` configures
  (configs.base.ModelConfig): under LoRA the adapters (and draft heads) and the base; with draft_only the
  draft heads and the rest; else all of them and nothing."""
  if cfg.draft_only:
    return split_adapters(params, Draft)
  if cfg.lora_rank:
    return split_adapters(params, ADDED)
  return params, nnx.State({})


def base_params(cfg, params):
  """What a checkpoint or a Hugging Face model supplies at the start: all the parameters, or the
  base's (adapters and draft heads start afresh)."""
  return split_adapters(params, ADDED)[1] if cfg.lora_rank or cfg.draft_heads else params


def decay_mask(params):
  """True for parameters that take weight decay: all but norm scales and the MoE router's
  balancing bias (the model has no other biases). Model parameters are told apart by their
  logical axes and type; bare arrays decay if they are matrices."""
  def decays(x):
    if isinstance(x, nnx.Variable):
      return x.replace('norm' not in (x.out_sharding or ()) and not isinstance(x, RouterBias))
    return x.ndim >= 2
  return jax.tree.map(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def drafts_apart(params):
  """'draft' for the draft heads' parameters (model/draft.py), 'model' for the rest."""
  return jax.tree.map(lambda x: x.replace('draft' if isinstance(x, Draft) else 'model'), params,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(opt_config, schedule, draft_heads: bool = False,
                   shardings=None) -> optax.GradientTransformation:
  """AdamW (or Muon: opt_config.name), after clipping the gradients' global norm to
  opt_config.grad_clip (0: no clipping); with `draft_heads`, the heads' and the rest's each to
  it, so that the heads never change the model's updates. `shardings`: the trained parameters',
  which Muon's updates return to."""
  if opt_config.name == 'muon':
    update = make_muon(opt_config, schedule, shardings)
  else:
    update = make_adamw(opt_config, schedule)
  clip = clipping(opt_config, draft_heads)
  return update if clip is None else optax.chain(clip, update)


# Dimensions of a stack, not of a matrix: each layer's (and expert's) matrix is orthogonalised
# apart, as optax vmaps over them. A matrix's input is the model's width going in, its output the
# model's width coming back (a dense layer's names, then an MoE expert's: model/moe.py).
STACKED = ('layers', 'virtual', 'experts')
INTO, OUT_OF = ('embed', 'expert_embed'), ('embed', 'expert_out')
ADAMW_AXES = ('vocab', 'norm', 'expert_scores')  # the embedding and head, norms, the router


def muon_dimensions(params):
  """For each parameter Muon orthogonalises, which of its dimensions are the matrix's input
  (reduction) and output, by its logical names (model/layers.py, model/moe.py): a projection
  into the model's inside takes its width as input (Wq [embed, heads, head_dim]: the matrix
  [D, N·H]; an expert's W_gate [expert_embed, mlp]), one back gives it as output (Wo, W_down);
  None, AdamW's, for the embedding and head, norms, the router and its bias, LoRA adapters and
  draft heads, and anything not a matrix."""
  def dims(x):
    names = x.out_sharding or () if isinstance(x, nnx.Variable) else ()
    matrix = [i for i, name in enumerate(names) if name not in STACKED]
    if (len(matrix) < 2 or set(names) & set(ADAMW_AXES)
        or isinstance(x, (RouterBias, *ADDED))):
      return None
    if names[matrix[-1]] in OUT_OF:
      return MuonDimensionNumbers(tuple(matrix[:-1]), (matrix[-1],))
    if names[matrix[0]] in INTO:
      return MuonDimensionNumbers((matrix[0],), tuple(matrix[1:]))
    return None
  return jax.tree.map(dims, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_muon(opt_config, schedule, shardings=None) -> optax.GradientTransformation:
  """Muon on the weight matrices muon_dimensions names (scale_by_muon: optax's Nesterov momentum
  and Newton–Schulz, each matrix orthogonalised where opt_config.muon_layout puts it), this run's
  AdamW (make_adamw: no Nesterov, which optax's Muon would give them too) on the rest; every
  update at the schedule's rate and decayed as AdamW's, the matrices' scaled to
  opt_config.muon_rms × √max(fan_in, fan_out) (Moonlight's), so AdamW's learning rate and weight
  decay carry over. `shardings`: the trained parameters' (training/state.py), where the updates
  return to."""
  muon = optax.chain(scale_by_muon(opt_config, shardings),
                     optax.add_decayed_weights(opt_config.weight_decay),
                     optax.scale_by_learning_rate(schedule))

  def labels(params):
    return jax.tree.map(lambda d: 'adam' if d is None else 'muon', muon_dimensions(params),
                        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers))
  return optax.partition({'muon': muon, 'adam': make_adamw(opt_config, schedule)}, labels)


def scale_by_muon(opt_config, shardings=None) -> optax.GradientTransformation:
  """optax.contrib.scale_by_muon's state and formulas, its Nesterov momentum kept in the
  parameters' layout and its Newton–Schulz run on each matrix where `orthogonalised` puts it,
  then each update scaled to AdamW's RMS (`muon_rms`)."""
  beta = opt_config.muon_momentum
  optax_muon = optax.contrib.scale_by_muon(ns_steps=opt_config.muon_ns_steps, beta=beta)
  where = {} if shardings is None else dict(_by_path(shardings))

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                          optax.tree.bias_correction(updates, beta, count))

    is_dims = lambda d: isinstance(d, MuonDimensionNumbers)
    dims_tree = muon_dimensions(mu_hat)
    dims = {jax.tree_util.keystr(path): d for path, d in
            jax.tree_util.tree_flatten_with_path(dims_tree, is_leaf=is_dims)[0]}
    done = orthogonalised_together(dict(_by_path(mu_hat)), dims, where, opt_config)
    updates = jax.tree_util.tree_map_with_path(
        lambda path, d, m: m.replace(done[jax.tree_util.keystr(path)]
                                     * rms_scale(m.shape, d, opt_config.muon_rms)),
        dims_tree, mu_hat, is_leaf=is_dims)
    return updates, optax.contrib.MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)
  return optax.GradientTransformation(optax_muon.init, update)


def orthogonalised_together(values: dict, dims: dict, where: dict, opt_config) -> dict:
  """{path: its matrices orthogonalised} of `values` ({path: a stack of matrices}, `dims` and
  `where` their dimensions and shardings by path). Under round_robin, stacks alike in all but
  their first dimension (a layer stack's W_gate and W_up, Wk and Wv: the same matrices, dims
  and sharding, the first dimension a stack's and split over no devices) are shared out as one,
  so a stack no mesh axis divides pads less or not at all (36 layers twice over 8 devices: 72)."""
  groups = {}
  for path, d in dims.items():
    m, sharding = values[path], where.get(path)
    alike = (opt_config.muon_layout == 'round_robin' and sharding is not None and 0 not in
             set(d.reduction_axis) | set(d.output_axis) and not _split_first(sharding))
    key = (d, m.shape[1:], m.dtype, sharding) if alike else path
    groups.setdefault(key, []).append(path)
  done = {}
  for paths in groups.values():
    stacked = values[paths[0]] if len(paths) == 1 else jnp.concatenate(
        [values[p] for p in paths])
    result = orthogonalised(stacked, dims[paths[0]], opt_config, where.get(paths[0]))
    ends = list(itertools.accumulate(values[p].shape[0] for p in paths))
    done.update(zip(paths, jnp.split(result, ends[:-1])))
  return done


def _split_first(sharding) -> bool:
  """Whether `sharding` splits its first dimension over more than one device."""
  first = sharding.spec[0] if len(sharding.spec) else None
  axes = (first,) if isinstance(first, str) else (first or ())
  return math.prod(sharding.mesh.shape[a] for a in axes) > 1


def _by_path(tree):
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    yield jax.tree_util.keystr(path), leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def rms_scale(shape, dims: MuonDimensionNumbers, rms: float) -> float:
  """rms × √max(fan_in, fan_out): an orthogonalised update's RMS made AdamW's (Moonlight's); with
  rms 0, Keller Jordan's √max(1, fan_out/fan_in) (optax's scale_by_shape, both)."""
  fan_in = math.prod(shape[a] for a in dims.reduction_axis)
  fan_out = math.prod(shape[a] for a in dims.output_axis)
  return rms * math.sqrt(max(fan_in, fan_out)) if rms else math.sqrt(max(1, fan_out / fan_in))


def orthogonalised(m, dims: MuonDimensionNumbers, opt_config, sharding=None) -> jax.Array:
  """Newton–Schulz's orthogonalisation of each matrix of `m` (a stack of them: dims name a
  matrix's input and output, the rest stack them), in opt_config.muon_ns_dtype, by optax's
  scale_by_muon without momentum. With muon_layout 'round_robin' and `sharding` over devices,
  first moved so that each device holds a share of the matrices whole (`whole_layout`), and the
  results back to `sharding`: each matrix orthogonalised once, on one device, where 'as_params'
  leaves XLA to partition it over the parameter's own shards (operands gathered and partial sums
  all-reduced in every iteration: benchmarks/muon.py)."""
  x = m.astype(opt_config.muon_ns_dtype)
  steps, pads = [], None
  if opt_config.muon_layout == 'round_robin' and sharding is not None and sharding.num_devices > 1:
    steps, pads = whole_layout(m.shape, dims, sharding)
  if steps:  # one mesh axis at a time: each move an all-to-all (two at once XLA gathers whole)
    x = jnp.pad(jax.lax.with_sharding_constraint(x, sharding), pads)  # cast where it lies
    for step in steps:
      x = jax.lax.with_sharding_constraint(x, step)
  ns = optax.contrib.scale_by_muon(ns_steps=opt_config.muon_ns_steps, beta=0.0, nesterov=False,
                                   weight_dimension_numbers=dims)  # momentum 0: x itself
  with jax.named_scope(NEWTON_SCHULZ):  # the plan's row of its kernels (planning/plan.py)
    y, _ = ns.update(x, ns.init(x))
  if steps:  # back in muon_ns_dtype, then the zero matrices dropped
    for step in [*reversed(steps), sharding]:
      y = jax.lax.with_sharding_constraint(y, step)
    y = jax.lax.with_sharding_constraint(y[tuple(slice(0, n) for n in m.shape)], sharding)
  return y.astype(m.dtype)


def whole_layout(shape, dims: MuonDimensionNumbers, sharding):
  """(the shardings that take a stack of matrices from `sharding` to each matrix whole on one
  device, a mesh axis moved at a time, and the padding of each dimension that needs): a stack's
  dimensions (layers, experts) keep their own mesh axes (a pipeline's stage, an MoE's expert)
  and take every other mesh axis of more than one device (the matrix's, the innermost of a
  dimension first, then those it is replicated over), each on the first stack dimension it
  divides; those left over split the first stack dimension too, padded with zero matrices to a
  multiple of its devices. Where it has mesh axes of its own (a pipeline's stage) those left over
  stay: a matrix's split over one as XLA partitions it, and the devices along one it is
  replicated over orthogonalise the same matrices. No shardings where no mesh axis moves."""
  mesh = sharding.mesh
  named = lambda axes: [axes] if isinstance(axes, str) else list(axes or ())
  padded = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  spec = [named(a) for a in padded]
  matrix = set(dims.reduction_axis) | set(dims.output_axis)
  stack = [d for d in range(len(shape)) if d not in matrix]
  if not stack:
    return [], None
  own_first = any(mesh.shape[a] > 1 for a in spec[stack[0]])  # a pipeline's stage, say
  held = {a for axes in spec for a in axes}
  movable = [(d, a) for d in sorted(matrix) for a in reversed(spec[d]) if mesh.shape[a] > 1]
  movable += [(None, a) for a in mesh.axis_names if mesh.shape[a] > 1 and a not in held]
  split = lambda d: math.prod(mesh.shape[a] for a in spec[d])
  moves, left = [], []
  for source, name in movable:
    fits = [d for d in stack if (shape[d] // split(d)) % mesh.shape[name] == 0]
    if fits:
      moves.append((source, name, fits[0]))
      spec[fits[0]].append(name)  # (so later axes see this dimension's split)
    else:
      left.append((source, name))
  pads = [(0, 0)] * len(shape)
  if left and not own_first:
    first = stack[0]
    pads[first] = (0, -shape[first] % (split(first) * math.prod(mesh.shape[a] for _, a in left)))
    moves += [(source, name, first) for source, name in left]
  steps, spec = [], [named(a) for a in padded]  # the moves made in turn, from the start
  for source, name, target in moves:
    if source is not None:
      spec[source].remove(name)
    spec[target].append(name)
    steps.append(NamedSharding(mesh, P(*[tuple(axes) or None for axes in spec])))
  return steps, pads


def make_adamw(opt_config, schedule, mask=decay_mask) -> optax.GradientTransformation:
  """AdamW alone: elementwise, so training/tiers.py runs it a group of the state at a time
  (`mask` then that group's decay_mask)."""
  return optax.adamw(schedule, b1=opt_config.b1, b2=opt_config.b2, eps=opt_config.eps,
                     weight_decay=opt_config.weight_decay, mask=mask)


def clipping(opt_config, draft_heads: bool = False) -> optax.GradientTransformation | None:
  """The global-norm clipping that comes before AdamW (stateless), or None without it."""
  if opt_config.grad_clip <= 0:
    return None
  clip = optax.clip_by_global_norm(opt_config.grad_clip)
  if draft_heads:
    clip = optax.multi_transform({'model': clip, 'draft': clip}, drafts_apart)
  return clip
