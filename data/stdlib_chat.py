"""A chat corpus every machine has: questions about the standard library's functions, answered by
their docstrings, as JSON Lines of `{"messages": [{"role", "content"}, …]}`.

  python -m data.stdlib_chat --output=/tmp/stdlib-chat.jsonl
  python -m data.stdlib_chat --kind=preference --output=/tmp/stdlib-preference.jsonl
  python -m data.stdlib_chat --kind=chat_preference --output=/tmp/stdlib-chat-preference.jsonl

Each public function or method with a docstring gives one conversation: the user asks what
`module.name(arguments)` does, the assistant answers with the docstring's first paragraph; every
fourth has a system prompt. With --kind=preference each is a pair instead, `{"prompt", "chosen",
"rejected"}` (configs/dpo.py): the question as the prompt, the docstring's paragraph chosen, and
the same words in reverse order rejected, a preference a model can learn from the text alone.
With --kind=chat_preference the same pairs are conversations (TRL's conversational form): the
prompt the user's turn (after the system prompt, every fourth), each answer the assistant's. The
functions come in sorted order of their files, so the file is
the same on every machine with the same Python. It is written beside --output and linked into
place when whole, never over another file: one already there with the same records is left as it
is, one with others is refused.
"""

import ast
import json
import os
import pathlib
import sys
import sysconfig
import uuid

from absl import app, flags

from runtime import cli

# Checked in main, not marked required: importing this module (a test reads its records) must not
# make absl's flag parsing elsewhere (grain's workers parse flags) demand --output.
_OUTPUT = flags.DEFINE_string('output', None, 'The .jsonl file to write (required).')
_MAX = flags.DEFINE_integer('max_records', 5000, 'At most this many conversations.')
_KIND = flags.DEFINE_enum('kind', 'messages', ['messages', 'preference', 'chat_preference'],
                          'messages: chats; preference: pairs of a chosen and a rejected answer; '
                          'chat_preference: the pairs as conversations.')

SYSTEM = 'You answer questions about Python in one short paragraph.'


def _answer(docstring: str) -> str | None:
  """The docstring's first paragraph on one line, if it reads like a sentence."""
  paragraph = docstring.strip().split('\n\n')[0]
  text = ' '.join(line.strip() for line in paragraph.splitlines())
  return text if 20 <= len(text) <= 400 and text[0].isupper() else None


def conversations(root: pathlib.Path):
  for path in sorted(root.rglob('*.py')):
    relative = path.relative_to(root)
    if any(part.startswith(('_', 'test', 'site-packages', 'idlelib')) for part in relative.parts):
      continue
    module = '.'.join(relative.with_suffix('').parts).removesuffix('.__init__')
    try:
      tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
      continue
    for node in ast.walk(tree):
      body = node.body if isinstance(node, (ast.Module, ast.ClassDef)) else []
      for item in body:
        if not isinstance(item, ast.FunctionDef) or item.name.startswith('_'):
          continue
        answer = _answer(ast.get_docstring(item) or '')
        if answer is None:
          continue
        owner = f'{module}.{node.name}' if isinstance(node, ast.ClassDef) else module
        question = f'What does `{owner}.{item.name}({ast.unparse(item.args)})` do?'
        yield [{'role': 'user', 'content': question}, {'role': 'assistant', 'content': answer}]


def record(count: int, messages: list[dict], kind: str) -> dict:
  """The count-th conversation as a record of `kind` (module docstring)."""
  if kind == 'preference':
    question, answer = messages[0]['content'], messages[1]['content']
    return {'prompt': f'Q: {question}\nA: ', 'chosen': answer,
            'rejected': ' '.join(reversed(answer.split()))}
  if count % 4 == 0:
    messages = [{'role': 'system', 'content': SYSTEM}, *messages]
  if kind == 'chat_preference':
    prompt, answer = messages[:-1], messages[-1]['content']
    return {'prompt': prompt, 'chosen': [{'role': 'assistant', 'content': answer}],
            'rejected': [{'role': 'assistant', 'content': ' '.join(reversed(answer.split()))}]}
  return {'messages': messages}


def write(output: pathlib.Path, limit: int, kind: str = 'messages') -> int:
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  output.parent.mkdir(parents=True, exist_ok=True)
  partial = output.with_name(f'.{output.name}.partial-{uuid.uuid4().hex[:8]}')
  count = 0
  try:
    with open(partial, 'w', encoding='utf-8') as f:
      for count, messages in enumerate(conversations(root), 1):
        f.write(json.dumps(record(count, messages, kind), ensure_ascii=False) + '\n')
        if count == limit:
          break
    try:
      os.link(partial, output)  # never over an existing file (a run may be reading it)
    except FileExistsError:
      if output.read_bytes() != partial.read_bytes():
        raise ValueError(f'--output={output} exists and holds other records; it is never '
                         'written over: give a new --output') from None
    partial.unlink()
  except BaseException:
    partial.unlink(missing_ok=True)
    raise
  return count


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not _OUTPUT.value:
    raise ValueError('--output is required: the .jsonl file to write, e.g. '
                     '--output=/tmp/stdlib-chat.jsonl')
  if _MAX.value < 2:
    raise ValueError(f'--max_records={_MAX.value} must be at least 2 (a train and a validation '
                     'record)')
  count = write(pathlib.Path(_OUTPUT.value).expanduser(), _MAX.value, _KIND.value)
  what = 'conversations' if _KIND.value == 'messages' else 'pairs'
  print(f'{count} {what} → {_OUTPUT.value} (Python {sys.version.split()[0]})')


if __name__ == '__main__':
  cli.run(main)
