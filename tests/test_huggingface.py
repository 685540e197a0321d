"""Hugging Face Llama checkpoints in and out (interop/huggingface.py), against what transformers
computed for tiny random models (tests/data/make_hf_goldens.py made them: no torch here)."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from configs import base
from data import tokenizers
from inference.generate import generate
from interop import huggingface
from runtime import checkpoint as checkpoint_lib
from runtime import faults
from tests.conftest import SMALL_CORPUS, with_file_size_limit
from training import loop, settings
from training.state import build

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / 'tests' / 'data'
UNTIED = DATA / 'hf-llama-untied'  # float32, one file, plain RoPE, eps 1e-6
TIED = DATA / 'hf-llama-tied-llama3'  # bfloat16, four files and an index, llama3 RoPE
MIXTRAL = DATA / 'hf-mixtral'  # float32, 4 experts of width 32, 2 a token
QWEN3 = DATA / 'hf-qwen3'  # float32, q/k norms, tied, norms' weights random
GEMMA3 = DATA / 'hf-gemma3'  # float32, layers local, global, local; a window of 4 keys
GEMMA3_VISION = DATA / 'hf-gemma3-vision'  # the same shapes, a SigLIP tower beside them
QWEN3_MOE = DATA / 'hf-qwen3-moe'  # float32, q/k norms, 8 experts of width 16, 2 a token
MOES = {  # path: (experts, width, renormalised, load-balancing weight, an expert's up projection)
    MIXTRAL: (4, 32, True, 0.04, 'block_sparse_moe.experts.3.w3.weight'),
    QWEN3_MOE: (8, 16, False, 0.002, 'mlp.experts.3.up_proj.weight'),
}


def hf_config(path, **changes):
  c = base.get_config()
  c.init_from = f'hf:{path}'
  c.model.compute_dtype = 'float32'
  c.batch_size, c.seq_len = 8, 32
  c.mesh.update(data=2, fsdp=4)
  c.data.paths, c.data.validation_fraction = SMALL_CORPUS, 0.1
  c.update(changes)
  return c


def tensors(path) -> dict:
  return {k: v for f in sorted(path.glob('*.safetensors')) for k, v in load_file(f).items()}


def assert_computes_goldens(setup, params, path, atol=1e-4):
  """The model of `params` gives transformers' logits on the goldens' tokens (within `atol`) and
  continues their prompts greedily with the same tokens."""
  golden = np.load(path / 'goldens.npz')
  model = nnx.merge(setup.graphdef, params)
  with jax.set_mesh(setup.mesh):
    logits = jax.jit(lambda model, tokens: model(tokens))(model, golden['tokens'])
  np.testing.assert_allclose(logits, golden['logits'], atol=atol, rtol=0)
  greedy = generate(model, golden['tokens'][:, :8].tolist(), 12)
  np.testing.assert_array_equal(greedy, golden['greedy'])


def assert_exports(params, setup, config, output, expected: dict) -> dict:
  """Exports `params` (fp32) to `output`: exactly the tensors `expected` (name: array), bit for
  bit. Returns the config.json it wrote."""
  huggingface.export(jax.tree.map(np.asarray, params), setup.model_cfg,
                     tokenizers.load(config.data), config.seq_len, output, dtype='float32',
                     max_shard_bytes=10**9, log=lambda *_: None)
  exported = tensors(output)
  assert sorted(exported) == sorted(expected)
  for name in expected:
    np.testing.assert_array_equal(exported[name], expected[name], err_msg=name)
  return json.loads((output / 'config.json').read_text())


@pytest.mark.parametrize('path', [UNTIED, TIED], ids=['untied-fp32', 'tied-bf16-llama3'])
def test_an_imported_checkpoint_computes_what_transformers_computes(path):
  config = settings.resolve(hf_config(path))
  assert (config.model.d_model, config.model.n_layers, config.model.vocab_size) == (64, 2, 320)
  assert config.data.tokenizer_model == str(path / 'tokenizer.json')
  setup = build(config)
  params = huggingface.load_params(path, setup.abstract_state.params, setup.model_cfg)
  hf = tensors(path)
  wq = params['blocks']['attn']['wq'][...]  # [layers, D, N, H], D split 4 ways
  assert wq.sharding == setup.abstract_state.params['blocks']['attn']['wq'].get_value().sharding
  for shard in wq.addressable_shards:
    layer, rows = shard.index[0], shard.index[1]
    expected = np.stack([hf[f'model.layers.{i}.self_attn.q_proj.weight']
                         for i in range(2)])[layer].astype(np.float32)
    np.testing.assert_array_equal(shard.data, expected.transpose(0, 2, 1)[:, rows]
                                  .reshape(shard.data.shape))
  assert_computes_goldens(setup, params, path)


@pytest.mark.integration
def test_a_run_from_a_hugging_face_checkpoint_exports_it_back_bit_exact(tmp_path):
  """train.py from hf:DIR (its settings, tokenizer and weights) → checkpoint → export.py →
  the same tensors transformers saved, and its context limit; DIR may move away meanwhile (the
  run keeps its tokenizer); and transformers, where installed, loads the export."""
  workdir, output = tmp_path / 'run', tmp_path / 'export'
  source = shutil.copytree(UNTIED, tmp_path / 'hf')
  config = hf_config(source, workdir=str(workdir), train_steps=2, checkpoint_every=2,
                     eval_every=0)
  config.optimizer.learning_rate = 0.0  # the weights stay the checkpoint's
  records = loop.run(config)
  assert abs(records[-1]['loss'] - np.log(320)) < 0.5
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['model']['norm_eps'] == 1e-6 and saved['data']['tokenizer'] == 'hf'
  source.rename(tmp_path / 'moved')
  done = subprocess.run([sys.executable, 'export.py', f'--workdir={workdir}', '--step=2',
                         f'--output={output}', '--max_shard_gb=0.0002'], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert (output / 'model.safetensors.index.json').is_file()  # 0.2 MB shards: several files
  assert not list(tmp_path.glob('.export.partial-*'))
  original, exported = tensors(UNTIED), tensors(output)
  assert sorted(original) == sorted(exported)
  for name in original:
    np.testing.assert_array_equal(exported[name], original[name], err_msg=name)
  hf_config_json = json.loads((output / 'config.json').read_text())
  assert hf_config_json['rms_norm_eps'] == 1e-6 and hf_config_json['tie_word_embeddings'] is False
  assert hf_config_json['max_position_embeddings'] == json.loads(
      (UNTIED / 'config.json').read_text())['max_position_embeddings'] != config.seq_len
  assert (output / 'tokenizer.json').read_bytes() == (UNTIED / 'tokenizer.json').read_bytes()
  umask = os.umask(0o022)
  os.umask(umask)
  assert {f.name: f.stat().st_mode & 0o777 for f in output.iterdir()} == {
      f.name: 0o666 & ~umask for f in output.iterdir()}  # as any file the user writes
  assert output.stat().st_mode & 0o777 == 0o777 & ~umask
  refusals = {  # each one line, exit 2, nothing written
      ('export.py', f'--workdir={workdir}', '--step=7', f'--output={tmp_path / "a"}'):
          f'error: --step=7: {workdir}/checkpoints holds checkpoints of steps [2]; give one of '
          'them',
      ('sample.py', f'--workdir={workdir}', '--max_len=10000010', '--max_new_tokens=10000000'):
          'error: --max_len=10,000,010 is more than 16× the seq_len the model was trained at',
      ('with a full disk', 'export.py', f'--workdir={workdir}', f'--output={tmp_path / "b"}'):
          f'error: --output={tmp_path / "b"}: File too large; raise the file size limit (ulimit '
          '-f), or write somewhere else; nothing was written there',
  }
  processes = {args: subprocess.Popen(
      with_file_size_limit(100_000, [sys.executable, *args[1:]]) if 'full' in args[0] else
      [sys.executable, *args], cwd=REPO, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE) for args in refusals}
  for args, expected in refusals.items():
    _, err = processes[args].communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert processes[args].returncode == 2 and len(lines) == 1, (args, err[-2000:])
    assert lines[0].startswith(expected), (args, lines)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['export', 'moved', 'run']
  # Re-imported, the export is the run's checkpoint, bit for bit.
  setup = build(settings.resolve(hf_config(output)))
  again = huggingface.load_params(output, setup.abstract_state.params, setup.model_cfg)
  restored, _ = checkpoint_lib.restore_params(str(workdir), setup.abstract_state.params,
                                              config.model)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(a, b)
  try:
    import torch
    import transformers
  except ImportError:
    return  # CI has no torch: the goldens above stand in for it
  model = transformers.AutoModelForCausalLM.from_pretrained(output).eval()
  golden = np.load(UNTIED / 'goldens.npz')
  with torch.no_grad():
    logits = model(torch.from_numpy(golden['tokens']).long()).logits.numpy()
  np.testing.assert_allclose(logits, golden['logits'], atol=1e-5, rtol=0)


@pytest.mark.integration
@pytest.mark.parametrize('path', list(MOES), ids=['mixtral', 'qwen3-moe'])
def test_an_moe_computes_what_transformers_computes_and_exports_back_bit_exact(path, tmp_path):
  """Its experts split over `fsdp` and `tensor`; the export holds every tensor transformers saved,
  bit for bit, and a config.json that reads as the original's settings."""
  experts, width, renormalised, balance, up_proj = MOES[path]
  # the kernel takes a tensor share of the width only in multiples of 16
  config = hf_config(path)
  config.mesh.update(dict(data=1, fsdp=4, tensor=2) if width // 2 % 16 == 0 else
                     dict(data=2, fsdp=4, tensor=1))
  config = settings.resolve(config)
  m = config.model
  assert (m.experts, m.experts_per_token, m.expert_d_ff, m.router, m.router_renormalize,
          m.qk_norm) == (experts, 2, width, 'softmax', renormalised, path == QWEN3_MOE)
  assert m.load_balance_loss == pytest.approx(balance)  # transformers' weighs k × ours
  setup = build(config)
  params = huggingface.load_params(path, setup.abstract_state.params, setup.model_cfg)
  hf = tensors(path)
  w_up = np.asarray(params['blocks']['mlp']['w_up'][...])  # [layers, E, D, F]
  np.testing.assert_array_equal(w_up[1, 3], hf[f'model.layers.1.{up_proj}'].T)
  assert_computes_goldens(setup, params, path)

  output = tmp_path / 'export'
  written = assert_exports(params, setup, config, output, hf)
  original = json.loads((path / 'config.json').read_text())
  for key in ('model_type', 'architectures', 'num_local_experts', 'num_experts',
              'num_experts_per_tok', 'moe_intermediate_size', 'norm_topk_prob',
              'router_aux_loss_coef', 'sliding_window'):
    assert key not in original or written[key] == original[key], key
  if path == MIXTRAL:
    assert written['intermediate_size'] == original['intermediate_size']
  assert huggingface.model_settings(output) == huggingface.model_settings(path)


def test_a_qwen3_computes_what_transformers_computes_and_exports_back_bit_exact(tmp_path):
  """Qwen3 dense: Llama with per-head q/k norms before RoPE, here tied; split over fsdp and
  tensor, and over fsdp, tensor and sequence (a ring), it gives transformers' logits and greedy
  tokens, and exports to the same tensors and a
  config.json that reads back as the same settings."""
  config = hf_config(QWEN3)
  config.mesh.update(data=1, fsdp=4, tensor=2)
  config = settings.resolve(config)
  m = config.model
  assert (m.qk_norm, m.experts, m.tie_embeddings, m.rope_theta) == (True, 0, True, 1e6)
  setup = build(config)
  params = huggingface.load_params(QWEN3, setup.abstract_state.params, setup.model_cfg)
  hf = tensors(QWEN3)
  np.testing.assert_array_equal(params['blocks']['attn']['k_norm']['scale'][...][1],
                                hf['model.layers.1.self_attn.k_norm.weight'])
  assert_computes_goldens(setup, params, QWEN3, atol=1e-5)
  # and with the sequence split too, attention a ring of our kernel's (interpreted here)
  ring = hf_config(QWEN3, mesh=dict(data=1, fsdp=2, tensor=2, sequence=2))
  ring.model.context_parallel = 'ring'
  ring = build(settings.resolve(ring))
  assert (ring.model_cfg.attention, ring.model_cfg.context_parallel) == ('pallas', 'ring')
  assert ring.mesh.shape['sequence'] == 2 and ring.mesh.shape['tensor'] == 2
  assert_computes_goldens(ring, huggingface.load_params(QWEN3, ring.abstract_state.params,
                                                        ring.model_cfg), QWEN3)
  output = tmp_path / 'export'
  written = assert_exports(params, setup, config, output, hf)
  assert (written['model_type'], written['architectures']) == ('qwen3', ['Qwen3ForCausalLM'])
  assert huggingface.model_settings(output) == huggingface.model_settings(QWEN3)
  # A Qwen3 whose layers attend in a sliding window is refused, by the key that says so.
  original = json.loads((QWEN3 / 'config.json').read_text())
  for change, message in [({'use_sliding_window': True, 'sliding_window': 16},
                           'use_sliding_window=True, sliding_window=16'),
                          ({'layer_types': ['full_attention', 'sliding_attention']},
                           "layer_types=\\['full_attention', 'sliding_attention'\\]")]:
    (tmp_path / 'config.json').write_text(json.dumps({**original, **change}))
    with pytest.raises(ValueError, match=rf'its config.json has {message}; meshlm imports Llama, '
                                         'Qwen3'):
      huggingface.model_settings(tmp_path)


def assert_gemma3_computes_goldens(mesh: dict, attention: str):
  """hf-gemma3 on `mesh` with `attention`: transformers' logits within 1e-5, packed documents
  each as if alone, and its greedy tokens through the cache. Returns (setup, params)."""
  golden = np.load(GEMMA3 / 'goldens.npz')
  given = hf_config(GEMMA3, mesh=mesh)
  given.model.attention = attention
  setup = build(settings.resolve(given))
  params = huggingface.load_params(GEMMA3, setup.abstract_state.params, setup.model_cfg)
  model = nnx.merge(setup.graphdef, params)
  with jax.set_mesh(setup.mesh):
    logits = jax.jit(lambda model, tokens: model(tokens))(model, golden['tokens'])
    # two documents of 12 packed in each row (positions from 0 in each): each as if alone
    tokens = np.concatenate([golden['tokens'][:, :12], golden['tokens'][::-1, :12]], 1)
    positions = np.tile(np.concatenate([np.arange(12)] * 2), (2, 1))
    segments = np.repeat([[1] * 12 + [2] * 12], 2, 0)
    packed = jax.jit(lambda model, t, p, s: model(t, p, s))(model, tokens, positions, segments)
  np.testing.assert_allclose(logits, golden['logits'], atol=1e-5, rtol=0)
  np.testing.assert_allclose(packed[:, :12], golden['logits'][:, :12], atol=1e-5, rtol=0)
  np.testing.assert_allclose(packed[:, 12:], golden['logits'][::-1, :12], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(generate(model, golden['tokens'][:, :8].tolist(), 12),
                                golden['greedy'])
  return setup, params


@pytest.mark.integration
def test_a_gemma3_with_our_kernel_over_fsdp_and_tensor_computes_what_transformers_computes():
  """The windows as our kernel's input (interpreted here), each layer its own, blocks skipped."""
  assert_gemma3_computes_goldens(dict(data=1, fsdp=4, tensor=2), 'pallas')


def test_a_gemma3_computes_what_transformers_computes_past_its_window_and_exports_back_bit_exact(
    tmp_path):
  """Gemma 3 (text): (1 + w) norms before and after attention and the MLP, GeGLU, scaled
  embeddings, query_pre_attn_scalar, tied; local layers (a window of 4 keys, RoPE base 1e4)
  around a global one (1e6, linear ×8). transformers' logits within 1e-5 over 24 tokens, and its
  greedy tokens (decoded 12 past 8, through the cache), with the XLA path on data × fsdp (our
  kernel's: the test above); packed rows as transformers computes each document; the export is
  transformers' tensors bit for bit and reads back as the same settings."""
  config = settings.resolve(hf_config(GEMMA3))
  m = config.model
  assert (m.sliding_window, m.global_every, m.rope_local_theta, m.rope_type, m.rope_factor,
          m.query_scale, m.mlp_activation) == (4, 2, 1e4, 'linear', 8.0, 24.0, 'gelu_tanh')
  assert m.norm_plus_one and m.post_norms and m.embed_scale and m.qk_norm and m.tie_embeddings
  assert m.local_layers == (True, False, True) and m.windows == 'mixed'
  setup, params = assert_gemma3_computes_goldens(dict(data=2, fsdp=4), 'xla')
  hf = tensors(GEMMA3)
  np.testing.assert_array_equal(params['blocks']['mlp_norm']['scale'][...][2],
                                hf['model.layers.2.pre_feedforward_layernorm.weight'])
  output = tmp_path / 'export'
  assert_exports(params, setup, config, output, hf)
  assert huggingface.model_settings(output) == huggingface.model_settings(GEMMA3)
  # The Hub's configs, written by transformers 4: the layers' pattern as a number, RoPE apart.
  original = json.loads((GEMMA3 / 'config.json').read_text())
  v4 = {k: v for k, v in original.items() if k not in ('layer_types', 'rope_parameters')}
  v4.update(rope_theta=1e6, rope_local_base_freq=1e4,
            rope_scaling={'rope_type': 'linear', 'factor': 8.0})
  (tmp_path / 'config.json').write_text(json.dumps(v4))
  assert huggingface.model_settings(tmp_path) == huggingface.model_settings(GEMMA3)
  # What meshlm's Gemma 3 does not compute is refused, naming the key.
  for change, message in [({'final_logit_softcapping': 30.0}, 'final_logit_softcapping=30.0'),
                          ({'hidden_activation': 'gelu'}, "hidden_activation='gelu'"),
                          ({'use_bidirectional_attention': True},
                           'use_bidirectional_attention=True'),
                          ({'layer_types': ['full_attention', 'sliding_attention',
                                            'sliding_attention']}, 'layer_types=')]:
    (tmp_path / 'config.json').write_text(json.dumps({**original, **change}))
    with pytest.raises(ValueError, match=rf'its config.json has {message}.*; meshlm imports '
                                         "Gemma 3's text models"):
      huggingface.model_settings(tmp_path)
  # and on export, a model no family's checkpoint holds, naming the setting
  for change, message in [(dict(post_norms=False), 'post_norms=False: a Gemma 3 checkpoint'),
                          (dict(norm_plus_one=False), 'post_norms=True: a Llama or Qwen3 '
                                                      'checkpoint')]:
    with pytest.raises(ValueError, match=rf'config.model.{message} cannot hold it'):
      huggingface.check_exportable(dataclasses.replace(setup.model_cfg, **change))


@pytest.mark.integration
def test_a_multimodal_gemma3_imports_its_text_model_saying_what_it_leaves_out(tmp_path):
  """Gemma3ForConditionalGeneration, as the Hub's 4B to 27B are: its text_config and its
  language model's tensors give transformers' logits on text; the vision tower and projector are
  named as left out, and the export is the text model's tensors bit for bit (Gemma3ForCausalLM:
  transformers loads it with the same logits, checked once here with torch)."""
  config = settings.resolve(hf_config(GEMMA3_VISION))
  assert config.model.sliding_window == 4 and config.model.norm_plus_one
  assert huggingface.left_out(GEMMA3_VISION).startswith(
      'multi_modal_projector, vision_tower (34 tensors, 38,176 parameters)')
  assert huggingface.left_out(GEMMA3) is None
  setup = build(config)
  params = huggingface.load_params(GEMMA3_VISION, setup.abstract_state.params, setup.model_cfg)
  assert_computes_goldens(setup, params, GEMMA3_VISION, atol=1e-5)
  output = tmp_path / 'export'
  text = {name.replace('language_model.model.', 'model.'): a
          for name, a in tensors(GEMMA3_VISION).items() if name.startswith('language_model.')}
  written = assert_exports(params, setup, config, output, text)
  assert written['architectures'] == ['Gemma3ForCausalLM']


@pytest.mark.integration
def test_a_gemma3_over_a_sequence_split_attends_within_its_windows_as_transformers_does():
  """Each device's queries against the keys all-gathered over `sequence`, our kernel skipping
  the gathered blocks outside a local layer's window."""
  config = hf_config(GEMMA3, mesh=dict(data=1, fsdp=2, tensor=2, sequence=2))
  config.model.attention = 'pallas'
  setup = build(settings.resolve(config))
  assert setup.mesh.shape['sequence'] == 2 and setup.model_cfg.context_parallel == 'all_gather'
  assert_computes_goldens(setup, huggingface.load_params(
      GEMMA3, setup.abstract_state.params, setup.model_cfg), GEMMA3)


def test_an_moe_that_mixtral_cannot_hold_is_refused_naming_the_setting():
  config = base.get_config().model
  config.update(vocab_size=384, experts=4, router='sigmoid')
  from model import ModelConfig
  with pytest.raises(ValueError, match=r"config.model.router='sigmoid': the MoE checkpoints"):
    huggingface.check_exportable(ModelConfig.from_config(config))


def test_virtual_stages_take_the_layers_in_their_chunks():
  flat = settings.resolve(hf_config(UNTIED))
  chunked = flat.replace(model={'virtual_stages': 2})
  by_layer = [huggingface.load_params(UNTIED, s.abstract_state.params, s.model_cfg)
              for s in (build(flat), build(chunked))]
  for a, b in zip(*map(jax.tree.leaves, by_layer)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).reshape(a.shape))


def test_the_checkpoint_decides_the_model_and_says_what_it_cannot_import(tmp_path):
  given = hf_config(UNTIED)
  given.model.d_model = 128
  with pytest.raises(ValueError, match=r'config.model.d_model=128, but config.init_from=hf:.*'
                                       r'hf-llama-untied has hidden_size=64 in its config.json'):
    settings.resolve(given)
  # transformers 4 writes rope_theta and rope_scaling where 5 writes rope_parameters.
  v5 = json.loads((TIED / 'config.json').read_text())
  v4 = {k: v for k, v in v5.items() if k != 'rope_parameters'}
  v4['rope_theta'] = v5['rope_parameters']['rope_theta']
  v4['rope_scaling'] = {k: v for k, v in v5['rope_parameters'].items() if k != 'rope_theta'}
  (tmp_path / 'config.json').write_text(json.dumps(v4))
  assert huggingface.model_settings(tmp_path) == huggingface.model_settings(TIED)
  assert huggingface.model_settings(TIED)['rope_original_length'] == 64
  for change, message in [({'attention_bias': True}, 'attention_bias=True'),
                          ({'model_type': 'mistral'}, "model_type='mistral'"),
                          ({'rope_scaling': {'rope_type': 'yarn'}}, "rope_type='yarn'")]:
    (tmp_path / 'config.json').write_text(json.dumps({**v4, **change}))
    with pytest.raises(ValueError, match=rf'config.init_from=hf:{tmp_path}: its config.json has '
                                         rf'{message}; meshlm imports Llama'):
      huggingface.model_settings(tmp_path)
  # Weights that are not the model config.json describes, found before anything is loaded.
  broken = tmp_path / 'broken'
  shutil.copytree(UNTIED, broken)
  described = json.loads((broken / 'config.json').read_text())
  (broken / 'config.json').write_text(json.dumps({**described, 'num_hidden_layers': 3}))
  setup = build(settings.resolve(hf_config(broken)))
  with pytest.raises(ValueError, match=r'lacks tensor model\.layers\.2\.'):
    huggingface.check_tensors(broken, setup.abstract_state.params, setup.model_cfg)
  (broken / 'config.json').write_text(json.dumps({**described, 'intermediate_size': 64}))
  setup = build(settings.resolve(hf_config(broken)))
  with pytest.raises(ValueError, match=r'mlp.down_proj.weight is F32 \[64, 128\], not \[64, 64\]'):
    huggingface.check_tensors(broken, setup.abstract_state.params, setup.model_cfg)


def test_a_failed_export_leaves_nothing_and_an_export_never_overwrites(tmp_path, monkeypatch):
  config = settings.resolve(hf_config(TIED))
  setup = build(config)
  params = huggingface.load_params(TIED, setup.abstract_state.params, setup.model_cfg)
  (tmp_path / 'taken').mkdir()
  (tmp_path / 'taken' / 'keep.txt').write_text('mine')
  with pytest.raises(ValueError, match=r'--output=.*taken exists and is not an empty directory'):
    huggingface.check_output(tmp_path / 'taken')
  written = []

  def save_file(tensors, path, metadata):
    if written:
      raise OSError(28, 'No space left on device')
    written.append(path)
    path.write_bytes(b'partial')

  monkeypatch.setattr(huggingface, 'save_file', save_file)
  with pytest.raises(faults.Fault, match=r'--output=.*out: No space left on device; free space '
                                         r'on that disk, or write somewhere else; nothing was '
                                         r'written there'):
    huggingface.export(params, setup.model_cfg, None, 32, tmp_path / 'out', dtype='bfloat16',
                       max_shard_bytes=50_000, log=lambda *_: None)
  assert written and sorted(p.name for p in tmp_path.iterdir()) == ['taken']


def test_an_export_refuses_an_overflowing_cast_a_file_for_a_folder_and_clears_a_dead_ones_leftovers(
    tmp_path):
  with pytest.raises(ValueError, match=r'--dtype=float16: tensor w holds 100000, past the largest '
                                       r'float16 \(65504\)'):
    huggingface.cast(np.array([1.0, -1e5], np.float32), np.dtype(np.float16), 'w')
  assert huggingface.cast(np.array([1e5], np.float32), np.dtype(np.float32), 'w')[0] == 1e5
  (tmp_path / 'file').write_text('mine')
  with pytest.raises(ValueError, match=r'file is a file, not a directory'):
    huggingface.check_output(tmp_path / 'file' / 'sub')
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  prefix = huggingface._partial_prefix(tmp_path / 'out')
  left, live = tmp_path / f'{prefix}{dead.pid}-x', tmp_path / f'{prefix}{os.getpid()}-y'
  left.mkdir(), live.mkdir()
  with huggingface.written_whole(tmp_path / 'out') as partial:
    (partial / 'a').write_text('a')
  assert not left.exists() and live.exists() and (tmp_path / 'out' / 'a').is_file()
