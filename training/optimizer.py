"""AdamW or Muon (`make_muon`) with linear warmup, then a cosine decay or warmup-stable-decay, and
global-norm clipping (draft heads clipped apart
from the model they draft for, so that they never change how it trains), which parameters it
trains (`trained`: all of them, or under LoRA the adapters), and where its state
lives between steps: the fp32 master weights and each of Adam's moments on the devices (the
compiled step updates them), in host memory, or in files on NVMe (training/tiers.py updates
them outside the step, a group at a time)."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

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


def make_optimizer(opt_config, schedule, draft_heads: bool = False) -> optax.GradientTransformation:
  """AdamW (or Muon: opt_config.name), after clipping the gradients' global norm to
  opt_config.grad_clip (0: no clipping); with `draft_heads`, the heads' and the rest's each to
  it, so that the heads never change the model's updates."""
  update = (make_muon if opt_config.name == 'muon' else make_adamw)(opt_config, schedule)
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


def make_muon(opt_config, schedule) -> optax.GradientTransformation:
  """Muon (optax.contrib.muon, Nesterov momentum) on the weight matrices muon_dimensions names,
  this run's AdamW (make_adamw: no Nesterov, which optax's Muon would give them too) on the rest;
  every update at the schedule's rate and decayed as AdamW's, the matrices' scaled to
  opt_config.muon_rms × √max(fan_in, fan_out) (Moonlight's), so AdamW's learning rate and weight
  decay carry over."""
  muon = optax.contrib.muon(
      schedule, ns_steps=opt_config.muon_ns_steps, beta=opt_config.muon_momentum,
      weight_decay=opt_config.weight_decay, muon_weight_dimension_numbers=muon_dimensions,
      consistent_rms=opt_config.muon_rms or None)

  def labels(params):
    return jax.tree.map(lambda d: 'adam' if d is None else 'muon', muon_dimensions(params),
                        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers))
  return optax.partition({'muon': muon, 'adam': make_adamw(opt_config, schedule)}, labels)


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
