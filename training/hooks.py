"""What happens around each train step, one small object per policy: the loop (training/loop.py)
only dispatches steps and hands each to its hooks, in order. A new policy is a new hook.

  Trace       the profiler, over config.profile_steps steps (reporting/profiling.py)
  NonFinite   steps whose loss or gradient was not finite: warned, and max_bad_steps in a row
              stop the run
  Progress    the progress bar
  LogMetrics  every log_every steps and at the last: metrics.jsonl, TensorBoard, the console
  Evaluate    every eval_every steps and at the last; one a stop skips is the resumed run's first
  Save        every checkpoint_every steps, at the last and when stopping; never from a state
              that follows a skipped step (the save waits for the next finite step)
and, handed to the loop by the entry point above it (training stands below evaluation):
  TaskScores  every lm_eval.every steps and at the last: lm-eval's tasks (evaluation/during.py),
              after Save, so that a step's checkpoint is on its way before its tasks are scored;
              one a stop skips is the resumed run's first

The order is the loop's: the guard has judged a step before Save may save it, and evaluation
time is not counted as step time.
"""

import dataclasses
import time
import warnings

import jax
import numpy as np
from jax.experimental import multihost_utils

from planning import flops
from reporting import metrics as metrics_lib
from reporting.profiling import StepTrace
from runtime import faults


@dataclasses.dataclass
class Step:
  """A step as the hooks see it, once dispatched (its results may still be computing)."""
  done: int  # steps done, this one included
  state: object  # the TrainState after it
  metrics: dict  # its metrics, on the devices
  last: bool  # the run's last step
  stopping: bool  # a signal asked the run to stop after it


def due(step: Step, every: int) -> bool:
  """Every `every` steps (0: never) and at the last."""
  return bool(every and step.done % every == 0) or step.last


class Hook:
  def before(self, step_index: int) -> None:
    """Before step `step_index` (0-based) is dispatched."""

  def after(self, step: Step) -> None:
    """After it is dispatched."""

  def close(self, state) -> None:
    """When the loop ends, however it ends."""


class Trace(Hook):
  def __init__(self, trace: StepTrace):
    self.trace = trace

  def before(self, step_index):
    self.trace.before_step(step_index)

  def after(self, step):
    self.trace.after_step(step.done, step.metrics)

  def close(self, state):
    self.trace.stop(state)


class NonFinite(Hook):
  """Counts steps in a row whose loss or gradient was not finite (the step skipped them);
  `config.max_bad_steps` in a row stop the run. It judges the step before the one just
  dispatched, so that at most two steps are in flight: the device stays busy and the host never
  runs far ahead."""

  def __init__(self, max_bad_steps: int, checkpointer):
    self.limit, self.in_a_row, self.checkpointer = max_bad_steps, 0, checkpointer
    self.previous, self.judged = None, 0

  def after(self, step):
    if self.previous:
      self.judge(self.previous)
    self.previous = step

  def judge(self, step: Step) -> None:
    """Waits for `step`, and counts it if it was skipped (each step once)."""
    if step.done <= self.judged:
      return
    self.judged = step.done
    if not bool(jax.device_get(step.metrics['skipped'])):
      self.in_a_row = 0
      return
    self.in_a_row += 1
    warnings.warn(f'step {step.done}: the loss or gradient is not finite; the step was skipped',
                  RuntimeWarning, stacklevel=2)
    if self.in_a_row >= self.limit:
      newest = self.newest_checkpoint()
      kept = (f'the last good checkpoint, step {newest}, is in {self.checkpointer.directory}'
              if newest is not None else 'no checkpoint was saved')
      raise faults.NonFiniteSteps(
          f'steps {step.done - self.in_a_row + 1}..{step.done}: {self.in_a_row} steps in a row '
          f'had a non-finite loss or gradient (config.max_bad_steps={self.limit}); {kept}. '
          'Lower config.optimizer.learning_rate, raise config.optimizer.warmup_steps or check the '
          'data')

  def finish(self) -> None:
    """Judges the last step (the loop ended without a next one)."""
    if self.previous:
      self.judge(self.previous)

  def newest_checkpoint(self) -> int | None:
    """The newest saved step (never one from a bad streak: those are not saved)."""
    saved = self.checkpointer.steps() if self.checkpointer else []
    return saved[0] if saved else None


class Progress(Hook):
  def __init__(self, console: metrics_lib.Console):
    self.console = console

  def after(self, step):
    self.console.step(step.done)

  def close(self, state):
    self.console.close()


class Report:
  """Where records go: metrics.jsonl and TensorBoard, the console, and the list loop.run
  returns."""

  def __init__(self, writer: metrics_lib.MetricsWriter, console: metrics_lib.Console,
               train_steps: int):
    self.writer, self.console, self.train_steps, self.records = writer, console, train_steps, []

  def __call__(self, record: dict) -> None:
    self.writer.write(record)
    self.console.log(metrics_lib.format_line(record, self.train_steps))
    self.records.append(record)


def scalars(values: dict) -> dict:
  """A step's metrics as named numbers: a vector v becomes name/0, name/1, … (an expert each)."""
  out = {}
  for key, value in values.items():
    if key == 'skipped':
      continue
    if getattr(value, 'ndim', 0):
      out.update({f'{key}/{i}': float(x) for i, x in enumerate(value)})
    else:
      out[key] = float(value)
  return out


class LogMetrics(Hook):
  """Every log_every steps: the step's metrics, with tokens/s, step time and TFLOP/s (MFU on
  known GPUs) over the steps since the last log, and peak memory where reported."""

  def __init__(self, every: int, report: Report, setup, start_step: int, device_kind):
    self.every, self.report, self.setup = every, report, setup
    run = setup.run
    self.tokens_per_step = run.batch_size * run.seq_len
    self.speed = lambda tokens_per_sec: flops.throughput(
        setup.model_cfg, run.seq_len, tokens_per_sec, setup.mesh.size, device_kind,
        reference=run.data.preference)
    self.since, self.since_step = time.perf_counter(), start_step

  def after(self, step):
    if not due(step, self.every):
      return
    values = jax.device_get(step.metrics)  # waits for the step
    step_time = (time.perf_counter() - self.since) / (step.done - self.since_step)
    record = {'step': step.done, **scalars(values),
              'tokens_per_sec': self.tokens_per_step / step_time, 'step_time_s': step_time,
              **self.speed(self.tokens_per_step / step_time)}
    if (peak := metrics_lib.peak_memory_bytes(self.setup.mesh.devices.flat)) is not None:
      record['peak_memory_gib'] = peak / 2**30
    self.report(record)
    self.restart_clock(step.done)

  def restart_clock(self, step_done: int | None = None) -> None:
    """Step time counts from now (after a log, or after an evaluation, which is not a step)."""
    self.since = time.perf_counter()
    if step_done is not None:
      self.since_step = step_done


class Evaluate(Hook):
  def __init__(self, every: int, evaluator, report: Report, clock: LogMetrics):
    self.every, self.evaluator, self.report, self.clock = every, evaluator, report, clock

  def after(self, step):
    if not due(step, self.every):
      return
    if step.stopping:  # a stop's grace period is for saving: the resumed run evaluates it (Save)
      return
    self.report({'step': step.done, **self.evaluator(step.state)})
    self.clock.restart_clock()


# In a checkpoint's data state: what its step had due that the stop skipped, the resumed run's
# first work. Save writes them: {flag: the interval it is due at}.
EVALUATE_FIRST = 'evaluate_first'  # the validation pass (Evaluate)
SCORE_FIRST = 'score_first'  # lm-eval's tasks (evaluation/during.py)
# A key of the record each reports: a rerun from the same checkpoint finds the ones done before.
RECORDED_AS = {EVALUATE_FIRST: 'eval_', SCORE_FIRST: 'lm_eval_time_s'}


def still_due(data_state: dict | None, writer: metrics_lib.MetricsWriter, step: int) -> set[str]:
  """The flags of `data_state` (EVALUATE_FIRST, SCORE_FIRST) whose records metrics.jsonl does
  not hold at `step` yet: an earlier resume from this checkpoint may have reported them. Read on
  process 0, agreed by every process (each takes part in an evaluation)."""
  flags = [flag for flag in RECORDED_AS if (data_state or {}).get(flag)]
  if not flags:  # every process restored the same data state: none reads metrics.jsonl then
    return set()
  keys = writer.keys_at(step) if writer.enabled else set()
  due_now = np.array([not any(key.startswith(RECORDED_AS[flag]) for key in keys)
                      for flag in flags], bool)
  if jax.process_count() > 1:
    due_now = np.asarray(multihost_utils.broadcast_one_to_all(due_now))
  return {flag for flag, due_it in zip(flags, due_now) if due_it}


class Save(Hook):
  """Checkpoints (runtime/checkpoint.py), never from a bad streak (module docstring)."""

  def __init__(self, every: int, checkpointer, guard: NonFinite, batches, config_json: dict,
               skipped_by_a_stop: dict[str, int] | None = None,
               saving=lambda state: (state, None, lambda: None)):
    """`skipped_by_a_stop`: {EVALUATE_FIRST or SCORE_FIRST: its interval} of the evaluations the
    run has: due at a step a stop saves, they are the resumed run's first. `saving`: what a
    checkpoint holds of the loop's state: (the orbax item's state, the pieces read in the
    background, a function called once they are read; training/tiers.py: Engine.saving, where
    the optimizer state lives off the devices)."""
    self.every, self.checkpointer, self.guard, self.saving = every, checkpointer, guard, saving
    self.batches, self.config_json = batches, config_json
    self.skipped_by_a_stop = skipped_by_a_stop or {}
    self.pending = False  # a save was due while the last steps were not finite
    self.saved = None  # the checkpoint of this step, if one was saved

  def before(self, step_index):
    self.checkpointer.check_saved()  # a save that failed in the background stops the run now

  def after(self, step):
    self.saved = None
    if not (self.pending or step.stopping or due(step, self.every)):
      return
    self.guard.judge(step)  # waits for this step: never save after the run should stop
    self.pending = self.guard.in_a_row > 0
    if not self.pending:
      skipped = {flag: True for flag, every in self.skipped_by_a_stop.items()
                 if step.stopping and due(step, every)}
      data_state = {**self.batches.state(), **skipped}
      state, pieces, read_out = self.saving(step.state)
      self.checkpointer.save(step.done, state, data_state, self.config_json, pieces, read_out)
      self.saved = self.checkpointer.directory / str(step.done)
