"""The grain pipeline: documents (data/tokens.py) in a seeded global shuffle → pack → batch → one
global jax.Array per key, of which this process builds only its own rows.

  docs = documents(source, seed)        # g → source[shuffle(seed + epoch)[g]]: g ≥ len, next epoch
  PackedRows(docs, lanes=this process's rows)      # data/packing.py; a lane asks for its next
    [.mp_prefetch(workers) .batch(workers, concatenate)]    # LOOKAHEAD documents at once
  → Batches: numpy rows → jax.make_array_from_callback(batch sharding)

grain's ShuffleMapDataset reshuffles every epoch (seed + epoch) when indexed past its length, so
the training sequence of documents is endless and never repeats an order. The order of batches
depends only on the seed: each lane reads a fixed subsequence of documents, so neither the number
of processes nor of workers changes what a global row holds.
"""

import dataclasses
import signal

from absl import flags
import grain
import jax
from jax.experimental import multihost_utils
import numpy as np

from data.packing import ROW_KEYS, Lane, LaneState

LOOKAHEAD = 16  # documents a lane reads (or tokenizes, on the fly) at once


class DocumentSequence:
  """The g-th document packing reads: source document order[g] (`get(gs)` → token arrays), where
  order shuffles the source's indices per epoch with `seed` (training), or keeps them in stored
  order without one (evaluation)."""

  def __init__(self, source, seed: int | None):
    self.source = source
    order = grain.MapDataset.range(len(source))
    self.order = order.shuffle(seed=seed) if seed is not None else order

  def __len__(self):
    return len(self.source)

  def get(self, gs) -> list[np.ndarray]:
    return self.source.get([self.order[g] for g in gs])


def documents(source, seed: int | None) -> DocumentSequence:
  return DocumentSequence(source, seed)


class PackedRows(grain.IterDataset):
  """One element per step: this process's rows (or a worker's block of them) as [rows, L] arrays,
  plus each lane's state after the row, so the consumer can checkpoint exactly what it used."""

  def __init__(self, docs: DocumentSequence, *, lanes, batch_size: int, seq_len: int,
               pad_id: int, epochs: int | None, states=None, pairs: bool = False):
    super().__init__([])
    self.docs, self.lanes, self.batch_size, self.pairs = docs, list(lanes), batch_size, pairs
    self.seq_len, self.pad_id, self.epochs = seq_len, pad_id, epochs
    self.states = list(states) if states is not None else [LaneState() for _ in self.lanes]

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    """grain calls this in worker i of n with slice(i, None, n): take the i-th block of lanes, so
    concatenating the workers' blocks in order rebuilds the rows in order."""
    del sequential_slice
    i, n = sl.start or 0, sl.step or 1
    block = len(self.lanes) // n
    self.lanes = self.lanes[i * block:(i + 1) * block]
    self.states = self.states[i * block:(i + 1) * block]

  def __iter__(self):
    return _PackedRowsIterator(self)


class _PackedRowsIterator(grain.DatasetIterator):

  def __init__(self, ds: PackedRows):
    super().__init__()
    limit = None if ds.epochs is None else ds.epochs * len(ds.docs)
    stride = ds.batch_size

    def reader():
      """A lane's documents, LOOKAHEAD of its next ones read at a time."""
      ahead = {}

      def document(g):
        if limit is not None and g >= limit:
          return None
        if g not in ahead:
          gs = [h for h in range(g, g + LOOKAHEAD * stride, stride) if limit is None or h < limit]
          ahead.clear()
          ahead.update(zip(gs, ds.docs.get(gs)))
        return ahead[g]
      return document

    self._lanes = [Lane(reader(), lane, stride, ds.seq_len, ds.pad_id, state, ds.pairs)
                   for lane, state in zip(ds.lanes, ds.states)]

  def __next__(self):
    rows = [lane.next_row() for lane in self._lanes]
    element = {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}
    element['docs_started'] = np.array([l.state.docs_started for l in self._lanes], np.int64)
    element['offset'] = np.array([l.state.offset for l in self._lanes], np.int64)
    return element

  def get_state(self):
    return {'lanes': [dataclasses.asdict(l.state) for l in self._lanes]}

  def set_state(self, state):
    for lane, s in zip(self._lanes, state['lanes']):
      lane.state, lane._tokens, lane.exhausted = LaneState(**s), None, False


def _concatenate(pieces):
  return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


def process_rows(batch_sharding, batch_size: int, seq_len: int, devices=None) -> list[int]:
  """The global rows that `devices` (default: this process's) hold a part of."""
  devices = batch_sharding.addressable_devices if devices is None else set(devices)
  rows = set()
  for device, index in batch_sharding.devices_indices_map((batch_size, seq_len)).items():
    if device in devices:
      rows.update(range(*index[0].indices(batch_size)))
  return sorted(rows)


def check_workers(workers: int, n_rows: int) -> None:
  if workers < 0 or (workers and n_rows % workers):
    raise ValueError(f'config.data.workers={workers} must be 0 or divide the {n_rows} rows of '
                     'the batch this process builds')


class Batches:
  """This process's share of the global batches, as global jax.Arrays (or numpy with `local`).

  `state()` is a small JSON-able dict; `Batches(..., state=saved)` continues exactly after the
  last batch handed out before it was taken, whatever was prefetched.
  """

  def __init__(self, docs: DocumentSequence, *, batch_sharding, batch_size: int, seq_len: int,
               pad_id: int, workers: int = 0, prefetch: int = 2, epochs: int | None = None,
               state: dict | None = None, rows=None, pairs: bool = False):
    """`pairs`: the documents are preference pairs (data/packing.py), one a row."""
    self.sharding, self.shape = batch_sharding, (batch_size, seq_len)
    self.rows = process_rows(batch_sharding, batch_size, seq_len) if rows is None else list(rows)
    check_workers(workers, len(self.rows))
    self._states = [LaneState() for _ in self.rows]
    if state is not None:
      saved = dict(zip(state.get('rows', []), state.get('lanes', [])))
      if state.get('batch_size', batch_size) != batch_size or not set(self.rows) <= set(saved):
        raise ValueError(f'the saved data state is for batch rows {state.get("rows")} but this '
                         f'process builds rows {self.rows} of {batch_size}; keep '
                         'config.batch_size of the run that saved it')
      self._states = [LaneState(**saved[r]) for r in self.rows]
    ds = PackedRows(docs, lanes=self.rows, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id,
                    epochs=epochs, states=self._states, pairs=pairs)
    if workers:
      if not flags.FLAGS.is_parsed():  # grain's workers read absl flags (a notebook parses none)
        flags.FLAGS(['meshlm'], known_only=True)
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers,
                                                       per_worker_buffer_size=prefetch),
                          worker_init_fn=_ignore_interrupts)
      ds = ds.batch(workers, batch_fn=_concatenate)
    self._iterator = iter(ds)
    self._position = {r: i for i, r in enumerate(self.rows)}

  def next_local(self) -> dict[str, np.ndarray]:
    element = next(self._iterator)
    started, offset = element.pop('docs_started'), element.pop('offset')
    self._states = [LaneState(int(d), int(o)) for d, o in zip(started, offset)]
    return element

  def state(self) -> dict:
    """Every global row's lane state, gathered from all processes (a collective: every process
    calls it at the same step), so a checkpoint resumes under any number of processes."""
    table = np.full((self.shape[0], 2), -1, np.int32)  # rows this process does not build: -1
    for row, s in zip(self.rows, self._states):
      table[row] = s.docs_started, s.offset
    if jax.process_count() > 1:  # a row held by several processes has one state: max is it
      table = np.asarray(multihost_utils.process_allgather(table)).max(axis=0)
    return {'batch_size': self.shape[0], 'rows': [int(r) for r in np.flatnonzero(table[:, 0] >= 0)],
            'lanes': [dataclasses.asdict(LaneState(int(d), int(o))) for d, o in table if d >= 0]}

  def to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    def arrays(x):
      def shard(index):
        rows = range(*index[0].indices(self.shape[0]))
        first = self._position[rows.start]
        return x[first:first + len(rows), index[1]]  # a process's rows are contiguous
      return jax.make_array_from_callback(self.shape, self.sharding, shard)
    return {k: arrays(v) for k, v in local.items()}

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, jax.Array]:
    return self.to_global(self.next_local())

  def close(self):
    """Stops grain's worker processes. Dropping the iterator here, rather than at interpreter
    exit, also lets grain's own finalisers run while the modules they need still exist."""
    close = getattr(self._iterator, 'close', None)
    if close:
      close()
    self._iterator = None


def _ignore_interrupts(worker_index: int, worker_count: int) -> None:
  """Ctrl-C reaches every process of the terminal's group; the training process decides how
  to stop (runtime/preemption.py) and closes its workers itself."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def pass_length(docs: DocumentSequence, batch_size: int, seq_len: int,
                pairs: bool = False) -> int:
  """Batches that one pass over `docs` (unshuffled, as evaluation reads them) takes."""
  if pairs:  # one a row
    return -(-len(docs) // batch_size)
  lengths = np.zeros(batch_size, np.int64)
  for start in range(0, len(docs), batch_size * LOOKAHEAD):
    gs = range(start, min(start + batch_size * LOOKAHEAD, len(docs)))
    for g, tokens in zip(gs, docs.get(gs)):
      lengths[g % batch_size] += tokens.shape[-1] - 1
  return int(-(-lengths.max() // seq_len))


def train_batches(train_documents, data_config, batch_sharding, *, seed: int, batch_size: int,
                  seq_len: int, pad_id: int, state=None) -> Batches:
  """The endless, per-epoch reshuffled training batches of the training split's documents
  (data/tokens.py), as config.data (`data_config`: its workers, prefetch and records) reads
  them."""
  return Batches(documents(train_documents, seed=seed), batch_sharding=batch_sharding,
                 batch_size=batch_size, seq_len=seq_len, pad_id=pad_id,
                 workers=data_config.workers, prefetch=data_config.prefetch, state=state,
                 pairs=data_config.preference)

