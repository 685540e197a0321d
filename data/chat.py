"""Stored documents (data/records.py) → token ids, and the weight of predicting each.

- `text`: `BOS ids… EOS`, every token trained on.
- `prompt_completion`: the prompt and the completion laid end to end; the completion (and the
  EOS after it) weigh 1, the prompt 0.
- `preference`: the prompt with the chosen answer, then the prompt with the rejected one, each
  as `prompt_completion` lays it out, as one `[2, n]` array whose weights' second bit marks the
  rejected sequence (data/packing.py lays a pair out in a row of its own).
- `chat_preference`: a pair whose prompt and answers are conversations: the prompt's turns with
  each answer's, rendered as `messages` are; each answer's assistant turns weigh 1, the prompt's 0.
- `messages`: the conversation rendered by a Jinja chat template as transformers renders it (the
  same sandbox, options, filters and variables): the tokenizer's own, from its
  tokenizer_config.json or the chat_template.jinja beside it, else FALLBACK, a ChatML layout in
  plain text. Each assistant turn is what rendering it adds to the conversation before it with
  the generation prompt (or what its `{% generation %}` blocks mark, where it has them, as
  transformers' assistant mask reads them); those characters weigh 1.

The weights follow the characters, not a second tokenization: a Hugging Face tokenizer encodes the
whole rendered text once (so the ids are transformers' ids) and a token weighs 1 when it starts
inside an answer; the byte and SentencePiece tokenizers encode each piece on its own. A document is
an int32 array `[n]` (every token weighs 1) or `[2, n]` (ids; then weights, 0 or 1).
"""

import dataclasses
import datetime
import functools
import hashlib
import json
import pathlib
import re

import numpy as np

from data import records
from runtime import faults

FALLBACK = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            "{{ message['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GENERATION = re.compile(r'\{%-?\s*generation\s*-?%\}')


@dataclasses.dataclass(frozen=True)
class Template:
  """A chat template: its Jinja source, where it comes from (for messages), and the tokenizer's
  special tokens it renders with.

  `template(stored)` renders a stored conversation (data/records.py), or raises BadRecord saying
  why not: corpus preparation asks it of every record, so a conversation the template refuses is
  skipped and counted there, its file and line named, never met mid-run."""
  source: str
  origin: str
  special_tokens: dict = dataclasses.field(default_factory=dict, compare=False)

  @property
  def digest(self) -> str:
    return digest(self.source)

  @property
  def key(self) -> str:
    """What decides which records render: the source and the special tokens."""
    return digest(self.source + json.dumps(self.special_tokens, sort_keys=True))

  def __call__(self, stored: str) -> None:
    try:
      for conversation in conversations(json.loads(stored)):
        answer_spans(self.source, conversation, self.special_tokens)
    except TemplateError as e:
      raise records.BadRecord(f'the chat template refuses it ({str(e)[:120]})') from None


def template_source(tokenizer, setting: str) -> Template:
  """The chat template that config.data.chat_template names, with `tokenizer`'s special tokens."""
  special = dict(getattr(tokenizer, 'special_tokens', {}))
  if setting == 'fallback':
    return Template(FALLBACK, 'the fallback template', special)
  if setting != 'auto':
    path = pathlib.Path(setting).expanduser()
    if not path.is_file():
      raise ValueError(f'config.data.chat_template={setting!r} is not auto, fallback or a Jinja '
                       'template file')
    return Template(path.read_text(), str(path), special)
  own = getattr(tokenizer, 'chat_template', None)
  if own:
    return Template(own, f"the chat template of {tokenizer.path}'s tokenizer_config.json",
                    special)
  return Template(FALLBACK, 'the fallback template (the tokenizer has none of its own)', special)


KEPT = 'chat_template.jinja'  # a run's copy of the template it renders its records with


def digest(source: str) -> str:
  return 'sha256:' + hashlib.sha256(source.encode()).hexdigest()[:12]


def owned(tokenizer, data_config, workdir, recorded: str = '') -> Template | None:
  """The chat template a run in `workdir` renders its records with, found once (settings.resolve;
  None where its records are not conversations): its own copy (workdir/chat_template.jinja,
  written by `keep_template` when it started) once it has one; else what
  config.data.chat_template names, which must be there whatever the records. A copy that is not
  what the run's checkpoints `recorded` it rendered with (a digest) was edited, and is refused,
  naming it; a template there now that is not the run's is refused, naming both digests; one gone
  (a moved .jinja file) is not missed."""
  kept = pathlib.Path(workdir).expanduser() / KEPT if workdir else None
  if kept is None or not kept.is_file():
    named = template_source(tokenizer, data_config.chat_template)
    return named if data_config.record in records.CHAT_KINDS else None
  if data_config.record not in records.CHAT_KINDS:
    return None
  mine = Template(kept.read_text(), str(kept), dict(getattr(tokenizer, 'special_tokens', {})))
  if recorded and mine.digest != recorded:
    raise faults.Fault(f'{kept}: the chat template is {mine.digest} now, but the run in '
                       f'{workdir} rendered its records with {recorded}: the run\'s own copy was '
                       'changed. Put back the template the run trained with')
  try:
    named = template_source(tokenizer, data_config.chat_template)
  except (OSError, ValueError):  # the .jinja file moved: the run has its own
    return mine
  if named.source != mine.source:
    raise ValueError(
        f'config.data.chat_template: {named.origin} is {named.digest} now, but the run in '
        f'{workdir} rendered its records with {mine.digest}, kept in {kept}: it keeps its own. '
        'Put the template back, or train with the new one in another --config.workdir')
  return mine


def keep_template(source: str, workdir: pathlib.Path) -> None:
  """Writes the run's chat template into its workdir once, whole (a partial file renamed)."""
  kept = workdir / KEPT
  if kept.is_file():
    return
  partial = workdir / f'{KEPT}.partial'
  partial.write_text(source)
  partial.rename(kept)


def kept_template(workdir) -> str | None:
  """The chat template a run rendered its records with, if it kept one."""
  kept = pathlib.Path(workdir).expanduser() / KEPT
  return kept.read_text() if kept.is_file() else None


class TemplateError(ValueError):
  pass


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _raise(message):
  raise TemplateError(message)


@functools.cache
def _compiled(source: str):
  """The template in the environment transformers renders chat templates in."""
  import jinja2  # only needed for chat records
  from jinja2 import ext, nodes, sandbox

  class Generation(ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks an answer: while `environment.answers` is a
    list, each one's (start, end) characters go in it, as transformers finds them."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      text = caller()
      if self.environment.answers is not None:
        start = sum(map(len, self.environment.rendered))
        self.environment.answers.append((start, start + len(text)))
      return text

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[Generation, ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.answers, env.rendered = None, []
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise TemplateError(f'it is not a Jinja template ({e})') from None


def render(source: str, messages, special_tokens: dict, add_generation_prompt: bool,
           answers: list | None = None) -> str:
  """The conversation as `source` renders it; `answers`, if given, gets the spans its
  {% generation %} blocks mark."""
  import jinja2
  template = _compiled(source)
  env = template.environment
  env.answers, env.rendered = answers, []
  try:
    for block in template.generate(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **special_tokens):
      env.rendered.append(block)
    return ''.join(env.rendered)
  except jinja2.TemplateError as e:
    raise TemplateError(str(e)) from None
  finally:
    env.answers, env.rendered = None, []


def conversations(record: dict) -> list[list[dict]]:
  """A stored chat record's conversations: its messages, or a pair's prompt with each answer."""
  if 'messages' in record:
    return [record['messages']]
  return [record['prompt'] + record[answer] for answer in ('chosen', 'rejected')]


def answer_spans(source: str, messages, special_tokens: dict) -> tuple[str, list[tuple[int, int]]]:
  """The rendered conversation, and the (start, end) characters of each assistant turn: those its
  {% generation %} blocks mark, else what rendering each adds to the conversation before it with
  the generation prompt."""
  if GENERATION.search(source):
    spans = []
    return render(source, messages, special_tokens, False, spans), spans
  text, spans = render(source, messages, special_tokens, False), []
  for k, message in enumerate(messages):
    if message['role'] != 'assistant':
      continue
    before = render(source, messages[:k], special_tokens, True)
    through = render(source, messages[:k + 1], special_tokens, False)
    if not (text.startswith(through) and through.startswith(before)):
      raise TemplateError('it does not render the start of a conversation as the start of the '
                          f'whole one (turn {k}), so its answers cannot be found')
    spans.append((len(before), len(through)))
  return text, spans


def _weights_of(starts: np.ndarray, spans) -> np.ndarray:
  weights = np.zeros(len(starts), np.int32)
  for start, end in spans:
    weights[(starts >= start) & (starts < end)] = 1
  return weights


def _pieces(text: str, spans):
  """The text cut at the spans' edges: (piece, inside a span)."""
  cuts = sorted({0, len(text), *(e for span in spans for e in span)})
  for a, b in zip(cuts, cuts[1:]):
    yield text[a:b], any(s <= a and b <= e for s, e in spans)


class Encoder:
  """Stored documents of one kind → token arrays (a callable on a list of stored texts)."""

  def __init__(self, tokenizer, record: str = 'text', template: Template | None = None,
               train_on: str = 'answers'):
    """`template`: the run's (`owned`), which chat records are rendered with."""
    self.tokenizer, self.record = tokenizer, record
    self.masked = record in records.PREFERENCE_KINDS or (record != 'text' and
                                                         train_on == 'answers')
    self.chat = record in records.CHAT_KINDS
    if self.chat and template is None:
      raise ValueError('chat records render with a template: pass chat.owned(...) or '
                       'chat.template_source(...)')
    self.source, self.origin = (template.source, template.origin) if self.chat else ('', '')

  @property
  def key(self) -> str:
    """What, beside the tokenizer and the corpus, changes the arrays: '' for plain text."""
    if self.record == 'text':
      return ''
    what = f'{self.record}\0{self.masked}\0{self.source}'
    return hashlib.sha256(what.encode()).hexdigest()[:12]

  def _text_and_spans(self, stored: str):
    record = json.loads(stored)
    if self.record == 'prompt_completion':
      text = record['prompt'] + record['completion']
      return text, [(len(record['prompt']), len(text))]
    return self._rendered(record['messages'])

  def _rendered(self, conversation):
    try:
      return answer_spans(self.source, conversation, getattr(self.tokenizer, 'special_tokens', {}))
    except TemplateError as e:
      # Preparation skips what the run's template refuses (Template): only a corpus read without
      # that check (prepared with another template) reaches here.
      raise ValueError(f'config.data.chat_template: {self.origin} fails on a conversation: {e}; '
                       'fix the records, and a run prepares them afresh') from None

  def _encode(self, texts: list[str], spans) -> list[tuple[np.ndarray, np.ndarray]]:
    tok = self.tokenizer
    if hasattr(tok, 'encode_offsets_batch'):  # one encoding of the whole text: transformers' ids
      return [(ids, _weights_of(starts, s))
              for (ids, starts), s in zip(tok.encode_offsets_batch(texts), spans)]
    out = []
    for text, s in zip(texts, spans):
      pieces = list(_pieces(text, s))
      encoded = tok.encode_batch([piece.encode() for piece, _ in pieces])
      ids = [i for piece_ids in encoded for i in piece_ids]
      weights = [int(inside) for piece_ids, (_, inside) in zip(encoded, pieces)
                 for _ in piece_ids]
      out.append((np.asarray(ids, np.int32), np.asarray(weights, np.int32)))
    return out

  def _with_ends(self, ids: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """BOS first and EOS last (a record's: unless its template put them there); the EOS weighs
    what the token before it does (a completion's end is trained on). A conversation starts as
    its template renders it, BOS or not (ChatML has none), as transformers' apply_chat_template
    gives a served model its prompt."""
    tok, templated = self.tokenizer, self.record != 'text'
    head = ([] if self.chat or (templated and len(ids) and ids[0] == tok.bos_id)
            else [tok.bos_id])
    tail = [] if templated and len(ids) and ids[-1] == tok.eos_id else [tok.eos_id]
    tokens = np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)])
    if weights is None:
      return tokens.astype(np.int32)
    last = weights[-1:] if len(weights) else np.zeros(1, np.int32)
    weights = np.concatenate([np.zeros(len(head), np.int32), weights,
                              last if tail else np.zeros(0, np.int32)])
    return np.stack([tokens, weights]).astype(np.int32)

  def _pair(self, record: dict) -> np.ndarray:
    """A preference record's two sequences as one array: ids; weights, + 2 on the rejected one."""
    if self.chat:  # the answers' assistant turns: those after the prompt's
      turns = sum(m['role'] == 'assistant' for m in record['prompt'])
      rendered = [self._rendered(conversation) for conversation in conversations(record)]
      texts, spans = [text for text, _ in rendered], [s[turns:] for _, s in rendered]
    else:
      texts = [record['prompt'] + record[answer] for answer in ('chosen', 'rejected')]
      spans = [[(len(record['prompt']), len(text))] for text in texts]
    chosen, rejected = (self._with_ends(ids, weights) for ids, weights in self._encode(texts, spans))
    return np.concatenate([chosen, rejected + np.array([[0], [2]], np.int32)], axis=1)

  def __call__(self, stored: list[bytes]) -> list[np.ndarray]:
    tok = self.tokenizer
    if self.record in records.PREFERENCE_KINDS:
      return [self._pair(json.loads(s.decode('utf-8'))) for s in stored]
    if self.record == 'text':
      return [self._with_ends(ids, None) for ids in tok.encode_batch(stored)]
    texts, spans = zip(*(self._text_and_spans(s.decode('utf-8')) for s in stored))
    if not self.masked:
      return [self._with_ends(ids, None) for ids in tok.encode_batch([t.encode() for t in texts])]
    return [self._with_ends(ids, weights) for ids, weights in self._encode(list(texts), spans)]


def ids_and_weights(document: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
  """A document's ids, and the weight of predicting each (None: every one weighs 1)."""
  return (document, None) if document.ndim == 1 else (document[0], document[1])
