"""What the step benchmarks share: a config's setup, state and compiled step as train.py builds
them, and a batch of random tokens placed as train.py places batches; and how the kernel
benchmarks time a compiled program (back_to_back_s)."""

import dataclasses
import statistics
import time

import jax
import numpy as np

import sharding
from training import programs
from training import settings
from configs.base import Run
from training.state import Setup, TrainState, build


@dataclasses.dataclass
class Prepared:
  run: Run  # settings.resolve's
  setup: Setup
  state: TrainState
  train_step: object  # compiled: (state, batch) → (state, metrics), state donated
  batch: dict
  compile_s: float  # initialising the state and compiling the step


def prepare(config, packed: bool = False) -> Prepared:
  run = settings.resolve(config)
  setup = build(run)
  t0 = time.perf_counter()
  state = setup.init_state()
  train_step = programs.compile_train_step(setup, run.batch_size, run.seq_len, run.loss.z_loss,
                                           packed=packed, microbatches=run.microbatches)
  return Prepared(run, setup, state, train_step, random_batch(run, setup.mesh, packed),
                  time.perf_counter() - t0)


def random_batch(config, mesh, packed: bool = False) -> dict:
  """Random tokens (a step's time does not depend on their values), one document a row as in
  the peers' figures; `packed` adds segment ids (one segment a row)."""
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  tokens = rng.integers(0, min(256, config.model.vocab_size), size=(shape[0], shape[1] + 1))
  host = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'positions': np.broadcast_to(np.arange(shape[1]), shape),
          'weights': np.ones(shape)}
  if packed:
    host['segment_ids'] = np.ones(shape)
  s = sharding.batch_sharding(mesh)
  return {k: jax.device_put(np.asarray(v, programs.BATCH_KEYS[k]), s) for k, v in host.items()}


def back_to_back_s(compiled, args, iters: int, rounds: int = 3) -> float:
  """Seconds a call of `compiled(*args)`: `iters` calls back to back, waited for once (one stream
  runs them in order, so the GPU never idles between calls), the median of `rounds` such rounds;
  after one untimed call."""
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(iters):
      out = compiled(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / iters)
  return statistics.median(times)
