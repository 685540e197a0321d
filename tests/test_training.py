"""Loss, optimizer, the loop's outputs, and bad configs failing early with the field named."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import head
from tests.conftest import tiny_config
from training import loop, optimizer
from training import settings
from training.optimizer import trained
from training.state import build
from training.step import loss_sums

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_losses_sums_are_the_weighted_nll_and_log_z_squared():
  """What the step divides by the batch's weight: the loss (the cross-entropy's and the
  z-loss's sums) and its parts, from the head's logits, chunked (the last chunk ragged)."""
  from types import SimpleNamespace
  x = jax.random.normal(jax.random.key(0), (2, 3, 4))
  w = jax.random.normal(jax.random.key(1), (4, 5))
  targets = jnp.array([[0, 1, 2], [3, 4, 0]])
  weights = jnp.array([[1, 1, 0], [1, 0, 1]], jnp.float32)
  out = SimpleNamespace(
      loss_sums=lambda t, wt, z: head.loss_sums(x, w, w, t, wt, tied=False, chunk=4, z_loss=z),
      model=SimpleNamespace(cfg=SimpleNamespace(draft_heads=0)))
  sums = loss_sums(out, {'targets': targets, 'weights': weights}, z_loss=0.5)
  logits = np.einsum('bld,dv->blv', x, w)
  logp = jax.nn.log_softmax(logits)
  nll = -np.take_along_axis(np.asarray(logp), np.asarray(targets)[..., None], -1)[..., 0]
  np.testing.assert_allclose(sums['nats'], (nll * weights).sum(), rtol=1e-6)
  logz = jax.nn.logsumexp(logits, -1)
  np.testing.assert_allclose(sums['log_z2'], (logz ** 2 * weights).sum(), rtol=1e-6)
  np.testing.assert_allclose(sums['loss'], sums['nats'] + 0.5 * sums['log_z2'], rtol=1e-6)


def test_weight_decay_skips_norm_scales_only():
  setup = build(settings.resolve(tiny_config(fsdp=8)))
  mask = optimizer.decay_mask(setup.abstract_state.params)
  flat = {jax.tree_util.keystr(p): bool(v) for p, v in jax.tree_util.tree_leaves_with_path(mask)}
  assert {k for k, v in flat.items() if not v} == {
      "['blocks']['attn_norm']['scale'].value", "['blocks']['mlp_norm']['scale'].value",
      "['final_norm']['scale'].value"}
  assert sum(flat.values()) == 9


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
  c = tiny_config()
  c.optimizer.learning_rate, c.optimizer.warmup_steps, c.optimizer.min_lr_ratio = 1.0, 10, 0.1
  schedule = optimizer.make_schedule(c.optimizer, 100)
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 0.5, 1.0], atol=1e-6)
  np.testing.assert_allclose(schedule(100), 0.1, atol=1e-6)
  assert schedule(50) > schedule(80) > schedule(100)


@pytest.mark.parametrize('shape', ['linear', 'sqrt'])
def test_warmup_stable_decay_holds_its_peak_then_decays_as_its_formula_and_extends_from_the_plateau(
    shape):
  c = tiny_config()
  c.optimizer.update(learning_rate=2.0, warmup_steps=10, min_lr_ratio=0.1, schedule='wsd',
                     decay_fraction=0.25, decay_shape=shape)
  schedule = optimizer.make_schedule(c.optimizer, 100)
  decayed = lambda t: 0.2 + 1.8 * (1 - (np.sqrt(t) if shape == 'sqrt' else t))
  steps = [0, 5, 10, 40, 75, 80, 90, 100]
  expected = [0.0, 1.0, 2.0, 2.0, 2.0, decayed(5 / 25), decayed(15 / 25), 0.2]
  np.testing.assert_allclose([schedule(s) for s in steps], expected, rtol=1e-6, atol=1e-6)
  # 400 steps: the same rates up to the shorter run's decay, which now starts at step 300
  longer = optimizer.make_schedule(c.optimizer, 400)
  np.testing.assert_allclose([longer(s) for s in range(76)], [schedule(s) for s in range(76)])
  assert longer(300) == 2.0 and abs(longer(400) - 0.2) < 1e-6


def test_muon_orthogonalises_each_layers_projection_as_one_matrix_and_adamw_the_rest():
  """A stacked Wq [layers, D, N, H] is each layer's [D, N·H] matrix to Muon (muon_dimensions):
  its update equals optax's Muon on those matrices given flat; norms, the embedding and head take
  this run's AdamW, exactly."""
  from flax import nnx
  from optax.contrib import muon
  from configs import base
  from model.transformer import Transformer
  cfg = base.ModelConfig.from_config({**tiny_config().model})
  params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), params)
  oc = base.OptimizerConfig(name='muon', warmup_steps=0, weight_decay=0.0, grad_clip=0.0,
                            muon_ns_dtype='float32')  # optax's
  schedule = optimizer.make_schedule(oc, 100)
  tx = optimizer.make_optimizer(oc, schedule)
  state = tx.init(params)
  for _ in range(2):  # the second step's update carries momentum
    updates, state = jax.jit(tx.update)(grads, state, params)
  wq_g = grads['blocks']['attn']['wq'][...]  # [L, D, N, H]
  flat = {'w': wq_g.reshape(wq_g.shape[0], wq_g.shape[1], -1)}
  reference = muon(schedule, consistent_rms=0.2, muon_weight_dimension_numbers={
      'w': optax.contrib.MuonDimensionNumbers(1, 2)})
  ref_state = reference.init(flat)
  for _ in range(2):
    ref_updates, ref_state = jax.jit(reference.update)(flat, ref_state, flat)
  np.testing.assert_allclose(updates['blocks']['attn']['wq'][...].reshape(flat['w'].shape),
                             ref_updates['w'], rtol=1e-5, atol=1e-7)
  adamw = optimizer.make_adamw(oc, schedule)
  adam_state = adamw.init(params)
  for _ in range(2):
    adam_updates, adam_state = jax.jit(adamw.update)(grads, adam_state, params)
  for name in ('embed', 'unembed'):
    np.testing.assert_array_equal(updates[name][...], adam_updates[name][...])
  np.testing.assert_array_equal(updates['final_norm']['scale'][...],
                                adam_updates['final_norm']['scale'][...])
  # An MoE's experts: each expert's matrix of each layer apart; the router AdamW's.
  moe = base.ModelConfig.from_config({**tiny_config().model, 'experts': 4})
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(moe, rngs=nnx.Rngs(0))), nnx.Param)
  dims = optimizer.muon_dimensions(abstract)['blocks']['mlp']
  assert (dims['w_gate'], dims['w_down'], dims['router']) == (
      optax.contrib.MuonDimensionNumbers((2,), (3,)),
      optax.contrib.MuonDimensionNumbers((2,), (3,)), None)


def test_qk_clip_scales_the_logits_of_exactly_the_heads_over_tau_by_tau_over_their_measure():
  """Layer 0's heads measured [6, 4, 10, 5] with τ = 5 (kv heads of two query heads each): each
  head's logits q·k scale by min(1, τ/m) = [5/6, 1, 1/2, 1], the key weights of a group by √ of
  its smallest; layer 1 (all under τ) and every other parameter are left bit for bit. In an MoE
  after a dense layer the layers' measures run over the dense stack, then the MoE's."""
  from flax import nnx
  from configs import base
  from configs.base import MAX_LOGIT
  from model.transformer import Transformer
  from training.step import qk_clipped
  cfg = base.ModelConfig.from_config({**tiny_config().model, 'qk_clip': 5.0})
  params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  measure = jnp.array([[6.0, 4.0, 10.0, 5.0], [1.0, 2.0, 3.0, 4.9]])
  clipped = qk_clipped(cfg, params, {MAX_LOGIT: measure})
  x_D = jax.random.normal(jax.random.key(1), (cfg.d_model,))
  y_D = jax.random.normal(jax.random.key(2), (cfg.d_model,))
  def logits(p, layer):  # every head's q(x)·k(y) against its kv head
    q_NH = jnp.einsum('d,dnh->nh', x_D, p['blocks']['attn']['wq'][...][layer])
    k_KH = jnp.einsum('d,dkh->kh', y_D, p['blocks']['attn']['wk'][...][layer])
    return (q_NH * jnp.repeat(k_KH, cfg.n_heads // cfg.n_kv_heads, axis=0)).sum(-1)
  np.testing.assert_allclose(logits(clipped, 0), logits(params, 0) * np.array([5 / 6, 1, 0.5, 1]),
                             rtol=1e-5)
  wk = clipped['blocks']['attn']['wk'][...][0] / params['blocks']['attn']['wk'][...][0]
  np.testing.assert_allclose(wk[:, 0], np.sqrt(5 / 6), rtol=1e-6)  # min(5/6, 1)
  np.testing.assert_allclose(wk[:, 1], np.sqrt(0.5), rtol=1e-6)
  for name in ('wq', 'wk'):
    np.testing.assert_array_equal(clipped['blocks']['attn'][name][...][1],
                                  params['blocks']['attn'][name][...][1])
  changed = {jax.tree_util.keystr(path) for path, a, b in zip(
      *zip(*jax.tree_util.tree_leaves_with_path(clipped)), jax.tree.leaves(params))
      if not np.array_equal(a, b)}
  assert changed == {"['blocks']['attn']['wq'].value", "['blocks']['attn']['wk'].value"}, changed
  # An MoE after a dense layer: the measures run over both stacks, in order.
  moe = base.ModelConfig.from_config({**tiny_config().model, 'qk_clip': 5.0, 'experts': 4,
                                      'experts_per_token': 2, 'dense_layers': 1, 'n_layers': 3})
  params = nnx.state(Transformer(moe, rngs=nnx.Rngs(0)), nnx.Param)
  measure = jnp.array([[10.0] * 4, [1.0] * 4, [20.0] * 4])
  clipped = qk_clipped(moe, params, {MAX_LOGIT: measure})
  ratio = lambda stack: (clipped[stack]['attn']['wq'][...] / params[stack]['attn']['wq'][...])
  np.testing.assert_allclose(ratio('dense_blocks')[0], np.sqrt(0.5), rtol=1e-6)
  np.testing.assert_allclose(ratio('blocks')[0], 1.0)
  np.testing.assert_allclose(ratio('blocks')[1], np.sqrt(0.25), rtol=1e-6)


@pytest.mark.integration
def test_qk_clip_holds_the_logits_near_tau_on_a_run_that_without_it_exceeds_it(tmp_path):
  """A tiny model at a learning rate of 1e-2 grows its largest logit past 1.4 τ (τ = 6) within
  30 steps; with QK-clip each step's measure (taken before that step's clip) stays within 1.3 τ,
  the heads over it are counted, and the model learns as well."""
  def run(tau):
    c = tiny_config(fsdp=-1)
    c.workdir, c.train_steps, c.log_every, c.eval_every = str(tmp_path / str(tau)), 30, 1, 0
    c.checkpoint_every = 30
    c.model.update(qk_clip=tau, attention='xla')
    c.optimizer.learning_rate = 1e-2
    return [r for r in loop.run(c) if 'qk_max_logit' in r]
  free, clipped = run(1e9), run(6.0)
  assert len(free) == len(clipped) == 30
  assert max(r['qk_max_logit'] for r in free[-10:]) > 1.4 * 6.0
  assert all(r['qk_clipped_heads'] == 0 for r in free)
  assert max(r['qk_max_logit'] for r in clipped) <= 1.3 * 6.0
  assert sum(r['qk_clipped_heads'] for r in clipped) > 0
  assert clipped[-1]['loss'] < clipped[0]['loss'] - 2.0


def newton_schulz(x, steps: int = 5):
  """Keller Jordan's quintic Newton–Schulz in numpy (float64), on one matrix."""
  a, b, c = 3.4445, -4.7750, 2.0315
  x = x / (np.linalg.norm(x) + 1e-8)
  wide = x if x.shape[0] <= x.shape[1] else x.T
  for _ in range(steps):
    gram = wide @ wide.T
    wide = a * wide + (b * gram + c * gram @ gram) @ wide
  return wide if x.shape[0] <= x.shape[1] else wide.T


def test_muons_newton_schulz_is_the_formulas_on_each_matrix_of_a_stack_and_bf16_close_to_it():
  """optimizer.orthogonalised on a stack [S, in, out] (one tall, one wide case) is the quintic
  iteration on each matrix: to fp32 rounding in float32, within 8% (relative Frobenius: bf16's
  rounding, grown by the iterations' slope) in bfloat16, whose singular values still lie within
  Newton–Schulz's band."""
  from configs import base
  dims = optax.contrib.MuonDimensionNumbers((1,), (2,))
  for shape in ((3, 32, 48), (2, 40, 24)):
    x = jax.random.normal(jax.random.key(sum(shape)), shape)
    want = np.stack([newton_schulz(np.asarray(m, np.float64)) for m in x])
    for dtype, tolerance in (('float32', 1e-4), ('bfloat16', 0.08)):
      oc = base.OptimizerConfig(name='muon', muon_ns_dtype=dtype)
      got = np.asarray(jax.jit(lambda m: optimizer.orthogonalised(m, dims, oc))(x), np.float64)
      assert got.dtype == np.float64 and got.shape == shape
      error = np.linalg.norm(got - want, axis=(1, 2)) / np.linalg.norm(want, axis=(1, 2))
      assert error.max() < tolerance, (shape, dtype, error)
      singular = np.linalg.svd(got, compute_uv=False)
      assert singular.min() > 0.5 and singular.max() < 1.3, (dtype, singular)


@pytest.mark.integration
def test_a_muon_run_resumed_from_its_checkpoint_trains_on_bit_for_bit(tmp_path):
  """Muon's momentum and AdamW's moments (each beside MaskedNodes for the other's parameters)
  saved and restored: steps 3 and 4 after a resume are the uninterrupted run's."""
  def muon(workdir, steps):
    c = tiny_config(fsdp=-1)
    c.optimizer.name = 'muon'
    c.update(workdir=str(workdir), train_steps=steps, checkpoint_every=2, log_every=1,
             eval_every=0)
    return c
  whole = [r['loss'] for r in loop.run(muon(tmp_path / 'whole', 4)) if 'loss' in r]
  loop.run(muon(tmp_path / 'resumed', 2))
  resumed = [r['loss'] for r in loop.run(muon(tmp_path / 'resumed', 4)) if 'loss' in r]
  assert len(whole) == 4 and resumed == whole[2:], (whole, resumed)


def test_clipping_bounds_the_update():
  c = tiny_config()
  c.optimizer.grad_clip, c.optimizer.weight_decay = 1.0, 0.0
  tx = optimizer.make_optimizer(c.optimizer, lambda _: 1.0)
  params = {'w': jnp.ones(4)}
  big = {'w': jnp.full(4, 1e6)}
  clipped_state = tx.init(params)
  updates, _ = tx.update(big, clipped_state, params)
  assert np.all(np.isfinite(updates['w'])) and np.all(np.abs(updates['w']) <= 1.0 + 1e-6)


BAD = [
    (dict(mesh=dict(data=3)), 'config.mesh'),
    (dict(mesh=dict(data=1, fsdp=-1, tensor=-1)), 'only one axis may be -1'),
    (dict(mesh=dict(data=1, fsdp=1, tensor=8)), 'config.model.n_heads'),
    (dict(mesh=dict(data=1, fsdp=2, tensor=4), model=dict(n_heads=8, n_kv_heads=2)),
     'config.model.n_kv_heads'),
    (dict(batch_size=12, mesh=dict(data=8)), 'config.batch_size'),
    (dict(seq_len=30, mesh=dict(fsdp=2, sequence=4)), 'config.seq_len'),
    (dict(model=dict(attention='cudnn')), 'config.model.attention'),
    (dict(model=dict(n_kv_heads=3)), 'config.model.n_heads'),
    (dict(train_steps=0), 'config.train_steps'),
    (dict(model=dict(scheduler_memory=0.0)), 'config.model.scheduler_memory=0.0 must be in'),
    (dict(mesh=dict(stage=2, fsdp=4), microbatches=2, model=dict(param_dtype='bfloat16')),
     'config.mesh.stage=2 with the trained parameters in bfloat16'),
    (dict(mesh=dict(stage=2, fsdp=4), microbatches=2, optimizer=dict(master_tier='host'),
          model=dict(compute_dtype='bfloat16')),  # the devices' copy: in compute_dtype
     'config.mesh.stage=2 with the trained parameters in bfloat16'),
    (dict(model=dict(draft_only=True)), 'config.model.draft_heads'),
    (dict(microbatches=2, mesh=dict(stage=2), model=dict(draft_heads=2)), 'config.mesh.stage=1'),
    (dict(mesh=dict(sequence=2), model=dict(draft_heads=2, context_parallel='ring',
                                            attention='pallas')), 'context_parallel=.all_gather'),
]


@pytest.mark.parametrize('change,message', BAD, ids=[m for _, m in BAD])
def test_bad_config_fails_before_anything_is_built_naming_the_field(change, message, tmp_path):
  c = tiny_config(data=1, fsdp=-1)
  for key, value in change.items():
    if isinstance(value, dict):
      c[key].update(value)
    else:
      c[key] = value
  c.workdir = str(tmp_path / 'run')
  with pytest.raises(ValueError, match=message):
    loop.run(c)
  assert not (tmp_path / 'run').exists()  # failed before writing anything


def test_unwritable_workdir_is_a_clear_error(tmp_path):
  (tmp_path / 'file').write_text('not a directory')
  c = tiny_config(fsdp=8)
  c.workdir = str(tmp_path / 'file' / 'run')
  with pytest.raises(ValueError, match='config.workdir'):
    loop.run(c)


def train_cli(*flags, cwd=REPO, env=None):
  return subprocess.run([sys.executable, 'train.py', *flags], cwd=cwd, capture_output=True,
                        text=True, timeout=600, env=env)


@pytest.mark.integration
def test_train_cli_learns_configs_base_as_its_committed_curve(tmp_path):
  """As a user runs configs/base.py on a machine without a GPU (JAX picks its platform itself,
  and no CUDA plugin is there to complain), but over 8 devices: every step's loss and both
  evaluations are tests/data/curves/base.json's (made on one device by
  scripts/loss_curves.py) within float noise, and the metrics and config are written."""
  curve = json.loads((REPO / 'tests' / 'data' / 'curves' / 'base.json').read_text())
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}  # XLA's optimisations on
  result = train_cli('--config=configs/base.py', f'--config.workdir={tmp_path}',
                     '--config.log_every=1', env=env)  # default mesh: fsdp=-1 takes the 8 devices
  assert result.returncode == 0, result.stderr[:1500] + '\n…\n' + result.stderr[-1500:]  # XLA's
  # reason for an abort comes first, its thread stacks after
  assert not any(word in result.stderr.lower() for word in ('cuda', 'plugin', 'traceback')), \
      result.stderr[-3000:]
  records = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == list(range(1, 101))
  for key in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec', 'step_time_s'):
    assert all(np.isfinite(r[key]) for r in train), key
  # bf16 compute summed in another order over 8 devices: 6e-4 apart at most when committed
  np.testing.assert_allclose([r['loss'] for r in train], curve['loss'], atol=2e-3, rtol=0)
  evals = {str(r['step']): r['eval_loss'] for r in records if 'eval_loss' in r}
  assert sorted(evals) == sorted(curve['eval'])
  for step, eval_loss in evals.items():
    assert abs(eval_loss - curve['eval'][step]['eval_loss']) < 2e-3, step
  config = json.loads((tmp_path / 'config.json').read_text())
  assert config['train_steps'] == 100 and config['seed'] == 0
  assert 'step 100/100 | loss' in result.stdout


def test_flops_per_token_matches_a_hand_count():
  from model import ModelConfig
  from planning import flops
  cfg = ModelConfig.from_config(tiny_config().model)  # D=64, N=4, K=2, H=16, F=128, V=384, 2 layers
  per_layer = 64 * 16 * (4 + 4 + 2 + 2) + 3 * 64 * 128  # q, o, k, v + gate, up, down = 36,864
  dense = 6 * (2 * per_layer + 64 * 384)
  attention = 12 * 2 * 4 * 16 * 32  # seq_len 32
  assert flops.flops_per_token(cfg, 32) == dense + attention / 2
  assert flops.flops_per_token(cfg, 32, causal=False) == dense + attention
  assert flops.peak_tflops('NVIDIA H100 80GB HBM3') == 989.0
  assert flops.peak_tflops('NVIDIA H100 PCIe') == 756.0
  assert flops.peak_tflops('cpu') is None


@pytest.mark.integration
def test_unpacked_batches_train_like_packed_rows_of_one_document():
  import sharding
  from training import programs
  config = tiny_config(fsdp=8)
  setup = build(settings.resolve(config))
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  host = {'inputs': rng.integers(0, 256, shape), 'targets': rng.integers(0, 256, shape),
          'positions': np.broadcast_to(np.arange(shape[1]), shape), 'weights': np.ones(shape),
          'segment_ids': np.ones(shape)}
  s = sharding.batch_sharding(setup.mesh)
  batch = {k: jax.device_put(np.asarray(v, programs.BATCH_KEYS[k]), s) for k, v in host.items()}
  losses = []
  for packed in (True, False):
    step = programs.compile_train_step(setup, *shape, 0.0, packed=packed)
    feed = batch if packed else {k: v for k, v in batch.items() if k != 'segment_ids'}
    losses.append(float(step(setup.init_state(), feed)[1]['loss']))
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


@pytest.mark.integration
def test_microbatches_accumulate_to_the_same_update_as_one_big_batch(small_corpus):
  from data import chat, tokens
  from training import programs
  import sharding
  results = []
  for microbatches in (1, 4):
    config = tiny_config(fsdp=2, tensor=2, data=2)
    config.microbatches, config.batch_size = microbatches, 16
    run = settings.resolve(config)
    setup = build(run)
    documents = tokens.OnTheFly(small_corpus.train, 'text', chat.Encoder(run.tokenizer))
    batches = loop.train_batches(run, documents, sharding.batch_sharding(setup.mesh))
    step = programs.compile_train_step(setup, config.batch_size, config.seq_len,
                                       config.loss.z_loss, microbatches=microbatches)
    local = batches.next_local()
    local['weights'][0, 5:] = 0  # uneven weights: the mean is over the batch's tokens
    state, metrics = step(setup.init_state(), batches.to_global(local))
    batches.close()
    results.append((jax.device_get(metrics), jax.tree.map(np.asarray, state.params)))
  (one, params_one), (four, params_four) = results
  for key in ('loss', 'z_loss', 'grad_norm'):
    np.testing.assert_allclose(four[key], one[key], rtol=1e-5, err_msg=key)
  for a, b in zip(jax.tree.leaves(params_four), jax.tree.leaves(params_one)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_microbatches_must_split_each_devices_rows(tmp_path):
  c = tiny_config(fsdp=8)
  c.microbatches, c.workdir = 2, str(tmp_path / 'run')
  with pytest.raises(ValueError, match='config.microbatches=2'):
    loop.run(c)


@pytest.mark.parametrize('model', [  # the MoE's and LoRA's: a minute of the inner loop's three
    {}, *(pytest.param(m, marks=pytest.mark.integration)
          for m in (dict(experts=4, experts_per_token=2, dense_layers=1, n_layers=3),
                    dict(lora_rank=2)))])
def test_unrolled_microbatches_sum_each_layer_apart_and_cast_the_weights_once(model,
                                                                              monkeypatch):
  """Over microbatches, unrolled layers' gradient sums are a buffer a layer (model/gradient_sums.py:
  both stacks of an MoE model, the adapters under LoRA) and, gradients reduced in bf16, the
  trained weights are cast to it once a step rather than in every microbatch (norm scales stay
  fp32; an MoE model, whose router reads fp32, keeps its casts): the gradients are bit for bit
  the stacked sums' and the per-microbatch casts'."""
  import sharding
  from model import gradient_sums
  from training import programs, step as step_module
  config = tiny_config(fsdp=8)
  config.model.update(grad_reduce_dtype='bfloat16', compute_dtype='bfloat16', scan_layers=False,
                      **model)
  config.microbatches, config.batch_size = 2, 16
  setup = build(settings.resolve(config))
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  host = {'inputs': rng.integers(0, 256, shape), 'targets': rng.integers(0, 256, shape),
          'positions': np.broadcast_to(np.arange(shape[1]), shape), 'weights': np.ones(shape)}
  batch = {k: jax.device_put(np.asarray(v, programs.BATCH_KEYS[k]),
                             sharding.batch_sharding(setup.mesh)) for k, v in host.items()}
  seen, scan, gradients = {}, gradient_sums.scan, step_module.gradients

  def scan_spy(step, layers, sums, *args):
    seen['per layer'] = isinstance(sums, list)
    return scan(step, layers, sums, *args)

  def gradients_spy(setup, loss, microbatches, params, *args, **kwargs):
    seen['dtypes'] = {jax.tree_util.keystr(p): a.dtype
                      for p, a in jax.tree_util.tree_leaves_with_path(params)}
    return gradients(setup, loss, microbatches, params, *args, **kwargs)
  monkeypatch.setattr(gradient_sums, 'scan', scan_spy)
  monkeypatch.setattr(step_module, 'gradients', gradients_spy)
  results, microbatched = {}, step_module.microbatched
  for way in ('new', 'old'):
    if way == 'old':
      monkeypatch.setattr(step_module, 'cast_once', lambda setup: None)
      monkeypatch.setattr(step_module, 'microbatched',
                          lambda *a, **k: microbatched(*a, **{**k, 'per_layer': False}))
    gradient_step = step_module.make_gradient_step(setup, 1e-4, 2)
    with jax.set_mesh(setup.mesh):
      grads, _, _, metrics = jax.jit(gradient_step)(setup.init_state(), batch)
    results[way] = jax.tree.map(np.asarray, grads), dict(seen), float(metrics['loss'])
  (new, seen_new, loss_new), (old, seen_old, loss_old) = results['new'], results['old']
  assert seen_new['per layer'] and not seen_old['per layer']
  dtypes, cast = seen_new['dtypes'], 'experts' not in model
  assert {str(d) for k, d in dtypes.items() if 'norm' in k} <= {'float32'}
  assert {str(d) for k, d in dtypes.items() if 'norm' not in k} == {
      'bfloat16' if cast else 'float32'}
  assert {str(d) for d in seen_old['dtypes'].values()} == {'float32'}
  assert loss_new == loss_old
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(old)):
    assert a.dtype == b.dtype == np.float32, path
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('model', [dict(experts=4, experts_per_token=2, dense_layers=1,
                                        n_layers=3), dict(lora_rank=2)])
def test_microbatches_add_each_layers_gradient_to_the_sums_in_the_backward(model, monkeypatch):
  """Over microbatches the step hands every stack's gradient sums (of its trained parameters:
  the dense and the MoE layers', or the adapters under LoRA) to the model, whose backward adds
  each layer's gradient to them as it makes it (model/gradient_sums.py, where the test of the
  memory it saves is), so that no microbatch's gradients of a whole stack are held."""
  from model import gradient_sums
  from training import programs
  from training.step import make_train_step
  summed, scan = [], gradient_sums.scan

  def spy(step, layers, sums, *args):
    summed.append(sorted(jax.tree_util.keystr(p) for p, _ in
                         jax.tree_util.tree_leaves_with_path(sums)))
    return scan(step, layers, sums, *args)
  monkeypatch.setattr(gradient_sums, 'scan', spy)
  config = tiny_config(fsdp=8)
  config.model.update(model)
  config.microbatches, config.batch_size = 2, 16
  setup = build(settings.resolve(config))
  params, _ = trained(setup.model_cfg, setup.abstract_state.params)
  batch = programs.abstract_batch(setup.mesh, config.batch_size, config.seq_len, True)
  with jax.set_mesh(setup.mesh):
    jax.eval_shape(make_train_step(setup, 1e-4, 2), setup.abstract_state, batch)
  stacks = [name for name in ('dense_blocks', 'blocks') if name in params]
  assert summed == [sorted(jax.tree_util.keystr(p) for p, _ in
                           jax.tree_util.tree_leaves_with_path(params[name]))
                    for name in stacks] and summed[-1], summed
