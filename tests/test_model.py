"""The model alone, on one device: causality, packing isolation, GQA attention, scan/remat."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels
from model import ModelConfig, Transformer
from configs.base import KEEPS_KERNEL
from tests.conftest import tiny_config


def make_model(**overrides):
  c = tiny_config()
  c.model.update(overrides)
  return Transformer(ModelConfig.from_config(c.model), rngs=nnx.Rngs(0))


def tokens(seed, shape=(2, 24)):
  return jax.random.randint(jax.random.key(seed), shape, 0, 256)


def test_changing_token_t_changes_no_earlier_logit():
  model, t = make_model(), 11
  x = tokens(0)
  y = x.at[:, t].set((x[:, t] + 1) % 256)
  a, b = model(x), model(y)
  np.testing.assert_array_equal(a[:, :t], b[:, :t])
  assert not np.allclose(a[:, t:], b[:, t:])  # the change is visible from t on


def test_a_document_is_blind_to_what_is_packed_before_it():
  model = make_model()
  doc_a, doc_b = tokens(1, (1, 9)), tokens(2, (1, 15))
  alone = model(doc_b)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.array([[1] * 9 + [2] * 15])
  positions = jnp.array([list(range(9)) + list(range(15))])
  together = model(packed, positions, segments)
  np.testing.assert_allclose(together[:, 9:], alone, rtol=1e-5, atol=1e-5)
  # Without segment ids the same row does see doc_a: the test can tell the difference.
  assert not np.allclose(model(packed, positions)[:, 9:], alone, atol=1e-3)


@pytest.mark.parametrize('kv_heads', [8, 2, 1])
@pytest.mark.parametrize('causal', [True, False])
def test_xla_attention_matches_jax_reference(kv_heads, causal):
  kq, kk, kv, ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (2, 16, 8, 32))
  k = jax.random.normal(kk, (2, 16, kv_heads, 32))
  v = jax.random.normal(kv, (2, 16, kv_heads, 32))
  seg = jnp.sort(jax.random.randint(ks, (2, 16), 1, 4), axis=1)
  ours = kernels.attention(q, k, v, causal=causal, segment_ids_BL=seg, implementation='xla')
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]
  ref = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation='xla')
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_zeros_not_nan():
  q = k = v = jnp.ones((1, 4, 2, 8))
  q_seg, kv_seg = jnp.array([[1, 1, 3, 3]]), jnp.array([[1, 1, 2, 2]])
  out = kernels.xla_attention(q, k, v, causal=False, segment_ids_BL=q_seg, kv_segment_ids_BS=kv_seg)
  assert np.all(np.isfinite(out)) and np.all(out[:, 2:] == 0)


def loss_and_grads(model, x):
  graphdef, params = nnx.split(model)
  f = lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
  return jax.value_and_grad(f)(params)


@pytest.mark.integration
@pytest.mark.parametrize('variant', [dict(scan_layers=False), dict(remat_policy='full'),
                                     dict(remat_policy='dots')])
def test_unrolled_and_rematerialised_layers_compute_the_same(variant):
  x = tokens(3)
  ref_loss, ref_grads = loss_and_grads(make_model(), x)
  loss, grads = loss_and_grads(make_model(**variant), x)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def launches(jaxpr, kernel: str) -> int:
  """How many times a pass through `jaxpr` launches the Pallas kernel `kernel` (a scan's body
  counted once, a cond's costliest branch)."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'pallas_call':
      n += eqn.params['name'] == kernel
    elif eqn.primitive.name == 'cond':
      n += max(launches(branch.jaxpr, kernel) for branch in eqn.params['branches'])
    else:  # scan, remat, custom_vjp bodies
      n += sum(launches(getattr(v, 'jaxpr', v), kernel) for v in eqn.params.values()
               if hasattr(getattr(v, 'jaxpr', v), 'eqns'))
  return n


@pytest.mark.integration
def test_policies_keeping_attention_run_our_kernels_forward_once():
  """Our kernel's output and softmax statistics kept (model/transformer.py REMAT), the backward
  pass runs its backward alone; `dots` runs its forward again first, and so does
  `dots_except_out`, which recomputes the output projection from it. The gradients are the same."""
  x = tokens(3, (2, 32))
  blocks = dict(attention='pallas', attention_block_q=16, attention_block_k=16)
  ref_loss, ref_grads = loss_and_grads(make_model(**blocks), x)
  for policy, forwards in [('dots', 2), ('dots_attention', 1), ('save_attention', 1),
                           ('dots_except_out', 2), ('dots_attention_except_out', 1)]:
    model = make_model(remat_policy=policy, **blocks)
    graphdef, params = nnx.split(model)
    f = lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
    program = jax.make_jaxpr(jax.value_and_grad(f))(params).jaxpr
    layers = 1 if model.cfg.scan_layers else model.cfg.n_layers  # a scan holds one layer's body
    assert launches(program, 'flash_attention_fwd') == forwards * layers, policy
    if policy == 'dots':  # its gradients: test_unrolled_and_rematerialised_layers_compute_the_same
      continue
    loss, grads = jax.value_and_grad(f)(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_except_out_policies_keep_one_array_a_layer_less(capsys):
  """`dots_except_out` keeps what `dots` keeps less one [layers, B, L, D] array: the output
  projection's output, which the backward recomputes (the FLOPs it costs: test_timing.py)."""
  x = tokens(3, (2, 32))
  kept = {}
  for policy in ('dots', 'dots_except_out'):
    model = make_model(remat_policy=policy)
    graphdef, params = nnx.split(model)
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2), params)
    kept[policy] = capsys.readouterr().out.splitlines()
  cfg = model.cfg
  per_layer = f'f32[{cfg.n_layers},2,32,{cfg.d_model}] output of scan'
  count = lambda lines: sum(line.startswith(per_layer) for line in lines)
  assert count(kept['dots']) == count(kept['dots_except_out']) + 1 >= 2  # and the layer's input
  assert len(kept['dots']) == len(kept['dots_except_out']) + 1


def test_dots_policies_keep_queries_and_keys_rotated_in_the_bytes_the_projections_took(
    monkeypatch, capsys):
  """The dots policies keep q and k as attention takes them (rotated) rather than the
  projections' outputs: the same residuals, shape for shape, and the backward no longer rotates
  them again. The gradients are the same."""
  from model import transformer
  x = tokens(3, (2, 32))
  residuals, programs, grads = {}, {}, {}
  old = jax.checkpoint_policies.save_only_these_names(*transformer._PROJECTIONS)
  for kept in ('rotated', 'projections'):
    if kept == 'projections':
      monkeypatch.setitem(transformer.REMAT, 'dots', old)
    graphdef, params = nnx.split(make_model(remat_policy='dots', scan_layers=False))
    f = lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
    jax.ad_checkpoint.print_saved_residuals(f, params)
    residuals[kept] = sorted(line.split(' ')[0] for line in capsys.readouterr().out.splitlines())
    programs[kept] = len(str(jax.make_jaxpr(jax.grad(f))(params)).splitlines())
    grads[kept] = jax.grad(f)(params)
  assert residuals['rotated'] == residuals['projections']
  assert programs['rotated'] < programs['projections']
  for a, b in zip(jax.tree.leaves(grads['rotated']), jax.tree.leaves(grads['projections'])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('policy', KEEPS_KERNEL)
def test_keeping_attention_with_xla_named_is_refused_and_with_auto_on_a_cpu_is_dots(policy):
  from training import settings
  config = tiny_config()
  config.model.remat_policy = policy
  assert settings.resolve(config).model.attention == 'xla'  # auto's choice here: dots' program
  config.model.attention = 'xla'
  twin = policy.replace('_attention', '')
  with pytest.raises(ValueError, match=f"remat_policy='{policy}'.*attention='xla' runs none.*"
                                       f"remat_policy='{twin}'$"):
    settings.resolve(config)


def test_bf16_compute_keeps_fp32_params_and_tied_head_has_no_unembed():
  model = make_model(compute_dtype='bfloat16', tie_embeddings=True)
  assert not hasattr(model, 'unembed')
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
  logits = model(tokens(4))
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))


def test_a_tied_head_is_the_untied_head_holding_the_table():
  """transformers' tied Llama: lm_head.weight is the embedding table, with no scale. The same
  weights in an untied model give the same logits; at init they are of unit scale, so the loss
  starts near log(vocab), as the untied model's does."""
  tied, untied = make_model(tie_embeddings=True), make_model()
  untied.embed[...] = tied.embed[...]
  untied.unembed[...] = tied.embed[...].T
  untied.blocks, untied.final_norm = tied.blocks, tied.final_norm
  np.testing.assert_allclose(tied(tokens(5)), untied(tokens(5)), rtol=1e-6, atol=1e-6)
  vocab = tied.cfg.vocab_size
  for model in (tied, make_model()):
    logits = model(tokens(6))
    loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens(6)[..., None], -1))
    assert abs(float(loss) / np.log(vocab) - 1) < 0.15, float(loss)


def test_llama3_rope_keeps_high_frequencies_stretches_low_ones_and_blends_between():
  from model.layers import rope_frequencies
  cfg = ModelConfig.from_config(tiny_config().model)
  llama3 = dataclasses.replace(cfg, head_dim=128, rope_theta=500_000.0, rope_type='llama3',
                               rope_factor=8.0, rope_low_freq_factor=1.0,
                               rope_high_freq_factor=4.0, rope_original_length=8192)
  plain_h = rope_frequencies(dataclasses.replace(llama3, rope_type='default'))
  np.testing.assert_allclose(plain_h, 500_000.0 ** (-np.arange(64) / 64), rtol=1e-6)
  scaled_h = rope_frequencies(llama3)
  wavelength_h = 2 * np.pi / plain_h
  high, low = wavelength_h < 8192 / 4, wavelength_h > 8192 / 1
  between = ~high & ~low
  assert high.sum() and low.sum() and between.sum()  # all three kinds at these settings
  np.testing.assert_array_equal(scaled_h[high], plain_h[high])
  np.testing.assert_allclose(scaled_h[low], plain_h[low] / 8, rtol=1e-6)
  ratio = scaled_h[between] / plain_h[between]  # from 1 at the high edge down to 1/8 at the low
  assert np.all((ratio < 1) & (ratio > 1 / 8)) and np.all(np.diff(ratio) < 0)
  # The blend meets both edges: at wavelength original/high the weight on the plain frequency is
  # 1, at original/low it is 0.
  edge = dataclasses.replace(llama3, rope_original_length=int(round(4 * wavelength_h[20])))
  np.testing.assert_allclose(rope_frequencies(edge)[20], plain_h[20], rtol=1e-4)
  with pytest.raises(ValueError, match=r"rope_type='llama3' needs rope_factor >= 1"):
    dataclasses.replace(llama3, rope_factor=0.5)


def test_layers_are_stacked_for_the_scan():
  model = make_model()
  assert model.blocks.attn.wq.shape == (2, 64, 4, 16)  # [layers, D, N, H]
  assert model.blocks.attn.wq.out_sharding == ('layers', 'embed', 'heads', 'head_dim')


@pytest.mark.parametrize('field,value,match', [
    ('n_kv_heads', 3, 'config.model.n_heads'),
    ('attention', 'flash', 'config.model.attention'),
    ('rope_type', 'yarn', 'config.model.rope_type'),
    ('remat_policy', 'some', 'config.model.remat_policy'),
    ('head_dim', 15, 'config.model.head_dim'),
])
def test_bad_model_settings_name_the_field(field, value, match):
  c = tiny_config()
  c.model[field] = value
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_config(c.model)


def test_a_reduction_dtype_that_would_round_the_forward_is_refused():
  """Each weight reaches its matmul through its copy in the reduction dtype: bf16 reduction under
  fp32 compute would run the forward on bf16-rounded weights (it moved a tiny model's logits by
  0.017), so it is refused; under bf16 compute the copy is the one the matmul takes anyway."""
  c = tiny_config()
  c.model.compute_dtype, c.model.grad_reduce_dtype = 'float32', 'bfloat16'
  with pytest.raises(ValueError, match=r"grad_reduce_dtype='bfloat16' with compute_dtype="
                                       r"'float32'.*rounded weights"):
    ModelConfig.from_config(c.model)
  for compute, reduce, reduced in (('bfloat16', 'bfloat16', 'bfloat16'),
                                   ('bfloat16', 'float32', 'float32'),
                                   ('float32', 'float32', 'float32'),
                                   ('bfloat16', 'auto', 'bfloat16'),  # the default: MaxText's
                                   ('float32', 'auto', 'float32')):
    c.model.compute_dtype, c.model.grad_reduce_dtype = compute, reduce
    assert ModelConfig.from_config(c.model).reduce_dtype.name == reduced


def test_auto_reduction_is_the_compute_dtype_on_gpus_and_float32_on_cpus():
  """settings.resolve makes grad_reduce_dtype='auto' a dtype the run saves: for several GPUs (here
  the GPU compiler's H100s) the compute dtype; for one, where nothing crosses a device, float32;
  on CPUs float32, whose collectives sum bf16 in fp32 anyway (and across processes, Gloo's bf16
  reduce-scatters time out: tests/test_distributed.py hung)."""
  from training import settings
  c = tiny_config(fsdp=8)
  assert c.model.grad_reduce_dtype == 'auto'  # the default
  c.model.compute_dtype, c.model.attention = 'bfloat16', 'xla'
  run = settings.resolve(c)
  assert run.model.grad_reduce_dtype == 'float32' and run.as_dict()['model'][
      'grad_reduce_dtype'] == 'float32'
  c.plan.target, c.plan.devices, c.dry_run = 'H100', 8, True
  assert settings.resolve(c).model.grad_reduce_dtype == 'bfloat16'
  c.plan.devices, c.mesh.fsdp = 1, 1
  assert settings.resolve(c).model.grad_reduce_dtype == 'float32'
  c.plan.devices, c.mesh.fsdp = 8, 8
  c.model.compute_dtype = 'float32'
  assert settings.resolve(c).model.grad_reduce_dtype == 'float32'


@pytest.mark.parametrize('policy', ['none', 'full', 'dots'])
def test_the_summed_layer_scan_adds_each_layers_gradient_in_place(policy):
  """model/gradient_sums.py: differentiated, the sums come back as sums + the trained weights'
  gradients, bit for bit what autodiff through the scan and an add make (a frozen weight and a
  per-layer output beside them), without ever holding one microbatch's gradients of the whole
  stack: the compiled program's temporaries are about a stack of them fewer than autodiff's."""
  from model import gradient_sums
  N, D, B = 16, 256, 8

  def layer(x_BD, layer, extras):
    (scale_D,) = extras
    h_BD = jnp.tanh(x_BD @ (layer['w'] + layer['frozen'])) * layer['b'] * scale_D
    return h_BD, {'norm': (h_BD ** 2).sum()}
  if policy != 'none':
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable
                           if policy == 'full' else jax.checkpoint_policies.dots_saveable)
  keys = jax.random.split(jax.random.key(0), 3)
  layers = {'w': jax.random.normal(keys[0], (N, D, D)) * D ** -0.5, 'b': jnp.ones((N, D)),
            'frozen': jax.random.normal(keys[1], (N, D, D)) * 0.01}
  x_BD, scale_D = jax.random.normal(keys[2], (B, D)), jnp.full((D,), 0.9)
  sums = {'w': jnp.full((N, D, D), 0.25), 'b': jnp.full((N, D), -0.5)}
  loss = lambda y_BD, outs: (y_BD ** 2).sum() + outs['norm'].sum()

  def autodiff(sums, layers, x_BD):
    grads = jax.grad(lambda trained: loss(*jax.lax.scan(
        lambda x, l: layer(x, l, (scale_D,)), x_BD, {**layers, **trained})))(
        {k: layers[k] for k in sums})
    return jax.tree.map(jnp.add, sums, grads)

  def summed(sums, layers, x_BD):
    return jax.grad(lambda sums: loss(*gradient_sums.scan(layer, layers, sums, x_BD,
                                                           (scale_D,))))(sums)
  expected, got = (jax.jit(f)(sums, layers, x_BD) for f in (autodiff, summed))
  for k in sums:
    np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
  # Unrolled, the sums may be a buffer a layer: the same sums, layer by layer
  layered = [jax.tree.map(lambda a: a[i], sums) for i in range(N)]
  apart = jax.jit(lambda sums, layers, x_BD: jax.grad(lambda sums: loss(*gradient_sums.scan(
      layer, layers, sums, x_BD, (scale_D,), unroll=True)))(sums))(layered, layers, x_BD)
  for k in sums:
    np.testing.assert_array_equal(jnp.stack([s[k] for s in apart]), expected[k], err_msg=k)
  temporaries = {f.__name__: jax.jit(f, donate_argnums=0).lower(sums, layers, x_BD).compile()
                 .memory_analysis().temp_size_in_bytes for f in (autodiff, summed)}
  stack = N * D * D * 4  # the trained weights' gradients of every layer, fp32
  assert temporaries['autodiff'] - temporaries['summed'] > 0.75 * stack, temporaries
