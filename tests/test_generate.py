"""Generation with a KV cache equals generation by recomputing the whole sequence every step:
greedy and sampled (same keys), prompts of different lengths in one batch, tied and untied heads."""

import json
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import kv_cache as kv_cache_benchmark
from inference import generate as gen
from inference import sampling
from model import ModelConfig, Transformer
from model import kv_cache
from runtime import faults
from tests.conftest import tiny_config
from training import loop

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_model(**model):
  c = tiny_config()
  c.model.update(model)
  return Transformer(ModelConfig.from_config(c.model), rngs=nnx.Rngs(3))


def recompute(model, prompts, n, key, temperature, top_k, vocab_size=None, eos_id=None,
              pad_id=0, top_p=1.0):
  """The reference: for every new token, the full forward pass over each row's whole sequence
  so far (right-padded to one length, which causal attention never looks at)."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
  out, width = [], max(map(len, prompts)) + n
  for row, prompt in enumerate(prompts):
    tokens = np.full((1, width), pad_id, np.int32)
    tokens[0, :len(prompt)] = prompt
    length, new, done = len(prompt), [], False
    for i in range(n):
      logits = forward(state, jnp.asarray(tokens))[:, length - 1]
      keys = gen.row_keys(key, i, len(prompts))[row:row + 1]
      token = int(gen.sample(gen.mask_vocab(logits, vocab_size), keys,
                             gen.Sampling(temperature, top_k, top_p))[0])
      token = pad_id if done else token
      done = done or token == eos_id
      new.append(token)
      tokens[0, length] = token
      length += 1
    out.append(new)
  return out


PROMPTS = [[1, 5, 9, 200, 7], [1], [1, 42, 42]]


@pytest.mark.parametrize('temperature, top_k, top_p, tie', [
    (0.0, 0, 1.0, False), (1.0, 0, 1.0, True), (0.8, 5, 1.0, False), (1.0, 0, 0.3, False)])
def test_cached_generation_equals_full_recompute(temperature, top_k, top_p, tie):
  model = tiny_model(tie_embeddings=tie)
  key = jax.random.key(7)
  got = gen.generate(model, PROMPTS, 12, key=key, temperature=temperature, top_k=top_k,
                     top_p=top_p, vocab_size=300)
  assert got.tolist() == recompute(model, PROMPTS, 12, key, temperature, top_k, 300, top_p=top_p)
  assert got.max() < 300  # padding ids past the tokenizer's vocabulary are never drawn


@pytest.mark.integration
def test_rows_stop_at_eos():
  model = tiny_model()
  key = jax.random.key(0)
  first = gen.generate(model, PROMPTS, 10, key=key)
  eos = int(first[0, 3])  # pretend the 4th greedy token of row 0 is EOS
  got = gen.generate(model, PROMPTS, 10, key=key, eos_id=eos, pad_id=0)
  assert list(got[0, :4]) == list(first[0, :4]) and (got[0, 4:] == 0).all()
  assert got.tolist() == recompute(model, PROMPTS, 10, key, 0.0, 0, eos_id=eos)
  with pytest.raises(ValueError, match=r'top_p=0 must be in \(0, 1\]'):
    gen.generate(model, PROMPTS, 10, key=key, temperature=1.0, top_p=0)


def test_top_k_draws_only_the_k_most_likely():
  logits = jnp.array([[0.0, 3.0, 1.0, 2.5, -1.0]] * 4000)
  draws = np.asarray(gen.sample(logits, gen.row_keys(jax.random.key(1), 0, 4000),
                                gen.Sampling(1.0, 2)))
  assert set(draws) == {1, 3}
  assert list(np.asarray(gen.sample(logits[:1], None, gen.Sampling()))) == [1]


def test_top_p_keeps_the_fewest_likeliest_tokens_reaching_p_as_transformers_does():
  """The nucleus of each row, against transformers' TopPLogitsWarper's rule (sorted ascending,
  the tail whose cumulative probability is at most 1 − p dropped) in numpy; draws stay in it."""
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (64, 12)).astype(np.float32)
  for top_p in (0.05, 0.5, 0.9, 0.999):
    kept = np.isfinite(np.asarray(gen.tempered(jnp.asarray(logits), gen.Sampling(1.0, 0, top_p))))
    for row, keep in zip(logits, kept):
      order = np.argsort(row)  # ascending
      probs = np.exp(row[order] - row.max())
      probs /= probs.sum()
      want = np.ones(12, bool)
      want[order[np.cumsum(probs) <= 1 - top_p]] = False
      assert (keep == want).all(), (top_p, keep, want)
  draws = np.asarray(gen.sample(jnp.asarray(logits[:1].repeat(2000, 0)),
                                gen.row_keys(jax.random.key(3), 0, 2000), gen.Sampling(1.0, 0, 0.5)))
  nucleus = np.isfinite(np.asarray(gen.tempered(jnp.asarray(logits[:1]),
                                                gen.Sampling(1.0, 0, 0.5))))[0]
  assert set(draws) <= set(np.flatnonzero(nucleus)) and len(set(draws)) == nucleus.sum()


def test_cached_logits_match_the_full_pass():
  model = tiny_model()
  tokens = jnp.array([[1, 8, 20, 33, 2, 90, 17]])
  full = model(tokens)
  cache = model.init_cache(1, 10)
  prefill, cache = model.decode(tokens[:, :4], jnp.arange(4)[None], cache)
  steps = [prefill]
  for t in range(4, 7):
    logits, cache = model.decode(tokens[:, t:t + 1], jnp.array([[t]]), cache)
    steps.append(logits)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_bad_generation_arguments_are_named():
  with pytest.raises(ValueError, match='at least one token'):
    gen.generate(tiny_model(), [[1], []], 4)
  with pytest.raises(ValueError, match='temperature'):
    gen.generate(tiny_model(), [[1]], 4, temperature=-1.0)


@pytest.mark.integration
def test_sample_command_continues_prompts_from_a_checkpoint(tmp_path, monkeypatch, capsys):
  c = tiny_config(fsdp=8)
  c.workdir, c.train_steps, c.checkpoint_every, c.eval_every = str(tmp_path), 4, 4, 0
  c.model.draft_heads, c.model.draft_kind = 2, 'medusa'  # sample.py speculates with them
  loop.run(c)
  command = [sys.executable, 'sample.py', f'--workdir={tmp_path}', '--prompt=def ',
             '--prompt=import', '--max_new_tokens=16', '--temperature=0']
  result = subprocess.run([*command, '--kv_cache=int8'], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert (f'# {tmp_path}/checkpoints/4: temperature 0.0, top_k 40, top_p 1.0, seed 0, int8 '
          'cache (72 bytes a token a layer)') in result.stdout  # 2 × 2 kv heads × (16 int8 values + a fp16 scale)
  assert "--- prompt 'def '\ndef " in result.stdout and "--- prompt 'import'\nimport" in result.stdout
  assert '# speculative: ' in result.stdout and 'guesses kept, head by head: ' in result.stdout
  # The command's greedy text, speculated, is what plain decoding gives, on a mesh other than
  # the run's.
  loaded = sampling.load(str(tmp_path / 'checkpoints' / '4'))
  texts = sampling.complete(loaded, ['def ', 'import'], 16, temperature=0, cache='int8')
  expected = f"--- prompt 'def '\ndef {texts[0]}\n--- prompt 'import'\nimport{texts[1]}\n"
  assert expected.replace('\r\n', '\n').replace('\r', '\n') in result.stdout  # text mode

  # export.py writes the model without its heads, and says so.
  result = subprocess.run([sys.executable, 'export.py', f'--workdir={tmp_path}',
                           f'--output={tmp_path / "hf"}'], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert '# its 2 draft heads are left out' in result.stdout
  assert (tmp_path / 'hf' / 'config.json').exists()

  # Asked for ten million tokens, it stops at once with one line, before allocating anything
  # (sample.py says it so: scripts/fault_probe.py's "sample: ten million tokens").
  with pytest.raises(ValueError, match='--max_new_tokens=10000000: the longest prompt and its '
                                       'continuation make 10,000,007 tokens, more than the '
                                       'seq_len it was trained at, 32'):
    sampling.complete(loaded, ['def ', 'import'], 10_000_000)
  with pytest.raises(ValueError, match=r'--max_len=2,000,000,000 is more than 16× the seq_len the '
                                       r'model was trained at \(32\).*give at most --max_len=512'):
    sampling.complete(loaded, ['def '], 10**9, max_len=2 * 10**9)
  with monkeypatch.context() as m:  # the memory there is, the bound past that
    m.setattr(sampling, 'MAX_LEN_FACTOR', 10**9)
    with pytest.raises(ValueError, match=r'--max_len=2000000000: the full cache of 1 prompt\(s\) × '
                                         r'1,000,000,005 tokens needs .* GiB, more than'):
      sampling.complete(loaded, ['def '], 10**9, max_len=2 * 10**9)
  assert sampling.complete(loaded, ['def '], 40, temperature=0, max_len=64)  # past 32, asked

  # The cache benchmark on this checkpoint: each kind's bytes, loss and greedy agreement.
  kv_cache_benchmark.main([f'--workdir={tmp_path}', '--rows=4', '--prompts=2',
                           '--prompt_tokens=8', '--new_tokens=6'])
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])['kinds']
  assert figures['full']['greedy_same'] == 1 and figures['x']['bytes_of_full'] == 1
  assert figures['int8']['bytes_of_full'] == 72 / 256  # the model computes in fp32
  for kind in kv_cache.QUANTIZED:
    assert abs(figures[kind]['bits_per_byte_change']) < 0.01, figures


def test_sampling_from_a_workdir_without_checkpoints_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match='--workdir=.* holds no checkpoint'):
    sampling.load(str(tmp_path))


def test_a_runs_own_copies_are_checked_against_what_its_checkpoint_trained_with(tmp_path):
  """sample.py, export.py and evaluate.py load through sampling.load, which holds the run's own
  tokenizer and chat template copies to the fingerprints its checkpoint recorded: a changed copy
  is a Fault naming it (the fault probe replaces them in real runs), an unchanged one passes."""
  workdir = tmp_path / 'run'
  (workdir / 'tokenizer').mkdir(parents=True)
  (workdir / 'chat_template.jinja').write_text('{{ messages }}')
  checkpoint = workdir / 'checkpoints' / '6'
  run = SimpleNamespace(tokenizer=SimpleNamespace(fingerprint='hf-new'),
                        template=SimpleNamespace(digest='sha256:same'))
  sampling.check_copies(run, {'tokenizer': 'hf-new', 'chat_template': 'sha256:same'}, checkpoint)
  sampling.check_copies(run, {}, checkpoint)  # a checkpoint that recorded nothing: not judged
  with pytest.raises(faults.Fault, match=f"{workdir / 'tokenizer'}: the tokenizer is hf-new now, "
                     f'but checkpoint {checkpoint} was trained with hf-old'):
    sampling.check_copies(run, {'tokenizer': 'hf-old'}, checkpoint)
  with pytest.raises(faults.Fault, match=f"{workdir / 'chat_template.jinja'}: the chat template"):
    sampling.check_copies(run, {'chat_template': 'sha256:old'}, checkpoint)
