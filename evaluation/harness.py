"""meshlm as a model of EleutherAI's lm-evaluation-harness: the benchmarks everyone reports, on a
run's checkpoint, sharded as sampling shards it (inference/sampling.py: `load`).

  python evaluate.py --workdir=/tmp/meshlm-default --tasks=stdlib_next_line,stdlib_complete
  python -m evaluation.harness run --model meshlm --model_args workdir=/tmp/meshlm-default \
      --tasks stdlib_next_line --include_path evaluation/tasks      # lm-eval's own command line

lm-eval finds models by import, not by plugin (0.4.13 has no entry points for them), so its
command line is reached through this module, which registers `meshlm` first.

What the model is asked, and how it answers:
  loglikelihood          (context, continuation) pairs, tokenized as lm-eval's TemplateLM does
                         (the whole text encoded, the context's tokens split off; trailing spaces
                         moved to the continuation). Each row is read as a document is: after
                         BOS. Rows are sorted longest first, batched, right-padded to a multiple of
                         PAD_TO, truncated on the left to the trained seq_len; one forward scores
                         every continuation token (log-softmax over the whole vocabulary, as the
                         training loss, PAD_TO positions' logits at a time) and says whether each
                         was the argmax.
  loglikelihood_rolling  a whole text's log-likelihood, in lm-eval's disjoint rolling windows of
                         the trained seq_len, each scored as above.
  generate_until         the KV-cached sampler (greedy unless do_sample), prompts grouped by their
                         generation settings, each answer cut at the first stop sequence.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from inference import sampling

PAD_TO = 64  # rows are padded to a multiple of this many tokens (few shapes, few compiles),
# and scored this many positions at a time


@register_model('meshlm')
class MeshLM(TemplateLM):
  """lm-eval's model interface on a loaded meshlm checkpoint. `workdir`: a run's workdir, its
  checkpoints/ or one checkpoints/<step>; `batch_size`: rows a forward; `max_gen_toks`: a
  generation's default length; `seed`: the draws of sampled generations; `quiet`: no progress
  bars (a training run's console)."""

  def __init__(self, workdir: str = '', batch_size: int | str | None = 16, max_gen_toks: int = 256,
               seed: int = 0, loaded: sampling.Loaded | None = None, quiet: bool = False,
               device=None, max_batch_size=None, **unused):
    # device and max_batch_size: lm-eval's command line hands every model these; meshlm runs on
    # JAX's devices, and its batch is batch_size ('auto' or 'auto:N', lm-eval's search, takes
    # the default).
    super().__init__()
    if unused:
      raise ValueError(f'--model_args: meshlm takes workdir, batch_size, max_gen_toks and seed, '
                       f'not {", ".join(sorted(unused))}')
    if loaded is None and not workdir:
      raise ValueError('--model_args: give workdir=<a run\'s workdir or checkpoint>')
    self.loaded = loaded or sampling.load(workdir)
    self.batch_size = (16 if batch_size is None or str(batch_size).startswith('auto')
                       else int(batch_size))
    self.max_gen_toks, self.seed, self.quiet = int(max_gen_toks), int(seed), quiet
    if self.batch_size < 1 or self.max_gen_toks < 1:
      raise ValueError(f'--model_args: batch_size={batch_size} and max_gen_toks={max_gen_toks} '
                       'must be at least 1')
    self.tok = self.loaded.tokenizer
    self.max_length = self.loaded.run.seq_len
    self._graphdef, self._state = nnx.split(self.loaded.model)

  # The tokenizer, as TemplateLM asks for it ----------------------------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:  # what an empty context is: a document's start
    return self.tok.bos_id

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
    return [int(i) for i in self.tok.encode(string.encode())]

  def tok_decode(self, ids) -> str:
    return self.tok.decode(list(ids))

  @property
  def tokenizer_name(self) -> str:
    return self.tok.name

  # Scoring -------------------------------------------------------------------------------------

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    rows = []
    for _, context, continuation in requests:
      if not continuation:
        raise ValueError('--tasks: a task asked for the log-likelihood of an empty continuation')
      if len(continuation) > self.max_length:
        raise ValueError(f'--tasks: a task asked for the log-likelihood of {len(continuation):,} '
                         f'tokens at once, more than the seq_len the model was trained at, '
                         f'{self.max_length:,}; evaluate a model trained on longer rows')
      whole = list(context) + list(continuation)
      if whole[0] != self.tok.bos_id:
        whole = [self.tok.bos_id, *whole]
      rows.append((whole[-(self.max_length + 1):], len(continuation)))
    results = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      length = -(-max(len(rows[i][0]) - 1 for i in batch) // PAD_TO) * PAD_TO
      tokens = np.full((self.batch_size, length), self.tok.pad_id, np.int32)
      targets = np.full((self.batch_size, length), self.tok.pad_id, np.int32)
      for j, i in enumerate(batch):
        whole = rows[i][0]
        tokens[j, :len(whole) - 1], targets[j, :len(whole) - 1] = whole[:-1], whole[1:]
      logprob_BL, greedy_BL = map(np.asarray, _token_scores(self._graphdef, self._state, tokens,
                                                            targets))
      for j, i in enumerate(batch):
        end, n = len(rows[i][0]) - 1, rows[i][1]
        results[i] = (float(logprob_BL[j, end - n:end].sum()), bool(greedy_BL[j, end - n:end].all()))
    for (request, _, _), result in zip(requests, results):
      if request[0] is not None:
        self.cache_hook.add_partial('loglikelihood', request, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owners = [], []
    for index, (text,) in enumerate(request.args for request in requests):
      for window in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id,
                                              self.max_length, context_len=1):
        windows.append(((None, None), *make_disjoint_window(window)))
        owners.append(index)
    totals = [0.0] * len(requests)
    for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
      totals[owner] += logprob
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial('loglikelihood_rolling', request.args, total)
    return totals

  # Generation ----------------------------------------------------------------------------------

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups = {}  # requests of the same settings decode together
    for index, (context, settings) in enumerate(request.args for request in requests):
      settings = dict(settings or {})
      until = settings.pop('until', None) or []
      until = [until] if isinstance(until, str) else list(until)
      new_tokens = int(settings.pop('max_gen_toks', self.max_gen_toks))
      temperature = float(settings.pop('temperature', 0.0)) if settings.pop('do_sample', False) else 0.0
      groups.setdefault((tuple(until), new_tokens, temperature), []).append((index, context))
    answers = [''] * len(requests)
    for (until, new_tokens, temperature), members in groups.items():
      room = self.max_length - new_tokens  # the prompt keeps its last tokens that leave room
      if room < 1:
        raise ValueError(f'--tasks: a task asks for {new_tokens} new tokens (max_gen_toks), which '
                         f'leaves no room for its prompt within the seq_len the model was trained '
                         f'at, {self.max_length}; give the task fewer, or evaluate a model trained '
                         'on longer rows')
      for start in range(0, len(members), self.batch_size):
        batch = members[start:start + self.batch_size]
        ids = [[self.tok.bos_id, *self.tok_encode(context)][-room:] for _, context in batch]
        texts = sampling.continue_ids(self.loaded, ids, new_tokens, temperature=temperature,
                                      top_k=0, seed=self.seed, pad_to=PAD_TO)
        for (index, _), text in zip(batch, texts):
          for stop in until:
            text = text.split(stop)[0] if stop else text
          answers[index] = text
    for request, answer in zip(requests, answers):
      self.cache_hook.add_partial('generate_until', request.args, answer)
    return answers


def metrics(results: dict) -> dict:
  """{task: {metric: value}} of lm-eval's result: each metric by its name ('acc', not
  'acc,none'), without their standard errors or the examples' count (sample_len)."""
  return {task: {name.split(',')[0]: value for name, value in figures.items()
                 if isinstance(value, (int, float)) and not isinstance(value, bool)
                 and not name.startswith(('alias', 'sample_len')) and '_stderr' not in name}
          for task, figures in results['results'].items()}


# One program per model structure and shape, shared by every MeshLM of a run (each of the
# in-training hook's scorings builds one).
@functools.partial(jax.jit, static_argnums=0)
def _token_scores(graphdef, state, tokens_BL, targets_BL):
  """log p(target) of every position, fp32, and whether the target was the most likely token;
  the final norm and head applied PAD_TO positions at a time, so that a forward never holds more
  logits than those (a batch's whole logits over a 128k vocabulary are gigabytes)."""
  def scores(output, targets_BL):
    B, L, D = output.x_BLD.shape
    x_nBcD = output.x_BLD.reshape(B, L // PAD_TO, PAD_TO, D).swapaxes(0, 1)
    targets_nBc = targets_BL.reshape(B, L // PAD_TO, PAD_TO).swapaxes(0, 1)

    def chunk(args):
      x_BcD, targets_Bc = args
      logits_BcV = output.model.logits(x_BcD)
      target_Bc = jnp.take_along_axis(logits_BcV, targets_Bc[..., None], axis=-1)[..., 0]
      return (target_Bc - jax.nn.logsumexp(logits_BcV, axis=-1),
              jnp.argmax(logits_BcV, axis=-1) == targets_Bc)
    logprob_nBc, greedy_nBc = jax.lax.map(chunk, (x_nBcD, targets_nBc))
    return logprob_nBc.swapaxes(0, 1).reshape(B, L), greedy_nBc.swapaxes(0, 1).reshape(B, L)
  output, _ = nnx.merge(graphdef, state).output(tokens_BL)
  logprob_BL, greedy_BL = scores(output, targets_BL)
  return logprob_BL, greedy_BL


if __name__ == '__main__':  # lm-eval's own command line, with meshlm registered
  from lm_eval.__main__ import cli_evaluate
  sys.argv[0] = 'lm_eval'
  cli_evaluate()
