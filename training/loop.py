"""The training loop: config → tokenizer → [layout] → setup → checkpoints checked → data → the
step compiled and its plan checked → state restored or initialised → steps, logs, evals, saves."""

import functools
import time
import warnings

import jax
import numpy as np
from jax.experimental import multihost_utils

import sharding
from data import corpus as corpus_lib
from data import pipeline, tokenizers
from training import metrics as metrics_lib
from training import layout
from training import plan as plan_lib
from training import checkpoint as checkpoint_lib
from training import distributed, flops
from training import workdir as workdir_lib
from training.evaluation import Evaluator
from training.preemption import StopSignals
from training.profiling import StepTrace
from training.state import build, local_device, param_count


def load_corpus(data_config) -> corpus_lib.Corpus:
  """Process 0 prepares the corpus (first use only) while the others wait, so processes sharing
  a data dir never write it twice; then every process opens it."""
  if jax.process_count() > 1:
    if jax.process_index() == 0:
      corpus_lib.load(data_config)
    multihost_utils.sync_global_devices('meshlm: corpus prepared')
  return corpus_lib.load(data_config)


def warn_about_data(config, corpus: corpus_lib.Corpus) -> None:
  longest = corpus.max_document_bytes
  if longest is not None and config.seq_len > longest + 1:
    warnings.warn(f'config.seq_len={config.seq_len} is longer than every document (the longest '
                  f'has {longest:,} bytes): each row packs several documents',
                  corpus_lib.DataWarning, stacklevel=2)


def check_checkpoints(checkpointer, setup, config, tokenizer) -> None:
  """Before data or memory are touched: the workdir's checkpoints (else `config.init_from`'s)
  hold this config's model, and a resumed run keeps what it must (checkpoint.KEPT_ON_RESUME);
  another vocabulary is named as a tokenizer mistake."""
  try:
    steps = checkpointer.steps() if checkpointer else []
    for step in steps:  # the newest whose metadata reads; older ones are fallbacks
      if checkpointer.check(setup.abstract_state, step, setting='config.workdir',
                            model_config=config.model):
        checkpoint_lib.check_resume(checkpointer.saved_config(step), config,
                                    checkpointer.directory / str(step))
        return
    if config.init_from and not steps:
      checkpoint_lib.check_init_from(config.init_from, setup.abstract_state.params, config.model)
  except checkpoint_lib.CheckpointMismatch as e:
    if 'vocab_size' in e.saved_model:
      tokenizers.check_checkpoint_vocab(e.saved_model['vocab_size'], tokenizer,
                                        config.model.vocab_size)
    raise


def initial_state(setup, config, checkpointer, log):
  """(step, state, data state): resumed from the workdir's newest checkpoint that restores, else
  a new run from `config.init_from`'s parameters or from scratch."""
  restored = (checkpointer.restore_latest(setup.abstract_state, config.model)
              if checkpointer else None)
  if restored:
    log(f'resuming from step {restored[0]} ({checkpointer.directory / str(restored[0])})')
    return restored
  if config.init_from:
    params, path = checkpoint_lib.restore_params(config.init_from, setup.abstract_state.params,
                                                 config.model)
    log(f'starting from the parameters of {path} (fresh optimizer, step 0)')
    return 0, setup.init_state(params), None
  return 0, setup.init_state(), None


class BadStepGuard:
  """Counts steps in a row whose loss or gradient was not finite (the step skipped them);
  `config.max_bad_steps` in a row stop the run."""

  def __init__(self, max_bad_steps: int, checkpointer):
    self.limit, self.in_a_row, self.checkpointer = max_bad_steps, 0, checkpointer
    self.checked = -1

  def newest_checkpoint(self) -> int | None:
    """The newest saved step (never one from a bad streak: those are not saved)."""
    saved = self.checkpointer.steps() if self.checkpointer else []
    return saved[0] if saved else None

  def check(self, step: int, metrics) -> None:
    if step <= self.checked:
      return
    self.checked = step
    if not bool(jax.device_get(metrics['skipped'])):  # waits for that step
      self.in_a_row = 0
      return
    self.in_a_row += 1
    warnings.warn(f'step {step}: the loss or gradient is not finite; the step was skipped',
                  RuntimeWarning, stacklevel=2)
    if self.in_a_row >= self.limit:
      kept = (f'the last good checkpoint, step {self.newest_checkpoint()}, is in '
              f'{self.checkpointer.directory}' if self.newest_checkpoint() is not None
              else 'no checkpoint was saved')
      raise FloatingPointError(
          f'steps {step - self.in_a_row + 1}..{step}: {self.in_a_row} steps in a row had a '
          f'non-finite loss or gradient (config.max_bad_steps={self.limit}); {kept}. Lower '
          'config.optimizer.learning_rate, raise config.optimizer.warmup_steps or check the data')


def run(config, devices=None) -> list[dict]:
  """Train per `config`; returns the logged records (also in workdir/metrics.jsonl)."""
  distributed.initialize(config.distributed)  # before anything touches a device
  tokenizer = tokenizers.load(config.data)
  config = tokenizers.with_vocab_size(config, tokenizer)
  devices = jax.devices() if devices is None else list(devices)
  plan_lib.check_target(config, devices)
  if planned_elsewhere := plan_lib.plan_in_compiler_process(config, devices):
    return [planned_elsewhere]
  if config.dry_run or config.mesh.auto:  # compile for the GPUs planned for, if not these
    planned = plan_lib.target_devices(config, devices)
    if config.mesh.auto:
      config, _ = layout.choose(config, planned,
                                log=print if jax.process_index() == 0 else lambda *a: None)
    if config.dry_run:
      _, the_plan = plan_lib.compile_and_plan(build(config, planned), config)
      plan_lib.report(the_plan)
      return [the_plan.as_dict()]
  setup = build(config, devices)  # every model and mesh error surfaces here, before any work
  corpus_lib.check(config.data)  # and the data's, before the workdir is created
  workdir = workdir_lib.prepare(config.workdir)
  with workdir_lib.hold(workdir, enabled=jax.process_index() == 0):  # one run per workdir
    checkpointer = (checkpoint_lib.Checkpointer(workdir / 'checkpoints',
                                                keep=config.keep_checkpoints)
                    if config.checkpoint_every else None)
    try:
      check_checkpoints(checkpointer, setup, config, tokenizer)
      with StopSignals() as stop, distributed.explain_failures(config.distributed):
        return _train(config, setup, workdir, tokenizer, checkpointer, stop)
    finally:
      if checkpointer:
        checkpointer.close()  # waits for the save in flight


def _train(config, setup, workdir, tokenizer, checkpointer, stop) -> list[dict]:
  corpus = load_corpus(config.data)
  warn_about_data(config, corpus)
  is_main = jax.process_index() == 0
  if is_main:
    (workdir / 'config.json').write_text(config.to_json_best_effort(indent=2))
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main)
  console = metrics_lib.Console(config.train_steps, enabled=is_main)
  log = console.log

  batch_sharding = sharding.batch_sharding(setup.mesh)
  pipeline.check_workers(config.data.workers, len(pipeline.process_rows(
      batch_sharding, config.batch_size, config.seq_len)))
  log(f'meshlm: {param_count(setup.abstract_state.params) / 1e6:.2f}M parameters on '
      f'{setup.mesh.size} {jax.devices()[0].platform} devices, mesh {sharding.describe(setup.mesh.shape)}; workdir {workdir}')
  log(f'data: {corpus.description}, {tokenizer.name} tokenizer ({tokenizer.vocab_size} tokens, '
      f'model vocab {config.model.vocab_size}), {config.data.workers} worker(s)')
  t0 = time.perf_counter()
  train_step, the_plan = plan_lib.compile_and_plan(setup, config)
  plan_lib.check_fits(the_plan)  # before the state is allocated
  start_step, state, data_state = initial_state(setup, config, checkpointer, log)
  writer.drop_after(start_step)  # the steps after the checkpoint (or all, from 0) are logged again
  batches = pipeline.train_batches(corpus, tokenizer, config, batch_sharding, state=data_state)
  evaluate = (Evaluator(setup, config, corpus, tokenizer, batch_sharding)
              if config.eval_every else None)
  log(f'initialised and compiled in {time.perf_counter() - t0:.1f}s')

  records, tokens_per_step = [], config.batch_size * config.seq_len
  last_time, last_step = time.perf_counter(), start_step
  guard = BadStepGuard(config.max_bad_steps, checkpointer)
  trace = StepTrace(workdir / 'profile', start_step + config.profile_start, config.profile_steps)
  device_kind = local_device(setup.mesh.devices.flat).device_kind
  speed = functools.partial(flops.throughput, setup.model_cfg, config.seq_len,
                            n_devices=setup.mesh.size, device_kind=device_kind)
  previous = None  # (step, metrics) of the step dispatched before this one
  save_pending = False  # a checkpoint was due while the last steps were not finite
  try:
    for step in range(start_step, config.train_steps):
      trace.before_step(step)
      state, metrics = train_step(state, next(batches))
      done = step + 1
      trace.after_step(done, metrics)
      # At most two steps in flight: the device stays busy and the host never runs far ahead.
      if previous:
        guard.check(*previous)
      previous = (done, metrics)
      console.step(done)
      if done % config.log_every == 0 or done == config.train_steps:
        metrics = jax.device_get(metrics)  # waits for the step
        step_time = (time.perf_counter() - last_time) / (done - last_step)
        record = {'step': done, **{k: float(v) for k, v in metrics.items() if k != 'skipped'},
                  'tokens_per_sec': tokens_per_step / step_time, 'step_time_s': step_time,
                  **speed(tokens_per_step / step_time)}
        if (peak := metrics_lib.peak_memory_bytes(setup.mesh.devices.flat)) is not None:
          record['peak_memory_gib'] = peak / 2**30
        writer.write(record)
        log(metrics_lib.format_line(record, config.train_steps))
        records.append(record)
        last_time, last_step = time.perf_counter(), done
      stopping = stop.requested(done)
      if evaluate and not stopping and (done % config.eval_every == 0
                                        or done == config.train_steps):
        record = {'step': done, **evaluate(state.params)}
        writer.write(record)
        log(metrics_lib.format_line(record, config.train_steps))
        records.append(record)
        last_time = time.perf_counter()  # evaluation time is not step time
      saved = None
      if checkpointer and (save_pending or stopping or done % config.checkpoint_every == 0
                           or done == config.train_steps):
        guard.check(*previous)  # waits for this step: never save after the run should stop
        # A state that follows a skipped step is not saved until a finite step has been applied
        # (the newest checkpoint from before the streak stays the newest, so rotation keeps it).
        save_pending = guard.in_a_row > 0
        if not save_pending:
          checkpointer.save(done, state, batches.state(), config.to_dict())
          saved = checkpointer.directory / str(done)
      if stopping:
        log(f'stopped by {stop.received or "a preemption notice"} after step {done}; '
            + (f'checkpoint {saved}' if saved else 'nothing saved: '
               + ('config.checkpoint_every=0' if not checkpointer else
                  f'the last {guard.in_a_row} step(s) were not finite; the newest checkpoint is '
                  f'{guard.newest_checkpoint()}')))
        break
    else:
      if previous:
        guard.check(*previous)
  finally:
    trace.stop(state)
    console.close()
    writer.close()
    batches.close()
  return records
