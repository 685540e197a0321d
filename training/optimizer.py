"""AdamW with linear warmup + cosine decay and global-norm clipping."""

import jax
import optax
from flax import nnx

from model.moe import RouterBias


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


def make_optimizer(opt_config, schedule) -> optax.GradientTransformation:
  adamw = optax.adamw(schedule, b1=opt_config.b1, b2=opt_config.b2, eps=opt_config.eps,
                      weight_decay=opt_config.weight_decay, mask=decay_mask)
  if opt_config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(opt_config.grad_clip), adamw)
  return adamw
