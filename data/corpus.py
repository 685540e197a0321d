"""Text corpora as TFDS datasets in array_record, read as random-access sources (no TensorFlow).

`config.data.paths` (files, directories or globs; `stdlib` = the Python standard library's .py
files) is prepared once by the `TextFiles` builder into `config.data.data_dir` and reused: the
dataset's name hashes the file list, sizes and mtimes, so a changed corpus is prepared afresh.
`config.data.name` instead names any TFDS dataset already prepared there (array_record format),
whose text lives under `config.data.text_key`.

The train/validation split is by a hash of each file's path relative to the corpus root, so it does
not depend on the order files are found in, and at least one file lands on each side.
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

from runtime.workdir import writable_dir
from runtime import faults

STDLIB = 'stdlib'


class DataWarning(UserWarning):
  """Input that is skipped, not fatal: undecodable files, documents shorter than a row."""


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


def split_files(root: pathlib.Path, files, validation_fraction: float):
  """(train, validation) paths relative to root, by a hash of the relative path."""
  _check_validation_fraction(validation_fraction)
  if len(files) < 2:
    raise ValueError(f'config.data.paths holds {len(files)} usable file(s); at least 2 are needed '
                     'for a train and a validation split')
  relative = [str(f.relative_to(root)) for f in files]
  scores = {r: int(hashlib.sha256(r.encode()).hexdigest()[:8], 16) / 2**32 for r in relative}
  validation = sorted(r for r in relative if scores[r] < validation_fraction)
  if not validation:  # a small corpus: hold out the lowest-scoring file
    validation = [min(relative, key=scores.get)]
  if len(validation) == len(relative):
    validation = validation[:-1]
  held = set(validation)
  return [r for r in relative if r not in held], validation


@dataclasses.dataclass(eq=False)
class TextFilesConfig(tfds.core.BuilderConfig):
  root: str = ''
  train: tuple[str, ...] = ()  # paths relative to root
  validation: tuple[str, ...] = ()


class TextFiles(tfds.core.GeneratorBasedBuilder):
  """One example per UTF-8 file: {'text', 'path'}; empty files and undecodable ones are skipped
  (the latter with a DataWarning) before preparation starts."""
  VERSION = tfds.core.Version('1.0.0')
  url_infos = None  # nothing to download (and TFDS's lookup of checksum files fails in packages)

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, description=f'Text files under {self.builder_config.root}',
        features=tfds.features.FeaturesDict({'text': tfds.features.Text(),
                                             'path': tfds.features.Text()}),
        metadata=tfds.core.MetadataDict())

  def _split_generators(self, dl_manager):
    del dl_manager
    cfg = self.builder_config
    root = pathlib.Path(cfg.root)
    self.info.metadata['max_document_bytes'] = max(
        (root / f).stat().st_size for f in cfg.train + cfg.validation)
    return {'train': self._generate_examples(cfg.train),
            'validation': self._generate_examples(cfg.validation)}

  def _generate_examples(self, files):
    root = pathlib.Path(self.builder_config.root)
    for relative in files:
      # A file changed since the scan raises here, and TFDS discards the incomplete dataset.
      yield relative, {'text': (root / relative).read_bytes().decode('utf-8'), 'path': relative}


def _usable(files: list[pathlib.Path]) -> list[pathlib.Path]:
  """Files holding decodable, non-blank text; undecodable ones are named in one warning."""
  usable, undecodable = [], []
  for f in files:
    data = f.read_bytes()
    try:
      if data.decode('utf-8').strip():
        usable.append(f)
    except UnicodeDecodeError:
      undecodable.append(f)
  if undecodable:
    names = ', '.join(str(f) for f in undecodable[:5]) + (' …' if len(undecodable) > 5 else '')
    warnings.warn(f'config.data.paths: skipping {len(undecodable)} file(s) that are not UTF-8 '
                  f'text: {names}', DataWarning, stacklevel=3)
  if not usable:
    raise ValueError(f'config.data.paths: none of its {len(files)} files holds UTF-8 text')
  return usable


def _fingerprint(paths: str, files, validation_fraction: float) -> str:
  h = hashlib.sha256(repr(validation_fraction).encode())
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


def text_files_builder(data_config) -> TextFiles:
  """The (maybe not yet prepared) builder for config.data.paths; reads files only to prepare."""
  root, files = find_files(data_config.paths)
  name = _fingerprint(data_config.paths, files, data_config.validation_fraction)
  with _quiet_tfds():
    builder = TextFiles(data_dir=data_dir(data_config), config=TextFilesConfig(name=name))
    if not builder.is_prepared():
      writable_dir(data_dir(data_config), 'config.data.data_dir')
      train, validation = split_files(root, _usable(files), data_config.validation_fraction)
      builder = TextFiles(data_dir=data_dir(data_config), config=TextFilesConfig(
          name=name, root=str(root), train=tuple(train), validation=tuple(validation)))
  return builder


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
  splits: tuple[str, str] = ('train', 'validation')  # the names of `train` and `validation`


def check(data_config) -> None:
  """The cheap checks of load (the files exist, the named dataset is prepared), without
  preparing or reading anything: for a run to fail before it creates anything."""
  if data_config.name:
    _named_builder(data_config)
  else:
    find_files(data_config.paths)
    _check_validation_fraction(data_config.validation_fraction)


def _check_validation_fraction(fraction: float) -> None:
  if not 0 < fraction < 1:
    raise ValueError(f'config.data.validation_fraction={fraction} must be in (0, 1)')


def load(data_config) -> Corpus:
  """Open config.data's corpus, preparing it first if needed."""
  if data_config.name:
    builder = _named_builder(data_config)
    splits = (data_config.train_split, data_config.eval_split)
    text_key = data_config.text_key
  else:
    builder = text_files_builder(data_config)
    with _quiet_tfds():
      prepared = builder.is_prepared()
    if not prepared:
      tfds.disable_progress_bar()
      builder.download_and_prepare(file_format='array_record')
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
  max_bytes = builder.info.metadata.get('max_document_bytes') if builder.info.metadata else None
  return Corpus(train=train, validation=validation, text_key=text_key,
                description=f'{builder.info.full_name} ({len(train):,} train / '
                            f'{len(validation):,} validation documents)',
                max_document_bytes=max_bytes, name=builder.name,
                prepared_in=str(builder.data_dir), splits=tuple(splits))
