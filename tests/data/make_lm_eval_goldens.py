"""Makes tests/data/lm-eval-hf/goldens.json: lm-eval's Hugging Face backend (HFLM, with torch) on
the tiny Llama of tests/data/hf-llama-untied, over the first examples of the two tasks meshlm
ships (evaluation/tasks/): every choice's log-likelihood and greedy flag, every generated answer,
and the metrics. tests/test_evaluation.py holds meshlm's own model (the same weights, imported)
to them without torch. That checkpoint is what export.py writes back for a run started from it
(tests/test_huggingface.py: bit exact), so this is lm-eval's HF backend on an exported checkpoint.

  python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers accelerate lm_eval==0.4.13
  /tmp/hf/bin/python tests/data/make_lm_eval_goldens.py

Rows are read as meshlm reads them, after BOS (add_bos_token), at most MAX_LENGTH tokens. The
model's vocabulary (320) is padded past the tokenizer's 300 tokens: meshlm never generates an id
the tokenizer lacks, and an untrained model gives them weight, so HF's generate is told to
suppress them too (`suppress_tokens`); log-likelihoods are over the whole vocabulary in both.
"""

import importlib.metadata
import json
import pathlib

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHECKPOINT = HERE / 'hf-llama-untied'
LIMITS = {'stdlib_next_line': 40, 'stdlib_complete': 20}
MAX_LENGTH = 128


class HFLMOfTheTokenizersIds(HFLM):
  """HFLM generating only the ids its tokenizer has."""

  def _model_generate(self, context, max_length, stop, **generation_kwargs):
    padded = range(len(self.tokenizer), self.model.config.vocab_size)
    return super()._model_generate(context, max_length, stop, suppress_tokens=list(padded),
                                   **generation_kwargs)


def main():
  model = HFLMOfTheTokenizersIds(pretrained=str(CHECKPOINT), dtype='float32', batch_size=1, max_length=MAX_LENGTH,
               add_bos_token=True, device='cpu')
  bos = model.tokenizer.bos_token_id
  assert model.tok_encode('def f')[0] == bos, 'the rows must start with BOS, as meshlm reads them'
  tasks = TaskManager(include_path=str(REPO / 'evaluation' / 'tasks'))
  goldens = {'checkpoint': str(CHECKPOINT.relative_to(REPO)), 'max_length': MAX_LENGTH,
             'versions': {name: importlib.metadata.version(name)
                          for name in ('lm_eval', 'transformers', 'torch')}, 'tasks': {}}
  for task, limit in LIMITS.items():
    result = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=tasks, limit=limit,
                                     log_samples=True, random_seed=0, numpy_random_seed=0,
                                     torch_random_seed=0, fewshot_random_seed=0)
    metrics = {name.split(',')[0]: value for name, value in result['results'][task].items()
               if isinstance(value, float) and '_stderr' not in name}
    samples = [{'doc_id': s['doc_id'], 'resps': s['resps']} for s in result['samples'][task]]
    goldens['tasks'][task] = {'limit': limit, 'metrics': metrics, 'samples': samples}
    print(task, metrics)
  (HERE / 'lm-eval-hf' / 'goldens.json').write_text(json.dumps(goldens, indent=1) + '\n')


if __name__ == '__main__':
  main()
