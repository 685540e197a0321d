"""Text corpora as TFDS datasets in array_record, read as random-access sources (no TensorFlow).

`config.data.paths` (files, directories or globs; `stdlib` = the Python standard library's .py
files) is prepared once by the `TextFiles` builder into `config.data.data_dir` and reused: the
dataset's name hashes the file list, sizes and mtimes (and, for record files, what a record is),
so a changed corpus is prepared afresh. A text file is one document; a `.jsonl`, `.jsonl.gz` or
`.parquet` file holds one a record (data/records.py: `config.data.record` and its fields).
`config.data.name` instead names any TFDS dataset already prepared there (array_record format),
whose text lives under `config.data.text_key`.

The train/validation split is by a hash of each text file's path relative to the corpus root, and
of each record's stored content, so it does not depend on the order files or records are found in
(and a record repeated lands on one side only); at least one document lands on each side.
TFDS writes into an `incomplete.*` directory and renames it when done, so a failed or killed
preparation never leaves a dataset a later run would read.
"""

import contextlib
import dataclasses
import glob
import hashlib
import logging
import os
import pathlib
import pickle
import sysconfig
import warnings

import tensorflow_datasets as tfds

from data import chat, packing, records
from runtime.workdir import writable_dir
from runtime import faults

STDLIB = 'stdlib'


class DataWarning(UserWarning):
  """Input that is skipped, not fatal: undecodable files, bad records, documents shorter than a
  row."""


def data_dir(data_config) -> str:
  """config.data.data_dir, or TFDS's own default ($TFDS_DATA_DIR, else ~/tensorflow_datasets)."""
  path = data_config.data_dir or os.environ.get('TFDS_DATA_DIR', '~/tensorflow_datasets')
  return str(pathlib.Path(path).expanduser())


def find_files(paths: str) -> tuple[pathlib.Path, list[pathlib.Path]]:
  """The corpus root and its files (sorted) for config.data.paths."""
  if paths == STDLIB:
    root = pathlib.Path(sysconfig.get_paths()['stdlib'])
    files = [p for p in root.rglob('*.py') if 'site-packages' not in p.parts and p.is_file()]
  else:
    files = []
    for entry in filter(None, (e.strip() for e in paths.split(','))):
      path = pathlib.Path(entry).expanduser()
      if any(c in entry for c in '*?['):
        found = [pathlib.Path(p) for p in glob.glob(str(path), recursive=True)]
      elif path.is_dir():
        found = [p for p in path.rglob('*') if not any(part.startswith('.') for part in
                                                       p.relative_to(path).parts)]
      elif path.is_file():
        found = [path]
      else:
        raise ValueError(f'config.data.paths: {entry!r} does not exist; give files, directories '
                         'or globs, comma-separated (or stdlib)')
      found = [p for p in found if p.is_file()]
      if not found:
        raise ValueError(f'config.data.paths: {entry!r} matches no files')
      files += found
    if not files:
      raise ValueError('config.data.paths is empty; give files, directories or globs, '
                       'comma-separated, or stdlib')
  files = sorted({p.resolve() for p in files})
  root = pathlib.Path(os.path.commonpath(files)) if len(files) > 1 else files[0].parent
  return root, files


def split_score(key: str) -> float:
  return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32


def split_documents(scores: dict, validation_fraction: float):
  """(train in the order given, validation sorted) document keys: those scoring under the
  fraction are held out, and at least one lands on each side. Documents of one score (a record
  repeated: its score hashes its content) land on one side together, so evaluation never scores
  a document trained on."""
  _check_validation_fraction(validation_fraction)
  distinct = sorted(set(scores.values()))
  if len(distinct) < 2:
    raise ValueError(f'config.data.paths holds {len(scores)} usable document(s), '
                     f'{len(distinct)} of them distinct; at least 2 distinct ones are needed for '
                     'a train and a validation split that share none')
  held = {v for v in distinct if v < validation_fraction}
  if not held:  # a small corpus: hold out the lowest-scoring document (and its repeats)
    held = {distinct[0]}
  if len(held) == len(distinct):
    held.discard(distinct[-1])
  validation = sorted(k for k in scores if scores[k] in held)
  return [k for k in scores if scores[k] not in held], validation


@dataclasses.dataclass(eq=False)
class TextFilesConfig(tfds.core.BuilderConfig):
  root: str = ''
  # Documents as (path relative to root, record's line or row number; 0 for a text file).
  train: tuple[tuple[str, int], ...] = ()
  validation: tuple[tuple[str, int], ...] = ()
  fields: records.Fields | None = None  # what a record file's records hold
  longest: int = 0  # bytes of the longest document
  content: str = ''  # a hash of every document's text and split (`content_hash`)
  renders: object = None  # chat records: what each must render with (data/chat.py: Template)


class _LocalInfo(tfds.core.DatasetInfo):
  """A corpus's DatasetInfo. For a dataset not yet prepared, TFDS looks its info up on its public
  bucket through a temporary directory it never removes (one in /tmp for every builder made);
  ours are never there."""

  def initialize_from_bucket(self) -> None:
    pass


class TextFiles(tfds.core.GeneratorBasedBuilder):
  """One example per UTF-8 file or good record: {'text', 'path'} ('file:line' for a record).
  Blank files, undecodable ones and bad records are skipped (the last two with a DataWarning)
  before preparation starts."""
  VERSION = tfds.core.Version('1.0.0')
  url_infos = None  # nothing to download (and TFDS's lookup of checksum files fails in packages)

  def _info(self):
    return _LocalInfo(
        builder=self, description=f'Text files under {self.builder_config.root}',
        features=tfds.features.FeaturesDict({'text': tfds.features.Text(),
                                             'path': tfds.features.Text()}),
        metadata=tfds.core.MetadataDict())

  def _split_generators(self, dl_manager):
    del dl_manager
    cfg = self.builder_config
    self.info.metadata['max_document_bytes'] = cfg.longest
    self.info.metadata['record'] = cfg.fields.kind if cfg.fields else 'text'
    self.info.metadata['content'] = cfg.content
    return {'train': self._generate_examples(cfg.train),
            'validation': self._generate_examples(cfg.validation)}

  def _generate_examples(self, documents):
    root, fields = pathlib.Path(self.builder_config.root), self.builder_config.fields
    wanted = {}
    for relative, number in documents:
      wanted.setdefault(relative, set()).add(number)
    for relative, numbers in wanted.items():
      # A file changed since the scan raises here, and TFDS discards the incomplete dataset.
      if not records.is_record_file(root / relative):
        yield relative, {'text': (root / relative).read_bytes().decode('utf-8'),
                         'path': relative}
        continue
      found = 0
      for item in records.read(root / relative, fields, self.builder_config.renders):
        if not isinstance(item, records.Skipped) and item[0] in numbers:
          found += 1
          yield f'{relative}:{item[0]}', {'text': item[1], 'path': f'{relative}:{item[0]}'}
      if found != len(numbers):
        raise ValueError(f'config.data.paths: {root / relative} changed while it was prepared; '
                         'run again')


def _scan_records(root: pathlib.Path, files, fields: records.Fields, renders=None):
  """Each good record's split score, by (path, number), the longest one's bytes, and a warning
  for each file with bad records, counting them; a corpus without a good one is one error."""
  scores, digests, longest, skipped = {}, {}, 0, []
  for f in files:
    relative = str(f.relative_to(root))
    for item in records.read(f, fields, renders):
      if isinstance(item, records.Skipped):
        skipped.append(item)
        continue
      scores[relative, item[0]] = split_score(item[1])
      digests[relative, item[0]] = hashlib.sha256(item[1].encode()).digest()
      longest = max(longest, len(item[1].encode()))
  if not sum(s.total for s in skipped):
    raise ValueError(f'config.data.paths: its {len(files)} record file(s) hold no records '
                     f'({", ".join(str(f) for f in files[:3])}); give files with some')
  if not scores:
    first = next((s.first for s in skipped if s.first), 'none')
    raise ValueError(
        f'config.data.paths: none of the {sum(s.total for s in skipped)} records of its '
        f'{len(files)} record file(s) holds what config.data.record={fields.kind!r} reads '
        f'(first: {first}); set config.data.record (one of {", ".join(records.KINDS)}) and the '
        'fields it reads (text_key, prompt_field, completion_field, messages_field, chosen_field, '
        'rejected_field) to what the records hold')
  return scores, digests, longest, [f'config.data.paths: {s}' for s in skipped if s.count]


def _usable(files: list[pathlib.Path]) -> tuple[list[pathlib.Path], list[str]]:
  """Files holding decodable, non-blank text, and a warning naming the undecodable ones."""
  usable, undecodable = [], []
  for f in files:
    data = f.read_bytes()
    try:
      if data.decode('utf-8').strip():
        usable.append(f)
    except UnicodeDecodeError:
      undecodable.append(f)
  if not usable:
    raise ValueError(f'config.data.paths: none of its {len(files)} files holds UTF-8 text')
  if not undecodable:
    return usable, []
  names = ', '.join(str(f) for f in undecodable[:5]) + (' …' if len(undecodable) > 5 else '')
  return usable, [f'config.data.paths: skipping {len(undecodable)} file(s) that are not UTF-8 '
                  f'text: {names}']


def _fingerprint(paths: str, files, validation_fraction: float, fields=None,
                 renders=None) -> str:
  h = hashlib.sha256(repr(validation_fraction).encode())
  if fields:
    h.update(f'{fields.key()}\n'.encode())
  if fields and fields.kind in records.CHAT_KINDS and renders is not None:  # it decides the skips
    h.update(f'{renders.key}\n'.encode())
  for f in files:
    st = f.stat()
    h.update(f'{f}\0{st.st_size}\0{st.st_mtime_ns}\n'.encode())
  label = f'stdlib-py{sysconfig.get_python_version()}' if paths == STDLIB else 'files'
  return f'{label}-{h.hexdigest()[:12]}'


@contextlib.contextmanager
def _quiet_tfds():
  """TFDS logs a warning for every builder config it was not shipped with, which ours all are."""
  logger = logging.getLogger('absl')
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


_SCANNED = {}  # dataset name → its scan: the builder config and warnings (the name hashes the files)


def text_files_builder(data_config, warn: bool = True, renders=None) -> TextFiles:
  """The (maybe not yet prepared) builder for config.data.paths; reads files only to prepare,
  once a process (`check_source` reads them first, so bad records stop a run before it writes), and
  warns of what it skips unless `warn` is False. Chat records are rendered with `renders`
  (data/chat.py: Template), if given, and skipped where it refuses them."""
  root, files = find_files(data_config.paths)
  fields = records.fields_of(data_config, files)
  renders = renders if fields and fields.kind in records.CHAT_KINDS else None
  name = _fingerprint(data_config.paths, files, data_config.validation_fraction, fields, renders)
  with _quiet_tfds():
    builder = TextFiles(data_dir=data_dir(data_config), config=TextFilesConfig(name=name))
    if builder.is_prepared():
      return builder
    writable_dir(data_dir(data_config), 'config.data.data_dir')
    if name not in _SCANNED:
      _SCANNED[name] = _scan(root, files, fields, data_config.validation_fraction, name, renders)
    config, skipped = _SCANNED[name]
    for warning in skipped if warn else ():
      warnings.warn(warning, DataWarning, stacklevel=3)
    return TextFiles(data_dir=data_dir(data_config), config=config)


def _scan(root, files, fields, validation_fraction: float, name: str, renders=None):
  """Every document's split, read from the files, and warnings of what was skipped."""
  text_files = [f for f in files if not records.is_record_file(f)]
  scores, digests, longest, skipped = {}, {}, 0, []
  if len(text_files) < len(files):
    scores, digests, longest, skipped = _scan_records(
        root, [f for f in files if records.is_record_file(f)], fields, renders)
  if text_files:
    usable, undecodable = _usable(text_files)
    for f in usable:
      key = (str(f.relative_to(root)), 0)
      scores[key], digests[key] = split_score(key[0]), hashlib.sha256(f.read_bytes()).digest()
    longest, skipped = max(longest, max(f.stat().st_size for f in usable)), skipped + undecodable
  train, validation = split_documents(scores, validation_fraction)
  return TextFilesConfig(name=name, root=str(root), train=tuple(train),
                         validation=tuple(validation), fields=fields, longest=longest,
                         content=content_hash(digests, train, validation),
                         renders=renders), skipped


def content_hash(digests: dict, train, validation) -> str:
  """What a corpus holds, whatever its files' names, order or modification times: a hash of each
  split's documents (`digests`: each one's sha256), as a set. A resumed run is refused another
  (training/loop.py)."""
  h = hashlib.sha256()
  for split, keys in (('train', train), ('validation', validation)):
    h.update(f'{split}\n'.encode())
    for digest in sorted(digests[k] for k in keys):
      h.update(digest)
  return f'sha256:{h.hexdigest()[:16]}'


def _named_builder(data_config):
  name = data_config.name
  try:
    with _quiet_tfds():
      builder = tfds.builder(name, data_dir=data_dir(data_config))
  except Exception as e:  # TFDS raises several types for unknown or unreadable datasets
    reason = str(e).strip().splitlines()[0][:200]  # not TFDS's list of every dataset it knows
    raise ValueError(f'config.data.name={name!r}: no such TFDS dataset in '
                     f'config.data.data_dir={data_dir(data_config)!r} ({reason})') from None
  with _quiet_tfds():
    prepared = builder.is_prepared()
  if not prepared:
    raise ValueError(f'config.data.name={name!r} is not prepared in config.data.data_dir='
                     f'{data_dir(data_config)!r}; prepare it first: tfds build {name} '
                     f'--data_dir={data_dir(data_config)} --file_format=array_record')
  return builder


class QuietSource:
  """A TFDS data source that re-opens without TFDS's config warnings in grain's worker processes
  (which receive it pickled), and whose damaged records are a Fault naming the prepared files
  and the fix (`damaged`), not a Riegeli traceback."""

  def __init__(self, source, damaged: str):
    self.source, self.damaged = source, damaged

  def __len__(self):
    return len(self.source)

  def __getitem__(self, index):
    try:
      return self.source[index]
    except Exception as e:  # array_record's own errors: a truncated or corrupted file
      reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
      raise faults.Fault(f'{self.damaged} (record {index}: {reason})') from None

  def __reduce__(self):
    return _unpickle_quietly, (pickle.dumps(self.source), self.damaged)


def _unpickle_quietly(blob: bytes, damaged: str) -> QuietSource:
  with _quiet_tfds():
    return QuietSource(pickle.loads(blob), damaged)


@dataclasses.dataclass
class Corpus:
  """The two splits as random-access sources of dicts, and where the text is in each."""
  train: object
  validation: object
  text_key: str
  description: str
  max_document_bytes: int | None  # known for `paths` corpora
  name: str = ''  # the TFDS dataset's
  prepared_in: str = ''  # its directory of prepared files
  data_dir: str = ''  # config.data.data_dir, resolved (`data_dir`): its token ids are prepared there
  splits: tuple[str, str] = ('train', 'validation')  # the names of `train` and `validation`
  record: str = 'text'  # what a document's text holds (data/records.py: KINDS)


def check_source(data_config, renders=None) -> str:
  """The checks of `load` without preparing anything (the files exist and hold documents, the
  named dataset is prepared), for a run to fail before it creates anything; returns what the
  corpus holds: the content hash of config.data.paths' documents ('' for a dataset prepared
  before meshlm kept one), or a named dataset's name, version and sizes. A resumed run must read
  the same (runtime/checkpoint.py: TRAINED_ON)."""
  if data_config.name:
    builder = _named_builder(data_config)
    sizes = {split: builder.info.splits[split].num_examples for split in builder.info.splits}
    return f'{builder.info.full_name} {sorted(sizes.items())}'
  _check_validation_fraction(data_config.validation_fraction)
  builder = text_files_builder(data_config, warn=False, renders=renders)
  with _quiet_tfds():
    prepared = builder.is_prepared()
  if prepared:
    return (builder.info.metadata or {}).get('content', '')
  return builder.builder_config.content


def check_pairs(data_config, tokenizer, seq_len: int, template=None) -> None:
  """What packing keeps of each preference pair in a row of seq_len, judged on the pairs as
  tokenized, before anything is compiled or prepared: a pair left with nothing to learn from
  (data/packing.py: pair_problem) is passed over in training and evaluation, counted here in one
  warning; a training split left with no pair is one error. Nothing for other records, or for a
  named dataset."""
  if not data_config.preference or data_config.name:
    return
  root, files = find_files(data_config.paths)
  fields = records.fields_of(data_config, files)
  encode = chat.Encoder(tokenizer, fields.kind, template, data_config.train_on)
  renders = template if fields.kind in records.CHAT_KINDS else None
  # By (file, record number): why packing passes the pair over ('': it does not), its split score.
  problems, scores = {}, {}
  for f in files:
    good = [item for item in records.read(f, fields, renders)
            if not isinstance(item, records.Skipped)]
    relative = str(f.relative_to(root))
    for start in range(0, len(good), 256):
      chunk = good[start:start + 256]
      for (number, text), document in zip(chunk, encode([text.encode() for _, text in chunk])):
        problems[relative, number] = packing.pair_problem(document, seq_len)
        scores[relative, number] = split_score(text)
  passed = [key for key, problem in problems.items() if problem]
  if not passed:
    return
  # The split _scan makes of the same records.
  train, _ = split_documents(scores, data_config.validation_fraction)
  first = f'{root / passed[0][0]}:{passed[0][1]}: {problems[passed[0]]}'
  fix = 'raise config.seq_len, or shorten the prompts so that each answer keeps some of the row'
  lost = sum(bool(problems[key]) for key in train)
  if lost == len(train):
    raise ValueError(f'config.data.paths: none of its {len(train)} training pairs keeps anything '
                     f'to learn from in a row of config.seq_len={seq_len} (first: {first}); {fix}')
  warnings.warn(f'config.data.paths: skipping {len(passed)} of {len(problems)} preference pairs '
                f'that keep nothing to learn from in a row of config.seq_len={seq_len} ({lost} '
                f'of them training; first: {first}); {fix}', DataWarning, stacklevel=2)


def warn_about_length(corpus: 'Corpus', seq_len: int, positions: int) -> None:
  """DataWarning where config.seq_len is past the `positions` the model was trained for (0:
  unknown), or longer than every document."""
  if positions and seq_len > positions:
    warnings.warn(f'config.seq_len={seq_len} is past the {positions} positions the model was '
                  'trained for (config.model.max_position_embeddings, from config.init_from); '
                  f'its export will declare {seq_len}', DataWarning, stacklevel=2)
  longest = corpus.max_document_bytes
  if longest is not None and seq_len > longest + 1:
    warnings.warn(f'config.seq_len={seq_len} is longer than every document (the longest has '
                  f'{longest:,} bytes): each row packs several documents', DataWarning,
                  stacklevel=2)


def _check_validation_fraction(fraction: float) -> None:
  if not 0 < fraction < 1:
    raise ValueError(f'config.data.validation_fraction={fraction} must be in (0, 1)')


def _prepare(builder: TextFiles, data_config) -> None:
  """Prepares the corpus in config.data.data_dir: TFDS writes an incomplete-* directory and
  renames it when whole. Another process that finished first wins (its copy is the same); a disk
  that refuses the writes is a Fault naming the data dir."""
  tfds.disable_progress_bar()
  try:
    with _quiet_tfds():
      builder.download_and_prepare(file_format='array_record')
  except Exception as e:  # OSError, or array_record's RuntimeError of a refused write
    with _quiet_tfds():
      if isinstance(e, FileExistsError) and builder.is_prepared():
        return  # prepared by another run meanwhile
    fault = faults.on_disk(e, where=f'config.data.data_dir: preparing {builder.name} in '
                                    f'{data_dir(data_config)}')
    if fault is None:
      raise
    raise faults.Fault(f'{fault}; nothing was prepared, and the next run prepares it afresh'
                       ) from None


def load(data_config, renders=None) -> Corpus:
  """Open config.data's corpus, preparing it first if needed (chat records checked with
  `renders`: text_files_builder)."""
  if data_config.name:
    builder = _named_builder(data_config)
    splits = (data_config.train_split, data_config.eval_split)
    text_key = data_config.text_key
  else:
    builder = text_files_builder(data_config, renders=renders)
    with _quiet_tfds():
      prepared = builder.is_prepared()
    if not prepared:
      _prepare(builder, data_config)
    splits, text_key = ('train', 'validation'), 'text'
  for field, split in zip(('train_split', 'eval_split'), splits):
    if split not in builder.info.splits:
      raise ValueError(f'config.data.{field}={split!r} is not a split of {builder.name}; it has '
                       f'{sorted(builder.info.splits)}')
  if text_key not in builder.info.features:
    raise ValueError(f'config.data.text_key={text_key!r} is not a feature of {builder.name}; it '
                     f'has {sorted(builder.info.features)}')
  try:
    sources = builder.as_data_source()
  except Exception as e:
    raise ValueError(f'{builder.name} in {builder.data_dir} cannot be read at random ({e}); '
                     'prepare it with --file_format=array_record') from None
  fix = (f'prepare it again: move {builder.data_dir} away, and the next run prepares it afresh'
         if not data_config.name else
         f'prepare it again (tfds build {builder.name} --data_dir={data_dir(data_config)} '
         '--file_format=array_record --overwrite)')
  train, validation = (QuietSource(sources[split], f'config.data: the prepared {split} split of '
                                   f'{builder.name} in {builder.data_dir} is damaged; {fix}')
                       for split in splits)
  if not len(train) or not len(validation):
    raise ValueError(f'{builder.name}: the {splits} splits hold {len(train)} and '
                     f'{len(validation)} documents; both need at least one')
  for source in (train, validation):  # a truncated file fails at its end: before any compile
    source[len(source) - 1]
  metadata = builder.info.metadata or {}
  return Corpus(train=train, validation=validation, text_key=text_key,
                description=f'{builder.info.full_name} ({len(train):,} train / '
                            f'{len(validation):,} validation documents)',
                max_document_bytes=metadata.get('max_document_bytes'), name=builder.name,
                prepared_in=str(builder.data_dir), data_dir=data_dir(data_config),
                splits=tuple(splits),
                record=metadata.get('record', 'text'))
