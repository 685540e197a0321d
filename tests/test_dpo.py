"""DPO (training/dpo.py: preference_sums; config.data.record='preference'): a pair takes a row,
its chosen answer segment 1 and its rejected one segment 2; the loss starts at ln 2 with the
policy its own reference, and its value and gradient are Rafailov et al.'s formula computed
directly from the model's logits, on one device and sharded, with the reference held in the state
(full fine-tuning) or the frozen base without adapters (LoRA); the walkthrough learns the held-out
preference, and a resumed run measures against the same reference."""

import json
import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base, dpo
from data import chat, corpus, packing, records
from data.packing import Lane
from data.stdlib_chat import conversations, record
from tests.conftest import STDLIB
from training import loop, settings
from training.programs import compile_train_step
from training.optimizer import trained
from training.state import PreferenceState, TrainState, build
import sharding

B, L = 8, 160


def pairs(n, longest=None):
  """n preference records of the walkthrough's kind (chosen: a docstring; rejected: reversed),
  with `longest`, of at most that many bytes of prompt and answer."""
  out = []
  for i, messages in enumerate(conversations(pathlib.Path(STDLIB)), 1):
    r = record(i, messages, 'preference')
    if longest is None or len((r['prompt'] + r['chosen']).encode()) <= longest:
      out.append(r)
    if len(out) == n:
      return out
  raise AssertionError('too few docstrings')


def dpo_config(lora=False, **mesh):
  c = base.get_config()
  c.data.record = 'preference'
  c.batch_size, c.seq_len, c.microbatches = B, L, 2
  c.model.compute_dtype = 'float32'
  c.mesh.update(dict(data=1, stage=1, fsdp=-1, expert=1, tensor=1, sequence=1))
  c.mesh.update(mesh)
  c.dpo.beta, c.dpo.label_smoothing = 0.5, 0.1
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 1e-2, 0
  if lora:
    c.model.lora_rank, c.model.lora_alpha, c.init_from = 4, 8.0, 'random'
  return c


def pair_batch(run, n=B):
  """A batch of n pairs as the data pipeline lays them out: one a row."""
  encode = chat.Encoder(run.tokenizer, 'preference')
  fields = records.Fields.of(run.data)
  docs = encode([records.stored(r, fields).encode() for r in pairs(n, longest=L // 2 - 2)])
  lanes = [Lane(lambda g: docs[g] if g < len(docs) else None, j, n, L, run.tokenizer.pad_id,
                pairs=True) for j in range(n)]
  rows = [lane.next_row() for lane in lanes]
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def direct_loss(graphdef, policy, reference, batch, beta, eps):
  """DPO's loss from full logits: mean over pairs of −(1−ε)·log σ(h) − ε·log σ(−h), h = β·((log
  π − log π_ref)(chosen) − (log π − log π_ref)(rejected)), log π summed over the answers' tokens."""
  def logps(params):
    logits = nnx.merge(graphdef, params)(batch['inputs'], batch['positions'],
                                         batch['segment_ids'])
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch['targets'][..., None], -1)[..., 0]
    logp = logp * batch['weights']
    return [(logp * (batch['segment_ids'] == s)).sum(1) for s in (1, 2)]
  (pc, pr), (rc, rr) = logps(policy), logps(jax.lax.stop_gradient(reference))
  h = beta * ((pc - rc) - (pr - rr))
  return (-(1 - eps) * jax.nn.log_sigmoid(h) - eps * jax.nn.log_sigmoid(-h)).mean()


def two_steps(config, devices=None):
  """The metrics of two steps on one batch of pairs, and the state before the second."""
  run = settings.resolve(config, devices)
  setup = build(run)
  state = setup.init_state()
  step = compile_train_step(setup, B, L, run.loss.z_loss, microbatches=run.microbatches)
  batch = jax.device_put({k: jnp.asarray(v) for k, v in pair_batch(run).items()},
                         sharding.batch_sharding(setup.mesh))
  first_state, first = step(state, batch)
  middle = jax.tree.map(np.asarray, first_state)  # the step donates its state
  _, second = step(first_state, batch)
  return setup, middle, batch, jax.device_get(first), jax.device_get(second)


def test_a_pair_takes_a_row_chosen_then_rejected_each_from_position_zero():
  run = settings.resolve(dpo_config(), jax.devices()[:1])
  row = {k: v[0] for k, v in pair_batch(run).items()}
  first = pairs(1, longest=L // 2 - 2)[0]
  chosen_n = len(first['prompt'].encode()) + len(first['chosen'].encode()) + 1  # BOS … EOS: pairs
  seg = row['segment_ids']
  assert (seg[:chosen_n] == 1).all() and (seg[chosen_n:2 * chosen_n] == 2).all()
  assert not seg[2 * chosen_n:].any() and not row['weights'][2 * chosen_n:].any()  # padding
  for s in (1, 2):
    assert (row['positions'][seg == s] == np.arange(chosen_n)).all()
  # The answers weigh 1 (and their EOS), the prompt 0; the same prompt on both sides.
  prompt = len(first['prompt'].encode())
  assert row['weights'][:prompt].sum() == 0 and row['weights'][prompt:chosen_n].all()
  np.testing.assert_array_equal(row['inputs'][:prompt + 1], row['inputs'][chosen_n:][:prompt + 1])
  decoded = run.tokenizer.decode(row['targets'][seg == 2][:-1].tolist())
  assert decoded == first['prompt'] + first['rejected']
  # A pair longer than the row loses the ends of its sequences; both answers keep a share.
  half = prompt + 5  # each side predicts the prompt (weight 0), then five answer tokens
  assert chosen_n > half
  cut = Lane(lambda g: None if g else chat.Encoder(run.tokenizer, 'preference')(
      [records.stored(first, records.Fields.of(run.data)).encode()])[0], 0, 1, 2 * half, 0,
      pairs=True)
  short = cut.next_row()
  for s in (1, 2):
    assert (short['segment_ids'] == s).sum() == half
    assert short['weights'][short['segment_ids'] == s].sum() == 5
  assert not cut.next_row()['weights'].any()  # then the pass ends


def test_a_chat_pair_is_its_prompts_conversation_with_each_answer_as_the_template_renders_it():
  """record='chat_preference' (TRL's conversational pairs): each sequence is the prompt's turns with
  one answer's, rendered by the run's chat template as a `messages` record is; the answer's
  assistant turns weigh 1, the prompt's (an earlier assistant turn too) 0."""
  config = dpo_config()
  config.data.record = 'chat_preference'
  run = settings.resolve(config, jax.devices()[:1])
  template = run.template  # owned for chat pairs, as for conversations
  assert template is not None and template.origin
  fields = records.Fields.of(run.data)
  prompt = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
            {'role': 'assistant', 'content': 'Hello.'}, {'role': 'user', 'content': 'Sum 2+2?'}]
  pair = {'prompt': prompt, 'chosen': '4.', 'rejected': [{'role': 'assistant', 'content': '5.'}]}
  stored = records.stored(pair, fields)
  template(stored)  # it renders both conversations
  doc = chat.Encoder(run.tokenizer, 'chat_preference', template)([stored.encode()])[0]
  ids, weights = doc
  rejected = (weights & 2) > 0
  for answer, side in (('4.', ~rejected), ('5.', rejected)):
    conversation = prompt + [{'role': 'assistant', 'content': answer}]
    messages = chat.Encoder(run.tokenizer, 'messages', template)(
        [json.dumps({'messages': conversation}).encode()])[0]
    np.testing.assert_array_equal(ids[side], messages[0])  # the same tokens as a conversation
    trained = ids[side][(weights[side] & 1) > 0]
    # only the last turn: the earlier assistant turn 'Hello.' is the prompt's
    assert answer in run.tokenizer.decode(trained.tolist())
    assert 'Hello.' not in run.tokenizer.decode(trained.tolist())
    assert (weights[side] & 1).sum() < (messages[1] > 0).sum()
  for bad, why in (({'prompt': 'Q', 'chosen': 'a', 'rejected': 'b'}, "'prompt' is not a non-empty"),
                   ({**pair, 'prompt': prompt[:3]}, 'ends with an assistant message'),
                   ({**pair, 'chosen': [{'role': 'user', 'content': 'a'}]},
                    "chosen\\[0\\] has role 'user'"),
                   ({**pair, 'rejected': '4.'}, 'the same answer'),
                   ({**pair, 'chosen': ' '}, 'every assistant message is blank')):
    with pytest.raises(records.BadRecord, match=why):
      records.stored(bad, fields)


@pytest.mark.integration
@pytest.mark.parametrize('mesh', [dict(fsdp=4, tensor=2), dict(stage=2, fsdp=4),
                                  dict(data=2, fsdp=4)],
                         ids=['fsdp-tensor', 'stages-fsdp', 'replicas-apart'])
def test_dpo_starts_at_ln2_and_is_the_formula_in_value_and_gradient(mesh):
  """Over FSDP and tensor parallelism; over pipeline stages, where each stage scores its share of
  the pairs (the reference's too: training/dpo.py reference_logps); and over data replicas that
  run apart (sharding/hierarchical.py apart), each with the reference's compute copy."""
  config = dpo_config(**mesh)
  if mesh.get('data', 1) > 1:
    config.microbatches = 1  # 8 pairs over 8 devices
  setup, middle, batch, first, second = two_steps(config)
  assert isinstance(middle, PreferenceState)
  assert (setup.hierarchy is not None) == (mesh.get('data', 1) > 1)  # the replicas run apart
  assert first['loss'] == pytest.approx(math.log(2), rel=1e-6)  # the policy is its reference
  assert first['reward_accuracy'] == 0 and first['reward_margin'] == 0
  beta, eps = config.dpo.beta, config.dpo.label_smoothing
  # After a step the policy has moved: the second step's loss and gradient are the formula's,
  # computed from the full logits on one device.
  loss, grads = jax.value_and_grad(direct_loss, argnums=1)(
      setup.graphdef, middle.params, middle.reference, jax.device_get(batch), beta, eps)
  assert second['loss'] == pytest.approx(float(loss), rel=1e-5)
  assert second['grad_norm'] == pytest.approx(float(optax.tree.norm(grads)), rel=1e-4)
  assert 0 < second['reward_accuracy'] <= 1 and second['reward_margin'] > 0
  assert second['chosen_reward'] - second['rejected_reward'] == pytest.approx(
      second['reward_margin'], rel=1e-5)
  # The reference stays what the run started from.
  np.testing.assert_array_equal(np.asarray(middle.reference['embed'][...]),
                                np.asarray(setup.init_state().params['embed'][...]))


@pytest.mark.integration
def test_under_lora_the_reference_is_the_base_without_adapters_and_no_copy_is_held():
  config = dpo_config(lora=True)  # on one device: the formula unsharded too
  setup, middle, batch, first, second = two_steps(config, jax.devices()[:1])
  assert type(middle) is TrainState  # the frozen base stands for the reference
  assert first['loss'] == pytest.approx(math.log(2), rel=1e-6)
  adapters, frozen = trained(setup.model_cfg, middle.params)
  reference = nnx.merge_state(jax.tree.map(jnp.zeros_like, adapters), frozen)
  loss = direct_loss(setup.graphdef, middle.params, reference, jax.device_get(batch),
                     config.dpo.beta, config.dpo.label_smoothing)
  assert second['loss'] == pytest.approx(float(loss), rel=1e-5) and second['loss'] < first['loss']


def test_preference_settings_and_records_are_checked_before_anything_is_built(tmp_path):
  for changes, match in (({'model.draft_heads': 2}, 'draft_heads=0'),
                         ({'data.train_on': 'all'}, "train_on='all'"),
                         ({'dpo.beta': 0.0}, 'config.dpo.beta'),
                         ({'dpo.label_smoothing': 0.5}, 'config.dpo.label_smoothing')):
    c = dpo_config()
    c.update_from_flattened_dict(changes)
    with pytest.raises(ValueError, match=match):
      build(settings.resolve(c))
  fields = records.Fields.of(settings.resolve(dpo_config(), jax.devices()[:1]).data)
  for bad, why in (({'prompt': 'Q', 'chosen': 'a'}, "no field 'rejected'"),
                   ({'prompt': 'Q', 'chosen': 'a', 'rejected': ' '}, "'rejected' is blank"),
                   ({'prompt': 'Q', 'chosen': 'a', 'rejected': 'a'}, 'the same answer')):
    with pytest.raises(records.BadRecord, match=why):
      records.stored(bad, fields)


def test_pairs_packing_leaves_nothing_to_learn_from_are_counted_passed_over_or_refused(tmp_path):
  """Judged after the cut a row of seq_len makes: a pair whose prompt fills its share of the row
  keeps no answer token, and one whose answers differ only past the cut keeps the same two
  sides; both are counted in one warning before anything is compiled, never reach a row, and a
  corpus of nothing else is refused in one line."""
  good = pairs(6, longest=L // 2 - 2)
  long_prompt = {**good[0], 'prompt': 'P' * 2 * L}  # past both halves of the row
  late = {'prompt': 'Q: ', 'chosen': 'x' * L + 'yes', 'rejected': 'x' * L + 'no'}
  data = tmp_path / 'pairs.jsonl'
  data.write_text(''.join(json.dumps(r) + '\n' for r in [long_prompt, *good, late]))
  c = dpo_config()
  c.data.paths, c.data.data_dir, c.workdir = str(data), str(tmp_path / 'tfds'), str(tmp_path / 'w')
  run = settings.resolve(c, jax.devices()[:1])
  with pytest.warns(UserWarning, match=r'skipping 2 of 8 preference pairs that keep nothing to '
                    r'learn from in a row of config.seq_len=160 .*first: .*pairs.jsonl:1: no '
                    r'token of its chosen answer'):
    corpus.check_pairs(run.data, run.tokenizer, run.seq_len)
  encode = chat.Encoder(run.tokenizer, 'preference')
  fields = records.Fields.of(run.data)
  docs = encode([records.stored(r, fields).encode() for r in [long_prompt, *good, late]])
  assert 'the same' in packing.pair_problem(docs[-1], L)
  lane = Lane(lambda g: docs[g] if g < len(docs) else None, 0, 1, L, 0, pairs=True)
  rows = [lane.next_row() for _ in range(7)]
  assert all(r['weights'][r['segment_ids'] == s].any() for r in rows[:6] for s in (1, 2))
  assert not rows[6]['weights'].any()  # the six good pairs, then the pass's end
  # Nothing but such pairs: refused before the step compiles, the workdir never made.
  data.write_text(''.join(json.dumps({**r, 'prompt': 'P' * 2 * L}) + '\n' for r in good))
  with pytest.raises(ValueError, match=r'none of its \d+ training pairs keeps anything to learn '
                     r'from in a row of config.seq_len=160 .*raise config.seq_len'):
    loop.run(c, jax.devices()[:1])
  assert not (tmp_path / 'w').exists()


def test_a_validation_pass_over_nothing_reports_its_count_and_no_mean():
  """training/evaluation.py: means, on a pass whose rows kept no pair (or no token to score):
  the count, 0, and no mean that would read as a perfect or a failed model."""
  from reporting.metrics import format_line
  from training.evaluation import means
  none = {'loss': 0.0, 'reward_accuracy': 0.0, 'reward_margin': 0.0, 'pairs': 0.0}
  assert means(none, pairs=True) == {'eval_pairs': 0}
  assert means({'nats': 0.0, 'tokens': 0.0, 'bytes': 0.0}, pairs=False) == {'eval_tokens': 0}
  assert format_line({'step': 3, 'eval_pairs': 0}, 10) == (
      'step  3/10 | eval: no validation pair to score in its rows')
  two = {'loss': 1.2, 'reward_accuracy': 1.0, 'reward_margin': 0.5, 'pairs': 2.0}
  assert means(two, pairs=True) == {'eval_loss': 0.6, 'eval_reward_accuracy': 0.5,
                                    'eval_reward_margin': 0.25, 'eval_pairs': 2}
  assert 'eval:' not in format_line({'step': 3, **means(two, pairs=True)}, 10)


@pytest.mark.integration
def test_the_walkthrough_learns_the_held_out_preference_and_resumes_against_its_reference(
    tmp_path):
  data = tmp_path / 'pairs.jsonl'
  data.write_text(''.join(json.dumps(r) + '\n' for r in pairs(400)))
  c = dpo.get_config()
  c.update_from_flattened_dict({'workdir': str(tmp_path / 'run'), 'data.paths': str(data),
                                'train_steps': 20, 'eval_every': 20, 'checkpoint_every': 10,
                                'log_every': 5, 'data.validation_fraction': 0.1})
  loop.run(c)
  lines = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  losses = {r['step']: r['loss'] for r in lines if 'loss' in r}
  [evaluated] = [r for r in lines if 'eval_reward_accuracy' in r]
  assert losses[5] < math.log(2) and losses[20] < 0.3 * math.log(2)
  assert evaluated['eval_reward_accuracy'] >= 0.9 and evaluated['eval_pairs'] >= 20
  # Resumed from step 10, it measures against the same reference: the same losses after.
  shutil.rmtree(tmp_path / 'run' / 'checkpoints' / '20')
  loop.run(c)
  again = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  for r in again:
    if 'loss' in r and r['step'] > 10:
      assert r['loss'] == pytest.approx(losses[r['step']], rel=1e-4), r['step']
