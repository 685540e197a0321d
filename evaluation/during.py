"""lm-eval's tasks during training: a hook (training/hooks.py) that scores `config.lm_eval.tasks`
every `config.lm_eval.every` steps and at the last, on the parameters the run holds in memory,
sharded as they trained (no checkpoint, no export), and reports each task's metrics as
`<task>/<metric>` (metrics.jsonl, TensorBoard, the console) with the seconds it took.

  python train.py --config=configs/default.py --config.workdir=/tmp/meshlm-tasks \\
      --config.lm_eval.tasks=stdlib_next_line,stdlib_complete --config.lm_eval.every=100

Training stands below evaluation (DEVELOPERS.md: Layout), so the loop is handed this hook by the
entry point above both: train.py passes `TaskScores` to `training.loop.run`, and the loop refuses
lm_eval.tasks without it. `check` runs once the run is resolved, before anything is built: a task
name lm-eval does not know, a directory that is not there, a task whose documents cannot be read,
or a generation longer than the run's rows is one line then, not an error after the first `every`
steps. What fails while scoring all the same (a task's own code, say) is a warning: the
run trains on.

The model is the one evaluate.py scores (evaluation/harness.py: MeshLM), built on the step's
parameters: the same answers a checkpoint of that step gives evaluate.py. Its programs are
compiled once, at the first scoring, and reused (they are keyed on the model's structure, not its
values). In a job of several processes every process scores the same requests in step: each
forward spans the job's devices, its scores come back whole to every process (the harness's rows
are not split over devices), and process 0 reports them. A stop (SIGTERM, a preemption) skips a
scoring that was due, as it skips the validation pass: its grace period is for the checkpoint,
and the resumed run scores that step first.
"""

import contextlib
import functools
import logging
import pathlib
import time
import warnings

from flax import nnx

import evaluation
from inference import sampling
from model import Transformer
from training import hooks


def task_manager(lm_eval_config):
  """lm-eval's TaskManager for config.lm_eval: the shipped tasks and include_path's."""
  paths = []
  for path in lm_eval_config.include_paths:
    if not pathlib.Path(path).expanduser().is_dir():
      raise ValueError(f'config.lm_eval.include_path: {path} is not a directory (of lm-eval task '
                       'YAMLs); give one that exists')
    paths.append(str(pathlib.Path(path).expanduser()))
  return evaluation.task_manager(tuple(lm_eval_config.task_names), tuple(paths))


@contextlib.contextmanager
def quiet_lm_eval():
  """lm-eval's notes and progress bars kept off the run's console while it scores (its results
  are the run's record; a task's error still raises)."""
  import lm_eval.api.task
  logger, bar = logging.getLogger('lm_eval'), lm_eval.api.task.tqdm
  level = logger.level
  logger.setLevel(logging.ERROR)
  # Building a task's requests shows a bar that takes no switch (lm-eval 0.4.13).
  lm_eval.api.task.tqdm = functools.partial(bar, disable=True)
  try:
    yield
  finally:
    logger.setLevel(level)
    lm_eval.api.task.tqdm = bar


class TaskScores(hooks.Hook):
  """`TaskScores(setup, report, clock)`: the loop builds it once the step is compiled."""

  @staticmethod
  def check(run) -> None:
    """ValueError naming the setting, before the run builds anything."""
    manager = task_manager(run.lm_eval)
    if unknown := [name for name in run.lm_eval.task_names if name not in manager.all_tasks]:
      raise ValueError(f'config.lm_eval.tasks: no lm-eval task named {", ".join(unknown)} '
                       '(meshlm ships stdlib_next_line and stdlib_complete; a directory of your '
                       'own: config.lm_eval.include_path)')
    # Each task built once now, its documents read: a dataset that is not there, or a generation
    # longer than the run's rows, is found before the run trains, not at its first scoring.
    with quiet_lm_eval():
      try:
        tasks = manager.load(run.lm_eval.task_names)['tasks']
      except Exception as e:
        raise ValueError(f'config.lm_eval.tasks: lm-eval could not build {run.lm_eval.tasks}: '
                         f'{type(e).__name__}: {e}') from None
    for name, task in tasks.items():
      new_tokens = (getattr(task.config, 'generation_kwargs', None) or {}).get('max_gen_toks')
      if task.OUTPUT_TYPE == 'generate_until' and new_tokens and new_tokens >= run.seq_len:
        raise ValueError(f'config.lm_eval.tasks: {name} asks for {new_tokens} new tokens '
                         f'(max_gen_toks), which leaves no room for its prompt within '
                         f'config.seq_len={run.seq_len}; give the task fewer, or leave it out')

  def __init__(self, setup, report: hooks.Report, clock: hooks.LogMetrics):
    from evaluation import harness  # lm-eval and its dependencies
    self.run, self.report, self.clock = setup.run, report, clock
    self.tasks = task_manager(setup.run.lm_eval)
    # The model as sampling.load builds it from a checkpoint: no expert drops a token for want of
    # room, so that no row's answer depends on the rows beside it.
    self.graphdef = nnx.split(nnx.eval_shape(
        lambda: Transformer(setup.run.model.dropless(), rngs=nnx.Rngs(0))))[0]
    self.harness = harness

  def after(self, step):
    settings = self.run.lm_eval
    if not hooks.due(step, settings.every) or step.stopping:  # a stop's: the resumed run's first
      return
    self.score(step.done, step.state.params)
    self.clock.restart_clock()  # scoring is not step time

  def score(self, step: int, params) -> None:
    """Scores `params`, the parameters after `step`, and reports them; a task's fault is a
    warning."""
    try:
      record = self.scores(params)
    except Exception as e:  # a task's fault must not end a run its checkpoints can still score
      warnings.warn(f'step {step}: lm-eval\'s tasks ({self.run.lm_eval.tasks}) were not scored: '
                    f'{type(e).__name__}: {e}; training goes on, and evaluate.py '
                    f'--workdir={self.run.workdir} --step=… scores its checkpoints',
                    RuntimeWarning, stacklevel=2)
    else:
      self.report({'step': step, **record})

  def scores(self, params) -> dict:
    """{'<task>/<metric>': value, …, 'lm_eval_time_s': seconds} of `params`."""
    import lm_eval
    settings, start = self.run.lm_eval, time.perf_counter()
    loaded = sampling.Loaded(nnx.merge(self.graphdef, params), self.run.tokenizer, self.run,
                             checkpoint='(in memory)')
    model = self.harness.MeshLM(loaded=loaded, batch_size=settings.batch_size, seed=self.run.seed,
                                quiet=True)
    with quiet_lm_eval():
      results = lm_eval.simple_evaluate(
          model=model, tasks=settings.task_names, task_manager=self.tasks,
          limit=settings.limit or None, random_seed=self.run.seed,
          numpy_random_seed=self.run.seed, fewshot_random_seed=self.run.seed)
    record = {f'{task}/{metric}': float(value)
              for task, figures in self.harness.metrics(results).items()
              for metric, value in figures.items()}
    return {**record, 'lm_eval_time_s': time.perf_counter() - start}
