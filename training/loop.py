"""The training loop: config resolved into a Run (training/settings.py, its layout chosen), then
two phases. `check`, writing nothing: setup → data and checkpoints checked (a resumed run keeps
what it trained with) → the steps compiled and their plan checked. `open_and_train`: data
prepared → workdir created and held → checkpoints checked again → state restored or initialised
→ steps, each handed to the hooks of training/hooks.py (logs, evals, saves, …). A dry run, which
trains nothing, is training/dry_run.py's."""

import dataclasses
import json
import pathlib
import time

import jax
from jax.experimental import multihost_utils

from data import chat, pipeline, tokenizers
from data import corpus as corpus_lib
from data import tokens
from planning import plan as plan_lib
from reporting import metrics as metrics_lib
from reporting.profiling import StepTrace
from runtime import checkpoint as checkpoint_lib
from runtime import distributed
from runtime import workdir as workdir_lib
from runtime.preemption import StopSignals
import sharding
from training import hooks, settings, tiers
from training.evaluation import Evaluator
from training.programs import compile_and_plan
from configs.base import Run
from training.state import Setup, build, check_checkpoints, initial_state, param_count


def load_data(run: Run) -> tuple[corpus_lib.Corpus, tokens.Documents]:
  """The corpus, and its documents as token ids (data/tokens.py; records rendered with the run's
  chat template). Process 0 prepares both (first use only) while the others wait, so processes
  sharing a data dir never write it twice; then every process opens them."""
  def load():
    corpus = corpus_lib.load(run.data, run.template)
    return corpus, tokens.load(corpus, run.tokenizer, run.data, template=run.template)

  if jax.process_count() > 1:
    if jax.process_index() == 0:
      load()
    multihost_utils.sync_global_devices('meshlm: corpus prepared')
  corpus, documents = load()
  corpus_lib.warn_about_length(corpus, run.seq_len, run.model.max_position_embeddings)
  return corpus, documents


def run(config, devices=None, tasks=None) -> list[dict]:
  """Train per `config` (on `devices`, default this process's); returns the logged records
  (also in workdir/metrics.jsonl). `tasks`: the hook that scores config.lm_eval.tasks, which
  stands above training (evaluation.during.TaskScores; train.py passes it)."""
  if config.dry_run:
    raise ValueError('config.dry_run=True plans without training: run train.py with it, or call '
                     'training.dry_run.plan(config)')
  return train(settings.resolve(config, devices), tasks)  # every setting checked, nothing built


@dataclasses.dataclass
class Checked:
  """What `check` found of a run, having written nothing: the steps compiled and their plan
  fitting, and what the run reads beyond its settings."""
  run: Run
  setup: Setup
  train_step: object  # compiled (training/programs.py)
  eval_step: object | None  # compiled, where the run evaluates
  tasks: object | None  # lm-eval's hook, where the run scores tasks
  read: dict | None  # runtime/checkpoint.py: TRAINED_ON, saved with each checkpoint
  console: metrics_lib.Console
  is_main: bool  # process 0: holds the workdir and writes the console


@dataclasses.dataclass
class Opened:
  """A checked run with what it writes opened: its data prepared, its workdir held, its
  checkpoints, and the signals that stop it."""
  checked: Checked
  documents: tokens.Documents
  workdir: pathlib.Path
  checkpointer: checkpoint_lib.Checkpointer | None
  stop: StopSignals


def train(run: Run, tasks=None) -> list[dict]:
  """Train `run` (settings.resolve's); returns the logged records. `tasks`: as `run`'s. Two
  phases: every check, in the order that fails earliest and writing nothing (`check`); then what
  the run writes, opened (`open_and_train`)."""
  return open_and_train(check(run, tasks))


def check(run: Run, tasks=None) -> Checked:
  """Every check a run's start makes before it writes anything, cheapest first: the settings a
  training run needs, the tasks, the model against the devices, the tiers' disks, the workers,
  the workdir free, the data's files and pairs, the checkpoints it resumes or starts from, and
  the steps compiled, their plan fitting the devices."""
  settings.check_start(run)
  if run.lm_eval.task_names and tasks is None:
    raise ValueError('config.lm_eval.tasks needs the hook that scores them, which train.py adds: '
                     'from a notebook, training.loop.run(config, '
                     'tasks=evaluation.during.TaskScores)')
  tasks = tasks if run.lm_eval.task_names else None  # the hook, where there are tasks to score
  if tasks:
    tasks.check(run)
  setup = build(run)  # every model and mesh error surfaces here, before any work
  if run.optimizer.tiered:  # the room on the optimizer state's disks
    tiers.check_room(setup)
  pipeline.check_workers(run.data.workers, len(pipeline.process_rows(  # this process's rows
      sharding.batch_sharding(setup.mesh), run.batch_size, run.seq_len)))
  # A resumed run keeps what it must, a new one starts from what it names (metadata and headers
  # only): checked before its data is prepared, and again once the workdir is held; never while
  # a live run holds it (and may be writing a checkpoint).
  is_main = jax.process_index() == 0
  workdir_lib.check_free(run.workdir, enabled=is_main)
  # The data's files, every record rendered with the run's chat template; nothing prepared yet.
  corpus_holds = corpus_lib.check_source(run.data, run.template)
  corpus_lib.check_pairs(run.data, run.tokenizer, run.seq_len, run.template)  # what packing keeps
  checkpoints = pathlib.Path(run.workdir).expanduser() / 'checkpoints'
  reader = (checkpoint_lib.Checkpointer(checkpoints, read_only=True) if checkpoints.is_dir()
            else None)
  # What the run reads beyond its settings (runtime/checkpoint.py: TRAINED_ON): saved with each
  # checkpoint, held against a resumed one's.
  read = ({'tokenizer': run.tokenizer.fingerprint,
           'chat_template': run.template.digest if run.template else '',
           'corpus': corpus_holds} if reader or run.checkpoint_every else None)
  try:
    check_checkpoints(reader, setup, read)
  finally:
    if reader:
      reader.close()
  # Compiled before the data is prepared or the workdir made: a step that does not fit its devices
  # is refused before the run writes anything.
  console = metrics_lib.Console(run.train_steps, enabled=is_main)
  console.log(f'meshlm: {param_count(setup.abstract_state.params) / 1e6:.2f}M parameters on '
              f'{setup.mesh.size} {jax.devices()[0].platform} devices, mesh '
              f'{sharding.describe(setup.mesh.shape)}; workdir {checkpoints.parent}')
  t0 = time.perf_counter()
  train_step, the_plan = compile_and_plan(setup)
  plan_lib.check_fits(the_plan)  # before the data is prepared and the state allocated
  eval_step = Evaluator.compile(setup) if run.eval_every else None
  console.log(f'compiled in {time.perf_counter() - t0:.1f}s')
  return Checked(run, setup, train_step, eval_step, tasks, read, console, is_main)


def open_and_train(checked: Checked) -> list[dict]:
  """The checked run's data prepared (before the workdir is created or held: a failure there, a
  full disk, leaves none), its workdir held, its checkpoints checked again there; then trained."""
  run, console = checked.run, checked.console
  corpus, documents = load_data(run)
  console.log(f'data: {corpus.description}, {run.tokenizer.name} tokenizer '
              f'({run.tokenizer.vocab_size} tokens, model vocab {run.model.vocab_size}), '
              f'{documents.description}, {run.data.workers} worker(s)')
  workdir = workdir_lib.prepare(run.workdir)
  with workdir_lib.hold(workdir, enabled=checked.is_main):  # one run per workdir
    checkpointer = (checkpoint_lib.Checkpointer(workdir / 'checkpoints',
                                                keep=run.keep_checkpoints)
                    if run.checkpoint_every else None)
    try:
      check_checkpoints(checkpointer, checked.setup, checked.read)
      with StopSignals() as stop, distributed.explain_failures(run.distributed):
        return _train(Opened(checked, documents, workdir, checkpointer, stop))
    finally:
      if checkpointer:
        checkpointer.close()  # waits for the save in flight


def train_batches(run: Run, train_documents, batch_sharding, state=None) -> pipeline.Batches:
  """The run's training batches of the training split's documents (data/pipeline.py), from the
  data-loader `state` a checkpoint saved, if any."""
  return pipeline.train_batches(train_documents, run.data, batch_sharding, seed=run.seed,
                                batch_size=run.batch_size, seq_len=run.seq_len,
                                pad_id=run.tokenizer.pad_id, state=state)


def _train(opened: Opened) -> list[dict]:
  """The opened run's steps, from where its state starts, each handed to the hooks."""
  checked = opened.checked
  run, setup, console, log = checked.run, checked.setup, checked.console, checked.console.log
  train_step, eval_step, tasks, read = (checked.train_step, checked.eval_step, checked.tasks,
                                        checked.read)
  documents, workdir, checkpointer, stop = (opened.documents, opened.workdir,
                                            opened.checkpointer, opened.stop)
  is_main = checked.is_main
  if is_main:  # the run's own tokenizer, chat template and settings, read from here on (resumed,
    tokenizers.keep(run.tokenizer, workdir)  # sampled, exported)
    if run.template:
      chat.keep_template(run.template.source, workdir)
    workdir_lib.write_whole(workdir / 'config.json', json.dumps(run.as_dict(), indent=2))
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main)
  t0 = time.perf_counter()
  engine = tiers.Engine(setup, train_step) if run.optimizer.tiered else None
  start_step, state, data_state = initial_state(setup, checkpointer, log,
                                                engine.restoring() if engine else None)
  if engine:  # the optimizer state leaves the devices for its tiers; the engine updates it
    state, train_step = engine.load(state), engine
  # Finished is known only once restored: a damaged newest checkpoint was set aside just now.
  # What a stop skipped at the step resumed from comes first, a finished run's last step too.
  finished = start_step >= run.train_steps
  skipped = hooks.still_due(data_state, writer, start_step)
  if finished and not skipped:
    log(finished_message(workdir, start_step, run.train_steps))
    writer.close()
    if engine:
      engine.close()
    return []
  writer.drop_after(start_step)  # the steps after the checkpoint (or all, from 0) are logged again
  batch_sharding = sharding.batch_sharding(setup.mesh)
  evaluate = (Evaluator(setup, eval_step, documents.validation, batch_sharding)
              if eval_step else None)
  report = hooks.Report(writer, console, run.train_steps)
  log_metrics = hooks.LogMetrics(run.log_every, report, setup, start_step,
                                 sharding.local_device(setup.mesh.devices.flat).device_kind)
  scores = tasks(setup, report, log_metrics) if tasks else None
  if evaluate and hooks.EVALUATE_FIRST in skipped:
    report({'step': start_step, **evaluate(state)})
  if scores and hooks.SCORE_FIRST in skipped:
    scores.score(start_step, state.params)
  if finished:
    log(finished_message(workdir, start_step, run.train_steps))
    writer.close()
    if engine:
      engine.close()
    return report.records
  batches = train_batches(run, documents.train, batch_sharding, state=data_state)
  log(f'initialised in {time.perf_counter() - t0:.1f}s')

  guard = hooks.NonFinite(run.max_bad_steps, checkpointer)
  log_metrics.restart_clock()
  save = (hooks.Save(run.checkpoint_every, checkpointer, guard, batches,
                     {**run.as_dict(), 'mesh_shape': dict(setup.mesh.shape), 'trained_on': read},
                     {**({hooks.EVALUATE_FIRST: run.eval_every} if evaluate else {}),
                      **({hooks.SCORE_FIRST: run.lm_eval.every} if scores else {})},
                     **({'saving': engine.saving} if engine else {}))
          if checkpointer else None)
  trace = StepTrace(workdir / 'profile', start_step + run.profile_start, run.profile_steps)
  around_steps = [hooks.Trace(trace), guard, hooks.Progress(console), log_metrics,
                  *([hooks.Evaluate(run.eval_every, evaluate, report, log_metrics)]
                    if evaluate else []),
                  *([save] if save else []), *([scores] if scores else [])]
  try:
    for step_index in range(start_step, run.train_steps):
      for hook in around_steps:
        hook.before(step_index)
      state, metrics = train_step(state, next(batches))
      step = hooks.Step(done=step_index + 1, state=state, metrics=metrics,
                        last=step_index + 1 == run.train_steps,
                        stopping=stop.requested(step_index + 1))
      for hook in around_steps:
        hook.after(step)
      if step.stopping:
        log(stop_message(stop, step.done, save, guard))
        break
    else:
      guard.finish()
  finally:
    for hook in around_steps:
      hook.close(state)
    writer.close()
    batches.close()
    if engine:
      engine.close()
  return report.records


def finished_message(workdir, step: int, train_steps: int) -> str:
  return (f'the run in {workdir} is finished: checkpoint {step} is its last step '
          f'(config.train_steps={train_steps}); raise config.train_steps to train on, '
          'or sample.py / export.py it')


def stop_message(stop, done: int, save, guard) -> str:
  head = f'stopped by {stop.received or "a preemption notice"} after step {done}'
  if save and save.saved:
    return f'{head}; checkpoint {save.saved}'
  why = ('config.checkpoint_every=0' if save is None else
         f'the last {guard.in_a_row} step(s) were not finite; the newest checkpoint is '
         f'{guard.newest_checkpoint()}')
  return f'{head}; nothing saved: {why}'
