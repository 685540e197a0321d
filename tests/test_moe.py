"""Mixture-of-experts layers (model/moe.py): a layer equals a loop over its experts, values and
gradients; dropless routing keeps every assignment and a capacity drops the ones a NumPy rule
says; the router's losses are their formulas; the balancing bias moves as DeepSeek-V3's rule
says; over an expert axis the experts drop only what a capacity or their buffer says; and a tiny
MoE trains on meshes of expert with fsdp, tensor and stage as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data import chat, tokenizers, tokens
from model import ModelConfig, moe
from model.layers import MLP
from model.transformer import Transformer
from sharding import collectives
import sharding
from tests.conftest import tiny_config
from training import loop, programs
from training.hooks import scalars
from training import settings
from training.state import build

E, K = 4, 2


def moe_config(**mesh):
  config = tiny_config(**mesh)
  config.model.update(experts=E, experts_per_token=K, expert_d_ff=32)
  return config


def layer(**fields):
  model = moe_config().model
  model.update(fields)
  return moe.MoE(ModelConfig.from_config(model), nnx.Rngs(0))


def loop_reference(layer, x_BLD, dropped_Tk=None):
  """Σ over experts e of (the weight the router gave e) · SwiGLU_e(x), every token through every
  expert, in plain jnp: no sorting, no kernel."""
  cfg = layer.cfg
  x_TD = x_BLD.reshape(-1, cfg.d_model)
  logits_TE = x_TD @ layer.router[...]
  bias = layer.router_bias[...] if cfg.router == 'sigmoid' else None
  weights_Tk, experts_Tk, _ = moe.route(logits_TE, bias, cfg.experts_per_token, cfg.router,
                                        cfg.router_renormalize)
  if dropped_Tk is not None:
    weights_Tk = jnp.where(dropped_Tk, 0.0, weights_Tk)
  y_TD = jnp.zeros_like(x_TD)
  for e in range(cfg.experts):
    h_TF = jax.nn.silu(x_TD @ layer.w_gate[e]) * (x_TD @ layer.w_up[e])
    share_T = jnp.where(experts_Tk == e, weights_Tk, 0.0).sum(axis=1)
    y_TD = y_TD + share_T[:, None] * (h_TF @ layer.w_down[e])
  if cfg.shared_experts:
    y_TD = y_TD + layer.shared(x_TD[None])[0]
  return y_TD.reshape(x_BLD.shape)


def value_and_grads(fn, module, x_BLD):
  graphdef, params = nnx.split(module)
  def loss(params, x_BLD):
    y_BLD = fn(nnx.merge(graphdef, params), x_BLD)
    return jnp.sum(y_BLD * jnp.cos(jnp.arange(y_BLD.size).reshape(y_BLD.shape))), y_BLD
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x_BLD)


@pytest.mark.integration
@pytest.mark.parametrize('fields', [
    dict(router='softmax', shared_experts=1),
    # One expert's bias far below the others': its group is empty.
    dict(router='sigmoid', router_renormalize=False, router_bias_rate=1e-3),
], ids=['softmax+shared', 'sigmoid+empty expert'])
def test_an_moe_layer_equals_a_loop_over_its_experts(fields):
  module = layer(**fields)
  if fields['router'] == 'sigmoid':
    module.router_bias[...] = jnp.array([0.0, 0.0, 0.0, -10.0])
  x_BLD = jax.random.normal(jax.random.key(1), (2, 24, 64))
  (_, y), grads = value_and_grads(lambda m, x: m(x)[0], module, x_BLD)
  (_, y_ref), grads_ref = value_and_grads(loop_reference, module, x_BLD)
  logits_TE = x_BLD.reshape(-1, 64) @ module.router[...]
  bias = module.router_bias[...] if fields['router'] == 'sigmoid' else None
  chosen = moe.route(logits_TE, bias, K, module.cfg.router, module.cfg.router_renormalize)[1]
  sizes = np.bincount(np.asarray(chosen).ravel(), minlength=E)
  assert len(set(sizes)) > 1  # ragged
  assert (sizes[3] == 0) == (fields['router'] == 'sigmoid')
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def numpy_kept(experts_Tk, n_experts, cap):
  """The first `cap` assignments of each expert in token order are kept."""
  seen, kept = np.zeros(n_experts, int), np.zeros(experts_Tk.shape, bool)
  for t, j in np.ndindex(*experts_Tk.shape):
    e = experts_Tk[t, j]
    kept[t, j] = seen[e] < cap
    seen[e] += 1
  return kept


@pytest.mark.integration
def test_dropless_keeps_every_assignment_and_a_capacity_drops_what_numpy_says():
  experts_Tk = np.array(jax.random.randint(jax.random.key(2), (48, K), 0, E))
  experts_Tk[:, 1] = (experts_Tk[:, 0] + 1) % E  # two different experts a token
  order, inverse, sizes = moe.dispatch(jnp.asarray(experts_Tk), E, None)
  assert sizes.sum() == experts_Tk.size and (np.asarray(inverse) < int(sizes.sum())).all()
  np.testing.assert_array_equal(np.sort(order), np.arange(experts_Tk.size))
  np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(96))
  assert (np.diff(experts_Tk.ravel()[np.asarray(order)]) >= 0).all()  # sorted by expert

  cap = moe.capacity(48, K, E, 0.75)
  assert cap == 18
  expected = numpy_kept(experts_Tk, E, cap)
  assert 0 < (~expected).sum()
  _, inverse, sizes = moe.dispatch(jnp.asarray(experts_Tk), E, cap)
  np.testing.assert_array_equal((np.asarray(inverse) < int(sizes.sum())).reshape(48, K), expected)

  module = layer(capacity_factor=0.75)
  x_BLD = jax.random.normal(jax.random.key(3), (2, 24, 64))
  y_BLD, stats = module(x_BLD)
  logits_TE = x_BLD.reshape(-1, 64) @ module.router[...]
  chosen = np.asarray(moe.route(logits_TE, None, K, 'softmax', True)[1])
  dropped = ~numpy_kept(chosen, E, moe.capacity(48, K, E, 0.75))
  assert dropped.any()
  assert float(stats['dropped']) == pytest.approx(dropped.mean())
  np.testing.assert_allclose(y_BLD, loop_reference(module, x_BLD, dropped), rtol=1e-5,
                             atol=1e-5)


def numpy_taken(experts_Tk, devices: int, rows: int):
  """Which assignments `devices` expert devices in a row take into buffers of `rows` rows, their
  tokens split into equal consecutive slices: each takes its sources' rows in source order,
  each source's in expert then token order, and drops those past `rows`."""
  T = experts_Tk.shape[0]
  t, E_l = T // devices, E // devices
  taken = np.ones(experts_Tk.shape, bool)
  for j in range(devices):
    used = 0
    for s in range(devices):
      for e in range(j * E_l, (j + 1) * E_l):
        for token, slot in zip(*np.nonzero(experts_Tk[s * t:(s + 1) * t] == e)):
          taken[s * t + token, slot] = used < rows
          used += 1
  return taken


def over_expert_4(module, x_BLD):
  """(output, gradients, share dropped, compiled HLO) of `module` over data=2 × expert=4."""
  def on_mesh(m, x_BLD):
    with nnx.logical_axis_rules(sharding.ACTIVATION_RULES):
      return m(x_BLD)

  with jax.set_mesh(sharding.make_mesh(tiny_config(data=2, expert=4).mesh)):
    (_, y), grads = value_and_grads(lambda m, x: on_mesh(m, x)[0], module, x_BLD)
    forward = jax.jit(lambda x: on_mesh(module, x))
    return y, grads, forward(x_BLD)[1]['dropped'], forward.lower(x_BLD).compile().as_text()


@pytest.mark.integration
@pytest.mark.parametrize('field', ['capacity_factor', 'expert_buffer'])
def test_experts_over_an_expert_axis_drop_only_what_a_capacity_or_buffer_says(field):
  """Over data=2 × expert=4: the output and every gradient equal the loop over experts with
  exactly the assignments dropped that per-device capacity, or the experts' devices' buffers
  (A rows each, as many as a balanced load sends), leave out; the tokens move by all-to-all
  within each data group of 4."""
  module = layer(expert_matmul='ragged_dot', **{field: 1.0})
  x_BLD = jax.random.normal(jax.random.key(4), (8, 6, 64))
  logits_TE = x_BLD.reshape(-1, 64) @ module.router[...]
  chosen = np.asarray(moe.route(logits_TE, None, K, 'softmax', True)[1])
  t = 6  # tokens a device
  if field == 'capacity_factor':
    cap = moe.capacity(t, K, E, 1.0)
    taken = np.concatenate([numpy_kept(chosen[i:i + t], E, cap) for i in range(0, 48, t)])
  else:
    taken = np.concatenate([numpy_taken(chosen[g:g + 4 * t], 4, t * K) for g in (0, 24)])
  assert 0 < (~taken).sum()
  y, grads, dropped, hlo = over_expert_4(module, x_BLD)
  (_, y_ref), grads_ref = value_and_grads(lambda m, x: loop_reference(m, x, ~taken), module, x_BLD)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  exchanges = [c for c in collectives.executed(hlo) if c.op == 'all-to-all'
               and c.arrays[0][1][-1] == 64]
  assert len(exchanges) == 2 and all(c.devices == ((0, 1, 2, 3), (4, 5, 6, 7)) for c in exchanges)
  assert float(dropped) == pytest.approx((~taken).mean())


@pytest.mark.integration
def test_dropless_over_an_expert_axis_holds_the_worst_case_and_no_more():
  """Over data=2 × expert=4, one expert a device and two a token: every token choosing expert 0
  sends device 0 one row from each token of each source, the most it can receive (a token's
  experts are distinct), so its buffer holds P·t rows, not P·t·k, and drops none: the output
  and every gradient equal the loop over experts."""
  module = layer(expert_matmul='ragged_dot')
  module.router[...] = module.router[...].at[0, 0].set(50.0)
  x_BLD = jax.random.normal(jax.random.key(5), (8, 6, 64)).at[..., 0].set(4.0)
  chosen = np.asarray(moe.route(x_BLD.reshape(-1, 64) @ module.router[...], None, K, 'softmax',
                                True)[1])
  assert (chosen == 0).any(axis=1).all()  # every token sends expert 0 a row
  y, grads, dropped, hlo = over_expert_4(module, x_BLD)
  assert float(dropped) == 0
  (_, y_ref), grads_ref = value_and_grads(loop_reference, module, x_BLD)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  t = 6  # tokens a device: each sends each device at most t rows, [P, t, D] padded on a CPU
  exchanges = [c.arrays[0][1] for c in collectives.executed(hlo) if c.op == 'all-to-all'
               and c.arrays[0][1][-1] == 64]
  assert exchanges and all(shape[-2:] == (t, 64) for shape in exchanges), exchanges


def test_the_router_losses_are_their_formulas():
  module = layer()
  x_BLD = jax.random.normal(jax.random.key(4), (2, 24, 64))
  stats = module(x_BLD)[1]
  logits = np.asarray(x_BLD.reshape(-1, 64) @ module.router[...], np.float64)
  probs = np.exp(logits - logits.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  top = np.argsort(-probs, axis=1)[:, :K]
  f = np.bincount(top.ravel(), minlength=E) / top.size
  np.testing.assert_allclose(stats['tokens_per_expert'], f, rtol=1e-6)
  np.testing.assert_allclose(stats['load_balance'], E * np.sum(f * probs.mean(0)), rtol=1e-5)
  logz = np.log(np.exp(logits).sum(1))
  np.testing.assert_allclose(stats['router_z'], np.mean(logz ** 2), rtol=1e-5)
  config = moe_config().model
  cfg = ModelConfig.from_config(config)
  stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), stats)
  np.testing.assert_allclose(
      moe.aux_loss(stacked, cfg), 1.5 * (cfg.load_balance_loss * stats['load_balance']
                                         + cfg.router_z_loss * stats['router_z']), rtol=1e-6)


@pytest.mark.integration
def test_a_sigmoid_routers_bias_moves_toward_balance_and_not_by_its_gradient():
  config = moe_config()
  config.model.update(router='sigmoid', router_bias_rate=0.01)
  setup = build(settings.resolve(config, jax.devices()[:1]))
  state = setup.init_state()
  batch = {k: np.zeros((8, 32), v) for k, v in programs.BATCH_KEYS.items()}
  batch['inputs'] = batch['targets'] = np.arange(256).reshape(8, 32) % 97
  batch['weights'][:] = 1
  step = programs.compile_train_step(setup, 8, 32, 0.0)
  new, metrics = step(state, batch)
  f = np.asarray(metrics['moe_tokens_per_expert'])
  assert f.sum() == pytest.approx(1.0) and len(set(np.round(f, 6))) > 1
  bias = np.asarray(new.params['blocks']['mlp']['router_bias'][...])
  assert bias.shape == (2, E)
  # Each layer's own loads: its row moves by ±rate only, by the sign of (1/E − its share).
  np.testing.assert_allclose(np.abs(bias), 0.01)
  assert (bias > 0).any(axis=1).all() and (bias < 0).any(axis=1).all()  # busy down, idle up
  # Experts busier than their share on average moved down in at least one layer.
  assert (bias[:, f > 1 / E] < 0).any(axis=0).all()
  assert {'moe_tokens_per_expert/0', 'moe_load_balance', 'moe_max_load'} <= set(
      scalars(jax.device_get(metrics)))


# With the layer test over data=2 × expert=4 (above), the expert axis meets every other axis.
MESHES = {'expert=4×fsdp=2': dict(expert=4, fsdp=2),
          'stage=2×expert=2×tensor=2': dict(stage=2, expert=2, tensor=2)}
STEPS = {'expert=4×fsdp=2': 20}  # the others: SHORT
SHORT = 4


def train(config, devices, corpus, steps: int, keep=()):
  """(curve [steps, metrics], {step: parameters as NumPy} for the steps in `keep`)."""
  run = settings.resolve(config, devices)
  setup = build(run)
  state = setup.init_state()
  step = programs.compile_train_step(setup, config.batch_size, config.seq_len, config.loss.z_loss,
                                     microbatches=config.microbatches)
  byte = tokenizers.ByteTokenizer()
  batches = loop.train_batches(run, tokens.OnTheFly(corpus.train, 'text', chat.Encoder(byte)),
                                   sharding.batch_sharding(setup.mesh))
  curve, kept = [], {}
  for i in range(1, steps + 1):
    state, metrics = step(state, next(batches))
    curve.append([float(metrics[k]) for k in ('loss', 'grad_norm', 'moe_load_balance',
                                              'moe_router_z') if k in metrics])
    if i in keep:
      kept[i] = [np.asarray(p) for p in jax.tree.leaves(state.params)]
  return np.array(curve), kept


def mesh_config(**mesh):
  config = moe_config(**mesh)
  config.microbatches, config.batch_size = 2, 16
  return config


@pytest.fixture(scope='module')
def one_device(small_corpus):
  steps = max(STEPS.values())
  return train(mesh_config(), jax.devices()[:1], small_corpus, steps, keep={SHORT, steps})


def test_w_down_is_split_along_its_width_by_tensor_then_fsdp():
  """W_down[layers, E, F, D] lives as F_(tensor, fsdp, sequence) (sharding/rules.py): each device
  holds its tensor share's fsdp slice of the width and the whole model dimension, W_gate its
  fsdp share of D. Checked on the actual shards."""
  config = moe_config(expert=2, fsdp=2, tensor=2)
  setup = build(settings.resolve(config, jax.devices()))
  mlp = setup.init_state().params['blocks']['mlp']
  w_down, w_gate = mlp['w_down'][...], mlp['w_gate'][...]
  L, E, F, D = w_down.shape
  mesh = setup.mesh
  for shard in w_down.addressable_shards:
    assert shard.data.shape == (L, E // 2, F // 4, D)
    coords = {axis: int(np.argwhere(mesh.devices == shard.device)[0][i])
              for i, axis in enumerate(mesh.axis_names)}
    part = coords['tensor'] * 2 + coords['fsdp']
    assert shard.index[2] == slice(part * F // 4, (part + 1) * F // 4)
    np.testing.assert_array_equal(shard.data, np.asarray(w_down)[shard.index])
  assert {s.data.shape for s in w_gate.addressable_shards} == {(L, E // 2, D // 2, F // 2)}


@pytest.mark.integration
@pytest.mark.parametrize('name', list(MESHES))
def test_a_tiny_moe_trains_on_a_mesh_as_on_one_device(name, one_device, small_corpus):
  """Losses, gradient norms, router losses and parameters; two microbatches, each with its own
  router losses, averaged; 20 steps over expert=4 × fsdp=2, 4 over the others."""
  ref_curve, ref_params = one_device
  config = mesh_config(**MESHES[name])
  if config.mesh.stage > 1:  # interpret mode cannot run in a stage; GPUs compile ours there
    config.model.expert_matmul = 'ragged_dot'
  steps = STEPS.get(name, SHORT)
  curve, params = train(config, jax.devices(), small_corpus, steps, keep={steps})
  assert ref_curve[steps - 1, 0] < ref_curve[0, 0]
  np.testing.assert_allclose(curve, ref_curve[:steps], rtol=2e-5, atol=1e-6)
  for a, b in zip(params[steps], ref_params[steps]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_our_kernel_in_pipeline_stages_off_gpus_is_refused_naming_the_fix():
  config = moe_config(stage=2, fsdp=4)
  config.microbatches = 2
  with pytest.raises(ValueError, match='use --config.model.expert_matmul=ragged_dot here'):
    build(settings.resolve(config))


@pytest.mark.parametrize('fields, message', [
    (dict(matmul_precision='fp8'), "matmul_precision='fp8' has no form for the experts"),
    (dict(router_bias_rate=0.001), "router_bias_rate=0.001 must be 0, or positive with"),
    (dict(expert_d_ff=40), 'must be multiples of 16 for the grouped-matmul kernel'),
    (dict(experts_per_token=5), 'experts_per_token=5 must be between 1 and'),
    (dict(dense_layers=2), 'dense_layers=2 leaves no MoE layer'),
])
def test_moe_settings_that_cannot_work_are_refused_naming_the_setting(fields, message):
  config = moe_config().model
  config.update(fields)
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_config(config)


@pytest.mark.integration
def test_first_dense_layers_are_a_stack_of_their_own_and_decode_as_the_forward():
  config = moe_config().model
  config.update(n_layers=3, dense_layers=1, expert_matmul='ragged_dot')  # the kernel: above
  cfg = ModelConfig.from_config(config)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  assert isinstance(model.dense_blocks.mlp, MLP)
  assert isinstance(model.blocks.mlp, moe.MoE)
  assert model.dense_blocks.mlp.w_gate.shape == (1, 64, 128)
  tokens_BL = jax.random.randint(jax.random.key(5), (2, 12), 0, 384)
  logits = model(tokens_BL)
  cache = model.init_cache(2, 12)
  step_logits, _ = model.decode(tokens_BL, jnp.broadcast_to(jnp.arange(12), (2, 12)), cache)
  np.testing.assert_allclose(step_logits, logits, rtol=1e-4, atol=1e-4)
