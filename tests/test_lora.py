"""LoRA (model/layers.py: Adapter; interop/peft.py): the adapted model starts as the base; a PEFT
adapter reads in and writes out tensor for tensor, and the model it makes computes what PEFT's
does (goldens made by tests/data/make_peft_goldens.py); merged, it is a plain Llama computing the
same; only the adapters train, with the optimizer holding them alone, the base's weight
gradients never computed, and they train on meshes with fsdp and tensor as on one device."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from configs import base
from interop import huggingface, peft
from model.layers import LoRA, split_adapters
from tests.conftest import SMALL_CORPUS
from training import settings
from training.optimizer import base_params
from training.programs import compile_train_step
from training.state import build

DATA = pathlib.Path(__file__).resolve().parent / 'data'
UNTIED = DATA / 'hf-llama-untied'
PEFT = DATA / 'hf-peft-lora'  # r=4, lora_alpha=8, every projection, B random
QWEN3, PEFT_QWEN3 = DATA / 'hf-qwen3', DATA / 'hf-peft-lora-qwen3'  # the same, on a Qwen3
GEMMA3, PEFT_GEMMA3 = DATA / 'hf-gemma3', DATA / 'hf-peft-lora-gemma3'  # and on a Gemma 3


def lora_config(rank=4, base_model=UNTIED, **mesh):
  c = base.get_config()
  c.init_from = f'hf:{base_model}'
  c.model.compute_dtype = 'float32'
  c.model.lora_rank, c.model.lora_alpha = rank, 8.0
  c.batch_size, c.seq_len, c.microbatches = 16, 32, 2
  c.mesh.update(dict(data=1, stage=1, fsdp=-1, expert=1, tensor=1, sequence=1))
  c.mesh.update(mesh)
  c.data.paths, c.data.validation_fraction = SMALL_CORPUS, 0.1
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 1e-2, 0
  return c


def started(config, devices=None):
  """The setup and its state from the imported base, adapters fresh."""
  setup = build(settings.resolve(config, devices))
  base = base_params(setup.model_cfg, setup.abstract_state.params)
  path = huggingface.directory(config.init_from)
  return setup, setup.init_state(huggingface.load_params(path, base, setup.model_cfg))


def logits(setup, params, tokens):
  model = nnx.merge(setup.graphdef, params)
  with jax.set_mesh(setup.mesh):
    return np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))


@pytest.mark.integration
@pytest.mark.parametrize('base_model,adapter', [(UNTIED, PEFT), (QWEN3, PEFT_QWEN3),
                                                (GEMMA3, PEFT_GEMMA3)],
                         ids=['llama', 'qwen3', 'gemma3'])
def test_a_peft_adapter_reads_in_and_writes_out_exactly_and_computes_what_peft_does(base_model,
                                                                                    adapter):
  tokens = np.load(base_model / 'goldens.npz')['tokens']
  setup, state = started(lora_config(base_model=base_model))
  plain = build(settings.resolve(lora_config(rank=0, base_model=base_model)))
  plain_params = huggingface.load_params(base_model, plain.abstract_state.params,
                                         plain.model_cfg)
  # B starts at zero: the adapted model is the base, exactly.
  np.testing.assert_array_equal(logits(setup, state.params, tokens),
                                logits(plain, plain_params, tokens))
  adapted = peft.load(adapter, jax.tree.map(np.asarray, nnx.to_pure_dict(state.params)),
                      setup.model_cfg)
  params = nnx.State(state.params)
  nnx.replace_by_pure_dict(params, adapted)
  golden = np.load(adapter / 'goldens.npz')['logits']
  np.testing.assert_allclose(logits(setup, params, tokens), golden, atol=1e-4, rtol=0)
  written = peft.tensors(params, setup.model_cfg, np.float32)
  theirs = load_file(adapter / 'adapter_model.safetensors')
  assert sorted(written) == sorted(theirs) and len(theirs) == 2 * 7 * setup.model_cfg.n_layers
  for name in theirs:
    np.testing.assert_array_equal(written[name], theirs[name], err_msg=name)
  config, golden_config = (peft.adapter_config(setup.model_cfg, ''),
                           json.loads((adapter / 'adapter_config.json').read_text()))
  for key in ('peft_type', 'r', 'lora_alpha', 'use_rslora', 'use_dora', 'bias', 'fan_in_fan_out'):
    assert config[key] == golden_config[key], key
  assert sorted(config['target_modules']) == sorted(golden_config['target_modules'])
  # Merged, the plain model computes the same.
  merged = peft.merged(params, setup.model_cfg)
  merged_state = nnx.State(plain_params)
  nnx.replace_by_pure_dict(merged_state, merged)
  np.testing.assert_allclose(logits(plain, merged_state, tokens), golden, atol=1e-4, rtol=0)


def steps(config, n, devices=None):
  """n steps on one fixed batch: (losses, the state after, the setup, the compiled step)."""
  setup, state = started(config, devices)
  step = compile_train_step(setup, config.batch_size, config.seq_len, config.loss.z_loss,
                            microbatches=config.microbatches)
  rng = np.random.default_rng(0)
  batch = {'inputs': rng.integers(0, 300, (16, 32)), 'targets': rng.integers(0, 300, (16, 32)),
           'positions': np.tile(np.arange(32), (16, 1)), 'segment_ids': np.ones((16, 32)),
           'weights': np.ones((16, 32))}
  batch = {k: jnp.asarray(v, jnp.float32 if k == 'weights' else jnp.int32)
           for k, v in batch.items()}
  losses = []
  for _ in range(n):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  return losses, state, setup, step


@pytest.mark.integration
def test_only_the_adapters_train_on_fsdp_and_tensor_as_on_one_device_and_the_base_gets_no_gradient():
  one_losses, one, _, _ = steps(lora_config(fsdp=1), 3, jax.devices()[:1])
  assert one_losses[-1] < one_losses[0]
  adapters_one, base_one = split_adapters(one.params)
  mesh = dict(fsdp=4, tensor=2)
  losses, state, setup, compiled = steps(lora_config(**mesh), 3)
  np.testing.assert_allclose(losses, one_losses, rtol=2e-5)
  adapters, frozen = split_adapters(state.params)
  for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(adapters_one)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base_one)):
    np.testing.assert_array_equal(a, b)  # the base never moves
  # The optimizer holds the adapters alone: Adam's two moments of each.
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert len(moments) == 2 * len(jax.tree.leaves(adapters)) == 2 * 2 * 7
  assert all(x.dtype == jnp.float32 for x in moments)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(frozen))  # compute_dtype here
  # An adapter shards as its weight: Wq's A along embed over fsdp, its B along heads over tensor.
  attn = state.params['blocks']['attn']
  assert attn['wq_lora']['a'][...].addressable_shards[0].data.shape == (2, 64 // 4, 4)
  assert attn['wq_lora']['b'][...].addressable_shards[0].data.shape == (2, 4, 4 // 2, 16)
  # No weight gradient of the base is computed: a full step's FLOPs are about 3 times the
  # forward's, the adapted one's about 2 (the activations' gradients still flow through it).
  full = build(settings.resolve(lora_config(rank=0, **mesh)))
  full_step = compile_train_step(full, 16, 32, 1e-4, microbatches=2)
  ratio = compiled.cost_analysis()['flops'] / full_step.cost_analysis()['flops']
  assert 0.55 < ratio < 0.75, ratio


def test_lora_settings_are_checked_before_anything_is_built():
  for changes, match in (({'lora_rank': -1}, 'lora_rank=-1'),
                         ({'lora_rank': 4, 'lora_targets': 'q,x'}, "lora_targets='q,x'"),
                         ({'lora_rank': 4, 'lora_alpha': 0.0}, 'lora_alpha=0.0'),
                         ({'lora_rank': 4, 'experts': 4}, 'adapts dense models only'),
                         ({'lora_rank': 33, 'lora_targets': 'k'}, "lora_rank=33 is more than "
                          "the 32 a side of the 'k' projection")):
    c = base.get_config()
    c.model.update(changes)
    with pytest.raises(ValueError, match=match):
      build(settings.resolve(c))
  c = lora_config(data=2, fsdp=4)
  c.partition.hierarchical = True
  with pytest.raises(ValueError, match='config.partition.hierarchical=True .* LoRA'):
    build(settings.resolve(c))
  assert issubclass(LoRA, nnx.Param)


@pytest.mark.integration
def test_a_start_from_a_lora_run_takes_the_model_its_adapters_make_or_says_it_leaves_them(
    tmp_path):
  """config.init_from a LoRA run: init_adapters='merge' starts from the model it trained (the
  adapted model's logits, every parameter trainable), 'leave' from the base they adapted; the
  start line says which, and how to have the other."""
  from inference import sampling
  from training import loop
  from training.state import initial_state
  tuned = lora_config()
  tuned.workdir, tuned.train_steps, tuned.checkpoint_every, tuned.eval_every = (
      str(tmp_path / 'sft'), 3, 3, 0)
  loop.run(tuned)
  adapted = sampling.load(tuned.workdir)
  tokens = np.load(UNTIED / 'goldens.npz')['tokens']
  want = np.asarray(jax.jit(lambda m, t: m(t))(adapted.model, tokens))
  base_only = peft.merged(split_adapters(nnx.state(adapted.model), LoRA)[1], adapted.model.cfg)
  for setting in ('merge', 'leave'):
    config = lora_config(rank=0)
    config.init_from, config.init_adapters = tuned.workdir, setting
    setup = build(settings.resolve(config))
    said = []
    _, state, _ = initial_state(setup, None, said.append)
    got = logits(setup, state.params, tokens)
    if setting == 'merge':
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
      assert "its LoRA adapters (rank 4) merged into the base" in said[-1]
    else:
      assert np.abs(got - want).max() > 1e-3  # the adapters trained: their model is another
      plain = nnx.merge(setup.graphdef, state.params)
      for path, value in nnx.to_flat_state(nnx.state(plain)):
        expected = base_only
        for key in path:
          expected = expected[key]
        np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(expected))
      assert "its LoRA adapters (rank 4) left out (config.init_adapters='leave')" in said[-1]
    assert said[-1].startswith('starting from the parameters of ')
    assert 'hf-' in said[-1]  # the tokenizer it takes, named
