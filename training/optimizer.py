"""AdamW with linear warmup + cosine decay and global-norm clipping (draft heads clipped apart
from the model they draft for, so that they never change how it trains)."""

import dataclasses

import jax
import optax
from flax import nnx

from model.layers import Draft
from model.moe import RouterBias


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """config.optimizer (configs/base.py says what each does)."""
  learning_rate: float
  warmup_steps: int
  min_lr_ratio: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  grad_clip: float
  offload_state: bool


def make_schedule(opt_config, train_steps: int) -> optax.Schedule:
  warmup = min(opt_config.warmup_steps, train_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt_config.learning_rate, warmup_steps=warmup,
      decay_steps=max(train_steps, warmup + 1),
      end_value=opt_config.learning_rate * opt_config.min_lr_ratio)


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
  """AdamW, after clipping the gradients' global norm to opt_config.grad_clip (0: no clipping);
  with `draft_heads`, the heads' and the rest's each to it, so that the heads never change the
  model's updates."""
  adamw = optax.adamw(schedule, b1=opt_config.b1, b2=opt_config.b2, eps=opt_config.eps,
                      weight_decay=opt_config.weight_decay, mask=decay_mask)
  if opt_config.grad_clip <= 0:
    return adamw
  clip = optax.clip_by_global_norm(opt_config.grad_clip)
  if draft_heads:
    clip = optax.multi_transform({'model': clip, 'draft': clip}, drafts_apart)
  return optax.chain(clip, adamw)
