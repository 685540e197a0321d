"""Builds the two evaluation tasks meshlm ships (evaluation/tasks/), in lm-eval's own task format,
from the Python standard library's source, the corpus the tests and the default run train on:

  stdlib_next_line  multiple choice: six lines of a stdlib module, then which of four lines comes
                    next (the true one, and three of the same indentation from other modules);
                    scored by log-likelihood (acc, acc_norm)
  stdlib_complete   generation: six lines and the first half of the seventh; the model completes
                    the line, greedy, until its end (exact_match)

  python scripts/build_eval_tasks.py      # rewrites evaluation/tasks/*.jsonl

Deterministic for a given stdlib (the committed files were built from Python 3.12's); the tasks
read the files, so a rebuild on another Python changes them and is committed as such.
"""

import json
import pathlib
import random
import sysconfig

OUT = pathlib.Path(__file__).resolve().parents[1] / 'evaluation' / 'tasks'
CONTEXT_LINES = 6
EXAMPLES = {'stdlib_next_line': 200, 'stdlib_complete': 100}


def good(line: str) -> bool:
  text = line.strip()
  return 12 <= len(text) <= 80 and not text.startswith(('#', '"', "'")) and line.isascii()


def candidates(rng: random.Random):
  """(module, lines, i): line i is a good one after CONTEXT_LINES non-blank lines."""
  stdlib = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = sorted(p for p in stdlib.glob('*.py') if not p.name.startswith(('test', '_')))
  places = []
  for path in files:
    lines = path.read_text(encoding='utf-8', errors='replace').splitlines()
    for i in range(CONTEXT_LINES, len(lines)):
      if good(lines[i]) and all(lines[j].strip() for j in range(i - CONTEXT_LINES, i)):
        places.append((path.stem, lines, i))
  rng.shuffle(places)
  return places


def indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def main():
  rng = random.Random(0)
  places = candidates(rng)
  by_indent = {}
  for module, lines, i in places:
    by_indent.setdefault(indent(lines[i]), []).append((module, lines[i]))
  next_line, complete, used = [], [], set()
  for module, lines, i in places:
    key = (module, i)
    if key in used:
      continue
    context = '\n'.join(lines[i - CONTEXT_LINES:i]) + '\n'
    if len(next_line) < EXAMPLES['stdlib_next_line']:
      others = [line for m, line in by_indent[indent(lines[i])] if m != module and line != lines[i]]
      if len(set(others)) < 3:
        continue
      choices = [lines[i], *rng.sample(sorted(set(others)), 3)]
      rng.shuffle(choices)
      next_line.append({'module': module, 'context': context, 'choices': choices,
                        'label': choices.index(lines[i])})
    elif len(complete) < EXAMPLES['stdlib_complete']:
      half = indent(lines[i]) + len(lines[i].strip()) // 2
      complete.append({'module': module, 'context': context + lines[i][:half],
                       'target': lines[i][half:]})
    else:
      break
    used.add(key)
  for name, rows in (('stdlib_next_line', next_line), ('stdlib_complete', complete)):
    with open(OUT / f'{name}.jsonl', 'w') as f:
      f.writelines(json.dumps(row) + '\n' for row in rows)
    print(f'{OUT / name}.jsonl: {len(rows)} examples')


if __name__ == '__main__':
  main()
