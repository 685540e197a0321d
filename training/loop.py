"""The training loop: config → tokenizer → setup → data → compiled steps → steps, logs, evals."""

import time
import warnings

import jax
import numpy as np
from jax.experimental import multihost_utils

import sharding
from data import corpus as corpus_lib
from data import pipeline, tokenizers
from training import metrics as metrics_lib
from training import step as step_lib
from training.checkpoint import Checkpointer
from training.evaluation import Evaluator
from training.state import build, param_count


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


def run(config, devices=None) -> list[dict]:
  """Train per `config`; returns the logged records (also in workdir/metrics.jsonl)."""
  tokenizer = tokenizers.load(config.data)
  config = tokenizers.with_vocab_size(config, tokenizer)
  setup = build(config, devices)  # every model and mesh error surfaces here, before any work
  workdir = metrics_lib.prepare_workdir(config.workdir)
  corpus = load_corpus(config.data)
  warn_about_data(config, corpus)
  is_main = jax.process_index() == 0
  if is_main:
    (workdir / 'config.json').write_text(config.to_json_best_effort(indent=2))
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main)
  log = print if is_main else (lambda *a, **k: None)

  batch_sharding = sharding.batch_sharding(setup.mesh)
  pipeline.check_workers(config.data.workers, len(pipeline.process_rows(
      batch_sharding, config.batch_size, config.seq_len)))
  mesh_desc = ' × '.join(f'{a}={n}' for a, n in setup.mesh.shape.items())
  log(f'meshlm: {param_count(setup.abstract_state.params) / 1e6:.2f}M parameters on '
      f'{setup.mesh.size} {jax.devices()[0].platform} devices, mesh {mesh_desc}; workdir {workdir}')
  log(f'data: {corpus.description}, {tokenizer.name} tokenizer ({tokenizer.vocab_size} tokens, '
      f'model vocab {config.model.vocab_size}), {config.data.workers} worker(s)')
  t0 = time.perf_counter()
  checkpointer = (Checkpointer(workdir, keep=config.keep_checkpoints)
                  if config.checkpoint_every else None)
  restored = checkpointer.restore_latest(setup.abstract_state) if checkpointer else None
  if restored:
    start_step, state, data_state = restored
    writer.drop_after(start_step)
    log(f'resuming from step {start_step} ({checkpointer.directory / str(start_step)})')
  else:
    start_step, state, data_state = 0, setup.init_state(), None
  batches = pipeline.train_batches(corpus, tokenizer, config, batch_sharding, state=data_state)
  train_step = step_lib.compile_train_step(setup, config.batch_size, config.seq_len,
                                           config.loss.z_loss)
  evaluate = (Evaluator(setup, config, corpus, tokenizer, batch_sharding)
              if config.eval_every else None)
  log(f'initialised and compiled in {time.perf_counter() - t0:.1f}s')

  records, tokens_per_step = [], config.batch_size * config.seq_len
  last_time, last_step = time.perf_counter(), start_step
  in_flight = None
  try:
    for step in range(start_step, config.train_steps):
      state, metrics = train_step(state, next(batches))
      # At most two steps in flight: the device stays busy and the host never runs far ahead.
      jax.block_until_ready(in_flight)
      in_flight, done = metrics, step + 1
      if done % config.log_every == 0 or done == config.train_steps:
        metrics = jax.device_get(metrics)  # waits for the step
        now = time.perf_counter()
        step_time = (now - last_time) / (done - last_step)
        record = {'step': done, **{k: float(v) for k, v in metrics.items()},
                  'tokens_per_sec': tokens_per_step / step_time, 'step_time_s': step_time}
        if not np.isfinite(record['loss']):
          raise FloatingPointError(f'loss is {record["loss"]} at step {done}; lower '
                                   'config.optimizer.learning_rate or check the data')
        writer.write(record)
        log(metrics_lib.format_line(record, config.train_steps))
        records.append(record)
        last_time, last_step = time.perf_counter(), done
      if evaluate and (done % config.eval_every == 0 or done == config.train_steps):
        record = {'step': done, **evaluate(state.params)}
        writer.write(record)
        log(metrics_lib.format_line(record, config.train_steps))
        records.append(record)
        last_time = time.perf_counter()  # evaluation time is not step time
      if checkpointer and (done % config.checkpoint_every == 0 or done == config.train_steps):
        checkpointer.save(done, state, batches.state(), config.to_dict())
  finally:
    batches.close()
    if checkpointer:
      checkpointer.close()  # waits for the save in flight
  return records
