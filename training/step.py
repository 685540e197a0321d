"""The compiled train and eval steps: one jit each, explicit shardings, donated state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sharding
from training.state import Setup, TrainState

BATCH_KEYS = {'inputs': np.int32, 'targets': np.int32, 'positions': np.int32,
              'segment_ids': np.int32, 'weights': np.float32}
UNPACKED_KEYS = {k: v for k, v in BATCH_KEYS.items() if k != 'segment_ids'}  # one document a row


def token_nll(logits_BLV, targets_BL):
  """Per-token negative log-likelihood of the targets, and log Z."""
  logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  return logz_BL - target_logit_BL, logz_BL


def cross_entropy(logits_BLV, targets_BL, weights_BL, z_loss: float):
  """Mean next-token cross-entropy over weighted tokens, and the z-loss z_loss·mean(log Z)²."""
  nll_BL, logz_BL = token_nll(logits_BLV, targets_BL)
  total = jnp.maximum(weights_BL.sum(), 1.0)
  ce = (nll_BL * weights_BL).sum() / total
  return ce, z_loss * (jnp.square(logz_BL) * weights_BL).sum() / total


def _logits(graphdef, params, batch):
  # Activations are pinned through ACTIVATION_RULES while the model is traced.
  with nnx.logical_axis_rules(sharding.ACTIVATION_RULES):
    model = nnx.merge(graphdef, params)
    # A batch without segment ids holds one document a row (no packing mask to apply).
    return model(batch['inputs'], batch['positions'], batch.get('segment_ids'))


def _loss(graphdef, params, batch, z_loss):
  ce, zl = cross_entropy(_logits(graphdef, params, batch), batch['targets'], batch['weights'],
                         z_loss)
  return ce + zl, (ce, zl)


def make_train_step(setup: Setup, z_loss: float):
  def train_step(state: TrainState, batch):
    grad_fn = jax.value_and_grad(lambda p: _loss(setup.graphdef, p, batch, z_loss), has_aux=True)
    (loss, (ce, zl)), grads = grad_fn(state.params)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = setup.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A step whose loss or gradient is not finite is not applied: parameters and optimizer state
    # (its step count too, so the schedule waits) stay as they were. The selects fuse into the
    # update's elementwise loops, so they cost no extra memory.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    bad_steps = state.bad_steps + jnp.where(finite, 0, 1).astype(jnp.int32)
    metrics = {'loss': ce, 'z_loss': zl, 'grad_norm': grad_norm,
               'learning_rate': setup.schedule(state.step - state.bad_steps),
               'skipped': ~finite, 'bad_steps': bad_steps}
    return TrainState(step=state.step + 1, params=keep_if_bad(params, state.params),
                      opt_state=keep_if_bad(opt_state, state.opt_state),
                      bad_steps=bad_steps), metrics
  return train_step


def make_eval_step(setup: Setup, token_bytes_V):
  """Sums over the batch's weighted targets: nats, tokens, and the bytes of text they stand for
  (`token_bytes_V[id]`, from the tokenizer), so a pass can report loss and bits per byte."""
  token_bytes_V = jnp.asarray(token_bytes_V, jnp.float32)

  def eval_step(params, batch):
    nll_BL, _ = token_nll(_logits(setup.graphdef, params, batch), batch['targets'])
    weights_BL = batch['weights']
    return {'nats': (nll_BL * weights_BL).sum(), 'tokens': weights_BL.sum(),
            'bytes': (token_bytes_V[batch['targets']] * weights_BL).sum()}
  return eval_step


def abstract_batch(mesh, batch_size: int, seq_len: int, packed: bool = True) -> dict:
  s = sharding.batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((batch_size, seq_len), dt, sharding=s)
          for k, dt in (BATCH_KEYS if packed else UNPACKED_KEYS).items()}


def compile_train_step(setup: Setup, batch_size: int, seq_len: int, z_loss: float,
                       packed: bool = True):
  """Ahead-of-time compiled train step: (state, batch) → (state, metrics); state is donated.
  `packed=False` compiles for batches without segment ids (one document a row)."""
  batch = abstract_batch(setup.mesh, batch_size, seq_len, packed)
  jitted = jax.jit(make_train_step(setup, z_loss),
                   in_shardings=(setup.state_shardings, jax.tree.map(lambda x: x.sharding, batch)),
                   out_shardings=(setup.state_shardings, sharding.replicated(setup.mesh)),
                   donate_argnums=0)
  with jax.set_mesh(setup.mesh):
    return jitted.lower(setup.abstract_state, batch).compile()


def compile_eval_step(setup: Setup, batch_size: int, seq_len: int, token_bytes_V):
  batch = abstract_batch(setup.mesh, batch_size, seq_len)
  jitted = jax.jit(make_eval_step(setup, token_bytes_V),
                   in_shardings=(setup.state_shardings.params,
                                 jax.tree.map(lambda x: x.sharding, batch)),
                   out_shardings=sharding.replicated(setup.mesh))
  with jax.set_mesh(setup.mesh):
    return jitted.lower(setup.abstract_state.params, batch).compile()
