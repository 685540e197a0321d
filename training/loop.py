"""The training loop: config → setup → data → compiled step → steps, logs, evals."""

import time

import jax
import numpy as np

import sharding
from data import stdlib_bytes
from training import metrics as metrics_lib
from training import step as step_lib
from training.state import build, param_count


def run(config, devices=None) -> list[dict]:
  """Train per `config`; returns the logged records (also in workdir/metrics.jsonl)."""
  setup = build(config, devices)  # every config error surfaces here, before any work
  if config.eval_every < 0 or config.eval_batches < 1:
    raise ValueError('config.eval_every must be >= 0 and config.eval_batches >= 1')
  if config.data.corpus != 'stdlib':
    raise ValueError(f"config.data.corpus={config.data.corpus!r}: only 'stdlib' exists until the "
                     'data pipeline lands')
  workdir = metrics_lib.prepare_workdir(config.workdir)
  is_main = jax.process_index() == 0
  if is_main:
    (workdir / 'config.json').write_text(config.to_json_best_effort(indent=2))
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main)
  log = print if is_main else (lambda *a, **k: None)

  train_files, eval_files = stdlib_bytes.split_files(stdlib_bytes.stdlib_files(),
                                                     config.data.eval_every_nth_file)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  batches = stdlib_bytes.Batches(stdlib_bytes.ByteCorpus.from_files(train_files),
                                 batch_size=config.batch_size, seq_len=config.seq_len,
                                 seed=config.seed, sharding=batch_sharding)
  eval_batches = stdlib_bytes.Batches(stdlib_bytes.ByteCorpus.from_files(eval_files),
                                      batch_size=config.batch_size, seq_len=config.seq_len,
                                      seed=config.seed + 1, sharding=batch_sharding)
  if stdlib_bytes.VOCAB_SIZE > setup.model_cfg.vocab_size:
    raise ValueError(f'config.model.vocab_size={setup.model_cfg.vocab_size} is smaller than the '
                     f'byte tokenizer ({stdlib_bytes.VOCAB_SIZE})')

  mesh_desc = ' × '.join(f'{a}={n}' for a, n in setup.mesh.shape.items())
  log(f'meshlm: {param_count(setup.abstract_state.params) / 1e6:.2f}M parameters on '
      f'{setup.mesh.size} {jax.devices()[0].platform} devices, mesh {mesh_desc}; workdir {workdir}')
  t0 = time.perf_counter()
  state = setup.init_state()
  train_step = step_lib.compile_train_step(setup, config.batch_size, config.seq_len,
                                           config.loss.z_loss)
  eval_step = (step_lib.compile_eval_step(setup, config.batch_size, config.seq_len)
               if config.eval_every else None)
  log(f'initialised and compiled in {time.perf_counter() - t0:.1f}s')

  records, tokens_per_step = [], config.batch_size * config.seq_len
  last_time, last_step = time.perf_counter(), 0
  for step in range(config.train_steps):
    state, metrics = train_step(state, batches(step))
    done = step + 1
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
    if eval_step and (done % config.eval_every == 0 or done == config.train_steps):
      losses = [float(eval_step(state.params, eval_batches(i))['eval_loss'])
                for i in range(config.eval_batches)]
      record = {'step': done, 'eval_loss': float(np.mean(losses))}
      writer.write(record)
      log(metrics_lib.format_line(record, config.train_steps))
      records.append(record)
      last_time = time.perf_counter()  # evaluation time is not step time
  return records
