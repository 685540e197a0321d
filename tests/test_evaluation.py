"""meshlm under EleutherAI's lm-evaluation-harness (evaluation/harness.py, evaluate.py): its
log-likelihoods and greedy answers equal a direct computation on the model, sharded as on one
device, and lm-eval's Hugging Face backend on the same checkpoint; the shipped tasks run from the
command line, and their accuracy is what the log-likelihoods say."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance

from configs import base
from evaluation import during
from evaluation.harness import MeshLM
from inference import sampling
from interop import huggingface
from model import Transformer
from reporting.metrics import format_line
from tests.conftest import SMALL_CORPUS, tiny_config
from training import loop, settings
from training.state import build

REPO = pathlib.Path(__file__).resolve().parents[1]
SEQ_LEN = 64


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """A run that scored both shipped tasks during training, at steps 2 and 4 (evaluation/during.py),
  on the limit and batch the evaluate.py test below gives."""
  c = tiny_config(fsdp=8)
  c.workdir, c.seq_len = str(tmp_path_factory.mktemp('run')), SEQ_LEN
  c.train_steps, c.checkpoint_every, c.eval_every = 4, 4, 0
  c.lm_eval.tasks, c.lm_eval.every, c.lm_eval.limit, c.lm_eval.batch_size = (
      'stdlib_next_line,stdlib_complete', 2, 6, 4)
  loop.run(c, tasks=during.TaskScores)
  return c.workdir


@pytest.mark.integration
def test_tasks_during_training_are_refused_without_their_hook_or_with_a_bad_name(tmp_path):
  """One line each, before the run builds anything (nothing written)."""
  c = tiny_config()
  c.workdir, c.lm_eval.tasks = str(tmp_path / 'run'), 'stdlib_next_line'
  with pytest.raises(ValueError, match='config.lm_eval.tasks needs the hook that scores them'):
    loop.run(c)
  c.lm_eval.tasks = 'stdlib_next_line,no_such_task'
  with pytest.raises(ValueError, match='config.lm_eval.tasks: no lm-eval task named no_such_task'):
    loop.run(c, tasks=during.TaskScores)
  c.lm_eval.tasks, c.lm_eval.include_path = 'stdlib_next_line', str(tmp_path / 'missing')
  with pytest.raises(ValueError, match='config.lm_eval.include_path: .*missing is not a directory'):
    loop.run(c, tasks=during.TaskScores)
  tasks = tmp_path / 'tasks'  # stdlib_complete asking for more new tokens than a row holds
  tasks.mkdir()
  for name in ('stdlib.py', 'stdlib_complete.jsonl'):
    (tasks / name).write_bytes((REPO / 'evaluation' / 'tasks' / name).read_bytes())
  (tasks / 'too_long.yaml').write_text(
      (REPO / 'evaluation' / 'tasks' / 'stdlib_complete.yaml').read_text()
      .replace('task: stdlib_complete', 'task: too_long').replace('max_gen_toks: 48',
                                                                  'max_gen_toks: 32'))
  c.lm_eval.tasks, c.lm_eval.include_path = 'too_long', str(tasks)
  with pytest.raises(ValueError, match=r'config.lm_eval.tasks: too_long asks for 32 new tokens '
                                       r'\(max_gen_toks\), which leaves no room for its prompt '
                                       r'within config.seq_len=32'):
    loop.run(c, tasks=during.TaskScores)
  assert not (tmp_path / 'run').exists()


def asked(kind, *args):
  return [Instance(kind, {}, a, i, metadata=('t', i, 1)) for i, a in enumerate(args)]


def logprobs(model, ids):
  """log p of each next token of one row, and whether it was the argmax: the whole logits."""
  logits = np.asarray(model(jnp.asarray([ids[:-1]])), np.float64)[0]
  logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
  return logp[np.arange(len(ids) - 1), ids[1:]], logits.argmax(-1) == np.asarray(ids[1:])


def on_one_device(loaded):
  graphdef, state = nnx.split(loaded.model)
  state = jax.device_put(state, jax.devices()[0])
  return sampling.Loaded(nnx.merge(graphdef, state), loaded.tokenizer, loaded.run, loaded.checkpoint)


def test_a_random_models_scores_are_its_own_log_softmax():
  """The inner loop's: rows read after BOS, each continuation's tokens scored by the model's own
  log-softmax, and greedy where each was its argmax (no training, no checkpoint)."""
  run = settings.resolve(tiny_config())
  model = Transformer(run.model, rngs=nnx.Rngs(0))
  tok = run.tokenizer
  pairs = [('def f(x):\n', '    return x'), ('', 'import os')]
  got = MeshLM(loaded=sampling.Loaded(model, tok, run, 'random'), batch_size=2).loglikelihood(
      asked('loglikelihood', *pairs))
  for (context, continuation), (logprob, greedy) in zip(pairs, got):
    logp, argmax = logprobs(model, [tok.bos_id, *tok.encode((context + continuation).encode())])
    n = len((context[len(context.rstrip()):] + continuation).encode())  # its trailing newline too
    assert logprob == pytest.approx(logp[-n:].sum(), rel=1e-5) and greedy == argmax[-n:].all()
  with pytest.raises(ValueError, match='--tasks: a task asked for the log-likelihood of 40 tokens '
                                       'at once, more than the seq_len the model was trained at, 32'):
    MeshLM(loaded=sampling.Loaded(model, tok, run, 'random')).loglikelihood(
        asked('loglikelihood', ('x', 'y' * 40)))


@pytest.mark.integration
def test_loglikelihoods_and_greedy_answers_equal_a_direct_computation(workdir):
  loaded = sampling.load(workdir)
  assert len(jax.tree.leaves(loaded.model)[0].sharding.device_set) == 8  # sharded, as sampled
  tok = loaded.tokenizer
  pairs = [('def f(x):\n', '    return x'), ('import ', 'json'), ('', 'class A:'),
           ('x = 1 ', '+ 2'),  # the context's trailing space goes to the continuation
           ('a' * 100, ' = b')]  # longer than the trained length: its start is cut
  sharded = MeshLM(loaded=loaded, batch_size=2).loglikelihood(asked('loglikelihood', *pairs))
  single = MeshLM(loaded=on_one_device(loaded), batch_size=3).loglikelihood(
      asked('loglikelihood', *pairs))
  for (context, continuation), mine, one in zip(pairs, sharded, single):
    stripped = context.rstrip()
    ids = [tok.bos_id, *tok.encode((context + continuation).encode())][-(SEQ_LEN + 1):]
    n = len((context[len(stripped):] + continuation).encode())
    logp, greedy = logprobs(loaded.model, ids)
    assert mine[0] == pytest.approx(logp[-n:].sum(), rel=1e-5, abs=1e-4), (context, continuation)
    assert mine[1] == greedy[-n:].all() and one[1] == mine[1]
    assert one[0] == pytest.approx(mine[0], rel=1e-5, abs=1e-4)

  # A whole text: short, the document's log-likelihood after BOS; long, lm-eval's windows of the
  # trained length, each scored as a row of its own.
  model = MeshLM(loaded=loaded, batch_size=4)
  short, long = 'for i in range(3):\n    print(i)\n', 'import os\n' * 20
  rolled = model.loglikelihood_rolling(asked('loglikelihood_rolling', (short,), (long,)))
  assert rolled[0] == pytest.approx(
      logprobs(loaded.model, [tok.bos_id, *tok.encode(short.encode())])[0].sum(), rel=1e-5)
  full, total = [tok.bos_id, *map(int, tok.encode(long.encode()))], 0.0
  for start in range(1, len(full), SEQ_LEN):  # windows of new tokens, each read after as many
    end = min(start + SEQ_LEN, len(full))  # tokens before it as the trained length holds
    total += logprobs(loaded.model, full[max(0, end - SEQ_LEN - 1):end])[0][-(end - start):].sum()
  assert rolled[1] == pytest.approx(total, rel=1e-5)

  # Greedy generation until a stop sequence: a direct argmax loop over the whole logits.
  prompts = ['def ', 'import']
  answers = model.generate_until(asked('generate_until', *[(p, {'until': ['\n', ':'],
                                                                'max_gen_toks': 12}) for p in prompts]))
  for prompt, answer in zip(prompts, answers):
    ids = [tok.bos_id, *tok.encode(prompt.encode())]
    for _ in range(12):
      logits = np.asarray(loaded.model(jnp.asarray([ids])))[0, -1, :tok.vocab_size]
      if (token := int(logits.argmax())) == tok.eos_id:
        break
      ids.append(token)
    text = tok.decode(ids[len(prompt) + 1:])
    assert answer == text.split('\n')[0].split(':')[0]


@pytest.mark.integration
def test_answers_equal_lm_evals_hugging_face_backend_on_the_same_checkpoint():
  """meshlm's model of tests/data/hf-llama-untied (imported, as a run started from it holds it;
  export.py writes it back bit exact) against lm-eval's HF backend with torch on the checkpoint
  itself (tests/data/make_lm_eval_goldens.py): every choice's log-likelihood within 1e-4 of it,
  the same greedy flags, answers and metrics."""
  import lm_eval
  from lm_eval.tasks import TaskManager
  golden = json.loads((REPO / 'tests' / 'data' / 'lm-eval-hf' / 'goldens.json').read_text())
  c = base.get_config()
  c.init_from, c.model.compute_dtype = f'hf:{REPO / golden["checkpoint"]}', 'float32'
  c.seq_len, c.mesh.fsdp = golden['max_length'], 8
  c.data.paths, c.data.validation_fraction = SMALL_CORPUS, 0.1
  setup = build(settings.resolve(c))
  params = huggingface.load_params(REPO / golden['checkpoint'], setup.abstract_state.params,
                                   setup.model_cfg)
  model = MeshLM(loaded=sampling.Loaded(nnx.merge(setup.graphdef, params), setup.run.tokenizer,
                                        setup.run, golden['checkpoint']), batch_size=8)
  tasks = TaskManager(include_path=str(REPO / 'evaluation' / 'tasks'))
  for task, expected in golden['tasks'].items():
    result = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=tasks,
                                     limit=expected['limit'], log_samples=True)
    samples = sorted(result['samples'][task], key=lambda s: s['doc_id'])
    assert [s['doc_id'] for s in samples] == [s['doc_id'] for s in expected['samples']]
    for mine, theirs in zip(samples, expected['samples']):
      for (answer,), (wanted,) in zip(mine['resps'], theirs['resps']):
        if task == 'stdlib_complete':
          assert answer == wanted, mine['doc_id']
        else:
          assert answer[0] == pytest.approx(wanted[0], rel=1e-4) and answer[1] == wanted[1]
    for metric, value in expected['metrics'].items():
      assert result['results'][task][f'{metric},none'] == value, (task, metric)


@pytest.mark.integration
def test_evaluate_runs_the_shipped_tasks_and_says_what_it_measured(workdir, tmp_path):
  """Both shipped tasks through lm-eval; the multiple-choice accuracy is what the model's
  log-likelihoods of the four choices say; the hook scored the same in memory during training."""
  output = tmp_path / 'results.json'
  command = [sys.executable, 'evaluate.py', f'--workdir={workdir}',
             '--tasks=stdlib_next_line,stdlib_complete', '--limit=6', '--batch_size=4']
  result = subprocess.run([*command, f'--output={output}'], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  figures = json.loads(result.stdout.strip().splitlines()[-1])
  assert figures['checkpoint'] == f'{workdir}/checkpoints/4'
  assert set(figures['results']['stdlib_complete']) >= {'exact_match'}
  whole = json.loads(output.read_text())
  assert whole['results']['stdlib_next_line']['acc,none'] == figures['results']['stdlib_next_line']['acc']

  model = MeshLM(workdir=workdir)
  with open(REPO / 'evaluation' / 'tasks' / 'stdlib_next_line.jsonl') as f:
    docs = [json.loads(line) for line in f][:6]
  right = 0
  for doc in docs:
    scores = model.loglikelihood(asked('loglikelihood', *[(doc['context'], c) for c in doc['choices']]))
    right += int(np.argmax([s for s, _ in scores])) == doc['label']
  assert figures['results']['stdlib_next_line']['acc'] == pytest.approx(right / 6)

  # Its refusals (an --output that exists, a task it does not know) are scripts/fault_probe.py's
  # cases "evaluate: …": one line, exit 2, the file left as it was.

  # The hook scored the same step in memory, as the run trained: the same answers.
  records = [json.loads(line) for line in open(pathlib.Path(workdir) / 'metrics.jsonl')]
  scored = {r['step']: r for r in records if 'stdlib_next_line/acc' in r}
  assert sorted(scored) == [2, 4] and scored[4]['lm_eval_time_s'] > 0
  for task, figures_of_task in figures['results'].items():
    for metric, value in figures_of_task.items():
      assert scored[4][f'{task}/{metric}'] == pytest.approx(value), (task, metric)
  line = format_line(scored[4], 4)  # the console's
  assert f"stdlib_next_line/acc {figures['results']['stdlib_next_line']['acc']:.4g}" in line
  assert 'scored in ' in line


@pytest.mark.integration
def test_lm_evals_own_command_line_runs_meshlm(workdir):
  """`python -m evaluation.harness` is lm-eval's command line with meshlm registered."""
  result = subprocess.run([sys.executable, '-m', 'evaluation.harness', 'run', '--model', 'meshlm',
                           '--model_args', f'workdir={workdir}', '--batch_size', '4', '--tasks',
                           'stdlib_next_line', '--include_path', 'evaluation/tasks', '--limit', '3'],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert '|stdlib_next_line|' in result.stdout and '|acc ' in result.stdout
