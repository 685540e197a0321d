"""Records from JSON Lines (`.jsonl`, `.jsonl.gz`) and Parquet files, as the documents a corpus
holds: what `config.data.record` says a record is, read from the fields it names.

  text               {text_key: str}                            continued pre-training
  prompt_completion  {prompt_field: str, completion_field: str}  trained on the completion
  messages           {messages_field: [{"role": str, "content": str}, …]}  trained on the
                     assistant's turns (data/chat.py renders them)
  preference         {prompt_field: str, chosen_field: str, rejected_field: str}  a pair of
                     answers to one prompt, the first preferred: trained on by DPO
  chat_preference    {prompt_field: [messages], chosen_field: [messages] or str, rejected_field:
                     likewise}  the same pair in conversations (TRL's conversational form): the
                     prompt's turns, then each answer's, rendered by the chat template

A record is stored as its text (`text`) or as canonical JSON of what was read
(`{"prompt", "completion"}`, `{"messages"}` or `{"prompt", "chosen", "rejected"}`, a chat pair's
each a list of messages), so a corpus's prepared form does not depend on its
files' field names. A record that is not JSON, lacks its field or holds the wrong type is skipped
and counted: `read` reports each file's count with the first bad record's line (or row).
"""

import dataclasses
import gzip
import json
import pathlib

from configs.base import PREFERENCE_RECORDS, RECORDS

KINDS = RECORDS  # config.data.record's
CHAT_KINDS = ('messages', 'chat_preference')  # rendered by the run's chat template (data/chat.py)
PREFERENCE_KINDS = PREFERENCE_RECORDS  # pairs, trained on by DPO
SUFFIXES = ('.jsonl', '.jsonl.gz', '.parquet')
ROLES = ('system', 'user', 'assistant', 'tool')


def is_record_file(path: pathlib.Path) -> bool:
  return path.name.endswith(SUFFIXES)


def check_kind(data_config) -> None:
  if data_config.name and data_config.record != 'text':
    raise ValueError(f'config.data.record={data_config.record!r} reads the records of '
                     f'{", ".join(SUFFIXES)} files in config.data.paths; a named TFDS dataset '
                     f'(config.data.name={data_config.name!r}) is read as text from '
                     'config.data.text_key: convert it to JSON Lines, or set record=text')
  for field in ('text_key', 'prompt_field', 'completion_field', 'messages_field', 'chosen_field',
                'rejected_field'):
    if not getattr(data_config, field):
      raise ValueError(f'config.data.{field} is empty; name the field records hold it in')


@dataclasses.dataclass(frozen=True)
class Fields:
  """Where a record holds what `kind` needs."""
  kind: str
  text: str
  prompt: str
  completion: str
  messages: str
  chosen: str = 'chosen'
  rejected: str = 'rejected'

  @classmethod
  def of(cls, data_config) -> 'Fields':
    return cls(data_config.record, data_config.text_key, data_config.prompt_field,
               data_config.completion_field, data_config.messages_field,
               data_config.chosen_field, data_config.rejected_field)

  def key(self) -> str:
    """What changes the stored form: part of the prepared dataset's name."""
    return {'text': f'text:{self.text}', 'messages': f'messages:{self.messages}',
            'prompt_completion': f'prompt_completion:{self.prompt},{self.completion}',
            'preference': f'preference:{self.prompt},{self.chosen},{self.rejected}',
            'chat_preference': f'chat_preference:{self.prompt},{self.chosen},{self.rejected}',
            }[self.kind]


def fields_of(data_config, files: list[pathlib.Path]) -> Fields | None:
  """What config.data's record files hold (None when `files` has none), checked against them."""
  check_kind(data_config)
  record_files = [f for f in files if is_record_file(f)]
  if data_config.record != 'text' and len(record_files) < len(files):
    text_file = next(f for f in files if not is_record_file(f))
    raise ValueError(f'config.data.record={data_config.record!r} reads records from '
                     f'{", ".join(SUFFIXES)} files, but config.data.paths also holds '
                     f'{text_file}; give only record files, or set config.data.record=\'text\'')
  return Fields.of(data_config) if record_files else None


class BadRecord(Exception):
  pass


def _string(record: dict, field: str) -> str:
  if field not in record:
    raise BadRecord(f'no field {field!r}')
  if not isinstance(record[field], str):
    raise BadRecord(f'field {field!r} is {type(record[field]).__name__}, not a string')
  return record[field]


def _turns(record: dict, field: str) -> list[dict]:
  """The field's messages, each {"role", "content"} with a known role."""
  if field not in record:
    raise BadRecord(f'no field {field!r}')
  messages = record[field]
  if not isinstance(messages, list) or not messages:
    raise BadRecord(f'field {field!r} is not a non-empty list of messages')
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get('role'), str) or not isinstance(
        m.get('content'), str):
      raise BadRecord(f'{field}[{i}] is not {{"role": str, "content": str}}')
    if m['role'] not in ROLES:
      raise BadRecord(f'{field}[{i}] has role {m["role"]!r}, not one of {ROLES}')
    out.append({'role': m['role'], 'content': m['content']})
  return out


def _answer(record: dict, field: str) -> list[dict]:
  """A chat pair's answer: its messages, the first the assistant's (a string is that message)."""
  if isinstance(record.get(field), str):
    turns = [{'role': 'assistant', 'content': record[field]}]
  else:
    turns = _turns(record, field)
  if turns[0]['role'] != 'assistant':
    raise BadRecord(f'{field}[0] has role {turns[0]["role"]!r}: an answer starts with the '
                    "assistant's turn")
  if not any(m['content'].strip() for m in turns if m['role'] == 'assistant'):
    raise BadRecord(f'field {field!r}: every assistant message is blank, nothing to compare')
  return turns


def _messages(record: dict, field: str) -> list[dict]:
  out = _turns(record, field)
  if not any(m['role'] == 'assistant' for m in out):
    raise BadRecord(f'field {field!r} has no assistant message to train on')
  if not any(m['content'].strip() for m in out if m['role'] == 'assistant'):
    raise BadRecord(f'field {field!r}: every assistant message is blank, nothing to train on')
  return out


def stored(record, fields: Fields) -> str:
  """The document a record holds, as stored; BadRecord says why it holds none."""
  if not isinstance(record, dict):
    raise BadRecord(f'a JSON {type(record).__name__}, not an object')
  if fields.kind == 'text':
    text = _string(record, fields.text)
    if not text.strip():
      raise BadRecord(f'field {fields.text!r} is blank')
    return text
  if fields.kind == 'prompt_completion':
    prompt, completion = _string(record, fields.prompt), _string(record, fields.completion)
    if not completion.strip():
      raise BadRecord(f'field {fields.completion!r} is blank: nothing to train on')
    return json.dumps({'prompt': prompt, 'completion': completion}, ensure_ascii=False)
  if fields.kind == 'chat_preference':
    prompt = _turns(record, fields.prompt)
    if prompt[-1]['role'] == 'assistant':
      raise BadRecord(f'field {fields.prompt!r} ends with an assistant message: the prompt is the '
                      'conversation before the answers')
    chosen, rejected = _answer(record, fields.chosen), _answer(record, fields.rejected)
    if chosen == rejected:
      raise BadRecord(f'fields {fields.chosen!r} and {fields.rejected!r} are the same answer: '
                      'nothing to prefer')
    return json.dumps({'prompt': prompt, 'chosen': chosen, 'rejected': rejected},
                      ensure_ascii=False)
  if fields.kind == 'preference':
    prompt = _string(record, fields.prompt)
    chosen, rejected = _string(record, fields.chosen), _string(record, fields.rejected)
    for field, answer in ((fields.chosen, chosen), (fields.rejected, rejected)):
      if not answer.strip():
        raise BadRecord(f'field {field!r} is blank: nothing to compare')
    if chosen == rejected:
      raise BadRecord(f'fields {fields.chosen!r} and {fields.rejected!r} are the same answer: '
                      'nothing to prefer')
    return json.dumps({'prompt': prompt, 'chosen': chosen, 'rejected': rejected},
                      ensure_ascii=False)
  return json.dumps({'messages': _messages(record, fields.messages)}, ensure_ascii=False)


def _raw(path: pathlib.Path):
  """(line or row number from 1, the parsed record or the BadRecord of a line that is not JSON)."""
  if path.name.endswith('.parquet'):
    import pyarrow.parquet as pq  # only needed for Parquet corpora
    try:
      table = pq.ParquetFile(path)
      row = 0
      for batch in table.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
          row += 1
          yield row, record
    except Exception as e:  # pyarrow's own errors for a file that is not Parquet
      raise ValueError(f'config.data.paths: {path} is not a readable Parquet file '
                       f'({str(e).splitlines()[0][:160]})') from None
    return
  opener = gzip.open if path.name.endswith('.gz') else open
  try:
    with opener(path, 'rt', encoding='utf-8') as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          yield number, json.loads(line)
        except json.JSONDecodeError as e:
          yield number, BadRecord(f'not JSON ({e.msg})')
  except (UnicodeDecodeError, OSError, EOFError) as e:  # gzip's and the codec's errors
    raise ValueError(f'config.data.paths: {path} cannot be read as UTF-8 JSON Lines'
                     f'{" (gzip)" if opener is gzip.open else ""} ({e}); fix or remove it') from None


@dataclasses.dataclass
class Skipped:
  """A file's bad records: how many, of how many, and the first one's place and reason."""
  path: pathlib.Path
  count: int
  total: int
  first: str

  def __str__(self):
    return f'{self.path}: skipped {self.count} of {self.total} records ({self.first})'


def read(path: pathlib.Path, fields: Fields, renders=None):
  """Yields (number, stored document) of a file's good records; the last thing it yields is its
  Skipped (count 0 when none was bad). `renders(stored)` (data/chat.py: Template), if given, must
  pass too: a conversation its chat template refuses is a bad record."""
  bad, first, total = 0, '', 0
  where = 'row' if path.name.endswith('.parquet') else 'line'
  for number, record in _raw(path):
    total += 1
    try:
      if isinstance(record, BadRecord):
        raise record
      document = stored(record, fields)
      if renders is not None:
        renders(document)
    except BadRecord as e:
      bad += 1
      first = first or f'{where} {number}: {e}'
      continue
    yield number, document
  yield Skipped(path, bad, total, first)
