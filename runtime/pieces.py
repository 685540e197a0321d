"""Arrays a process never holds whole in a checkpoint (training/tiers.py's optimizer state off the
devices: a 70b's is 847 GB a node), saved and restored a piece at a time.

A checkpoint's `pieces` item holds each such array as a Zarr v3 array (tensorstore, on the local
file system: each process writes the chunks of its own pieces, no two processes the same), cut
into chunks of whole rows of a piece (at most CHUNK_BYTES; a piece is a device's shard of the
array), with `arrays.json` (each array's shape and dtype, process 0's) and `checksums-P.json`
(process P's share of each array's checksum, runtime/checkpoint.py's sum over the elements, which
the shares add up to). A state item saved beside it holds None where these arrays are, so an
all-device run's checkpoint and a tiered run's hold the same arrays by the same names, and either
restores onto the other: `read` opens an array from either item.

  checkpointer.save(step, state_with_nones, data, config, pieces={name: Pieces(...)})
"""

import asyncio
import dataclasses
import functools
import json
import pathlib
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint import future  # the commit futures orbax's own handlers return

CHUNK_BYTES = 256 << 20  # a chunk's file: large enough for disk rates, small enough to hold
ITEM = 'pieces'
MOD = 1 << 32  # checksums are sums modulo 2³²


@dataclasses.dataclass(frozen=True)
class Pieces:
  """An array's shape and dtype and this process's pieces of it, each (index, fn): index a tuple
  of slices of the array; saving, fn() gives the piece (a numpy array or memory map, read a chunk
  at a time as it is written); restoring, fn(start, rows) takes its rows [start, start + len).
  Each piece is saved by one process of the job; `replicas`, restored as `pieces` are, are pieces
  this process holds too but another saves (and counts in the checksum)."""
  shape: tuple
  dtype: Any
  pieces: tuple
  replicas: tuple = ()


def chunk_shape(piece_shape: tuple, dtype) -> tuple:
  """The chunks an array is stored in: whole rows of a piece, the most that divide its rows and
  fit CHUNK_BYTES (at least one row). Every process derives the same from the same sharding."""
  if not piece_shape:
    return ()
  rows, row = piece_shape[0], int(np.prod(piece_shape[1:])) * np.dtype(dtype).itemsize
  fit = max(1, CHUNK_BYTES // max(row, 1))
  return (max(d for d in range(1, min(rows, fit) + 1) if rows % d == 0), *piece_shape[1:])


def checksum_rows(data, index: tuple, shape: tuple, start: int = 0) -> int:
  """This piece's share of runtime/checkpoint.py's checksum of an array of `shape`: each element's
  word w times 2p + 1 (p its place in the whole array) summed mod 2³², for `data`, rows from
  `start` of the piece at `index` (a plain one). With p = (row) · stride_0 + (its place within a
  row), Σ w·p needs only each row's sum and each column's (two passes at numpy's summing speed)
  and the places within a row, which every chunk of a piece shares."""
  data = np.asarray(data)
  words = data.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[data.dtype.itemsize])
  if not shape:
    return int(words) % MOD
  matrix = words.reshape(len(words), -1)
  rows, columns = (matrix.sum(axis=a, dtype=np.uint64) for a in (1, 0))
  first = index[0].start + start
  row_places = np.arange(first, first + len(rows), dtype=np.uint64) % MOD
  weighted = (int(np.prod(shape[1:])) * int(np.sum((rows % MOD) * row_places, dtype=np.uint64))
              + int(np.sum((columns % MOD) * _within_row(
                  tuple((s.start, s.stop) for s in index[1:]), tuple(shape)), dtype=np.uint64)))
  return (2 * weighted + int(rows.sum(dtype=np.uint64))) % MOD  # sums mod 2⁶⁴: fine mod 2³²


@functools.lru_cache(maxsize=4)
def _within_row(spans: tuple, shape: tuple):
  """The places within a row of the whole array (mod 2³²) of a piece's row's elements, in order:
  the piece's columns `spans`, (start, stop) a dimension after the first."""
  places = np.zeros((), np.uint64)
  for d, (first, stop) in enumerate(spans, start=1):
    axis = np.arange(first, stop, dtype=np.uint64) * np.uint64(int(np.prod(shape[d + 1:])))
    places = np.add.outer(places, axis)
  return places.reshape(-1) % MOD


def _plain(index: tuple, shape: tuple) -> tuple:
  """`index` with every slice's start and stop given (a device's index leaves them None)."""
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _within(index: tuple, start: int, stop: int, shape: tuple) -> tuple:
  """Rows [start, stop) of the piece at `index` (a plain one), as an index of the array."""
  return (slice(index[0].start + start, index[0].start + stop), *index[1:]) if shape else ()


def _spec(path: pathlib.Path) -> dict:
  return {'driver': 'zarr3', 'kvstore': {'driver': 'file', 'path': str(path)}}


def _ts_dtype(dtype):
  return ts.dtype(np.dtype(dtype).name)


def _rows_of(shape: tuple, chunk: tuple):
  """(start, stop) of each chunk of a piece's rows."""
  if not shape:
    return [(0, 0)]
  return [(r, min(r + chunk[0], shape[0])) for r in range(0, shape[0], chunk[0])]


def save(directory: pathlib.Path, arrays: dict[str, Pieces]) -> None:
  """This process's pieces of `arrays` into a checkpoint's pieces item at `directory`, a chunk of
  rows at a time, with its checksum share of each."""
  directory.mkdir(parents=True, exist_ok=True)
  me, sums = jax.process_index(), {}
  if me == 0:
    (directory / 'arrays.json').write_text(json.dumps(
        {name: [list(a.shape), np.dtype(a.dtype).name] for name, a in arrays.items()}))
  for name, array in arrays.items():
    some = (array.pieces or array.replicas)[0][0]  # every process holds a piece of each array
    chunk = chunk_shape(tuple(s.stop - s.start for s in _plain(some, array.shape)), array.dtype)
    store = ts.open(_spec(directory / name), create=True, open=True, shape=array.shape,
                    dtype=_ts_dtype(array.dtype),
                    chunk_layout=ts.ChunkLayout(write_chunk_shape=chunk) if chunk else None
                    ).result()
    total, writing = 0, None
    for index, get in array.pieces:
      index, data = _plain(index, array.shape), get()
      for start, stop in _rows_of(data.shape, chunk):
        rows = np.array(data[start:stop] if data.shape else data)  # read off the tier once
        write = store[_within(index, start, stop, data.shape)].write(rows)
        total += checksum_rows(rows, index, array.shape, start)  # as tensorstore writes
        if writing is not None:
          writing.result()  # two chunks in memory at most
        writing = write
    if writing is not None:
      writing.result()
    sums[name] = total % MOD
  (directory / f'checksums-{me}.json').write_text(json.dumps(sums))


class PiecesHandler(ocp.AsyncCheckpointHandler):
  """orbax's handler of the `pieces` item: the write runs in orbax's commit thread, as the state
  item's does, after the step's directory exists; `read_out` is called when it has read every
  piece (or failed), after which their owner may change them."""

  async def async_save(self, directory, args: 'PiecesSave'):
    async def write():
      try:
        await asyncio.to_thread(save, pathlib.Path(directory), args.arrays)
      finally:
        args.read_out()
    return [future.CommitFutureAwaitingContractedSignals(write(), name='meshlm_pieces')]

  def save(self, directory, args: 'PiecesSave'):
    try:
      save(pathlib.Path(directory), args.arrays)
    finally:
      args.read_out()

  def restore(self, directory, args=None):
    return saved(pathlib.Path(directory))


@ocp.args.register_with_handler(PiecesHandler, for_save=True)
@dataclasses.dataclass
class PiecesSave(ocp.args.CheckpointArgs):
  arrays: dict
  read_out: Callable = lambda: None


@ocp.args.register_with_handler(PiecesHandler, for_restore=True)
@dataclasses.dataclass
class PiecesRestore(ocp.args.CheckpointArgs):
  pass


def saved(directory: pathlib.Path) -> dict[str, tuple]:
  """{name: (shape, dtype name)} of the pieces item at `directory`, {} where there is none."""
  path = directory / 'arrays.json'
  if not path.is_file():
    return {}
  return {name: (tuple(shape), dtype) for name, (shape, dtype) in json.loads(
      path.read_text()).items()}


def saved_checksums(directory: pathlib.Path) -> dict[str, int]:
  """Each array's checksum: the processes' shares added (every process that wrote one)."""
  total = {}
  for path in sorted(directory.glob('checksums-*.json')):
    for name, value in json.loads(path.read_text()).items():
      total[name] = (total.get(name, 0) + value) % MOD
  return total


def open_saved(step_directory: pathlib.Path, name: str):
  """The saved array `name` of a checkpoint, opened to read any part of it: from its pieces
  item, or from its state item (orbax's own arrays, an all-device run's)."""
  pieces = step_directory / ITEM
  if name in saved(pieces):
    return ts.open(_spec(pieces / name), open=True, read=True).result()
  context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
  error = None
  for zarr3 in (False, True):  # orbax writes Zarr v2 today; v3 where asked
    info = ocp.type_handlers.ParamInfo(name=name, parent_dir=step_directory / 'state',
                                       is_ocdbt_checkpoint=True, use_zarr3=zarr3,
                                       ts_context=context)
    try:
      return ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True), open=True,
                     read=True, context=context).result()
    except ValueError as e:
      error = e
  raise error


def restore(step_directory: pathlib.Path, arrays: dict[str, Pieces]) -> dict[str, int]:
  """Each array's pieces read from checkpoint `step_directory`, a chunk of rows at a time, into
  their fns; returns this process's checksum share of each."""
  sums = {}
  for name, array in arrays.items():
    store, total, chunks = open_saved(step_directory, name), 0, []
    for counted, pieces in ((True, array.pieces), (False, array.replicas)):
      for index, put in pieces:
        index = _plain(index, array.shape)
        shape = tuple(s.stop - s.start for s in index)
        chunks += [(index, put, start, stop, counted)
                   for start, stop in _rows_of(shape, chunk_shape(shape, array.dtype))]
    read = lambda k: store[_within(chunks[k][0], *chunks[k][2:4], array.shape)].read()
    reading = read(0) if chunks else None
    for k, (index, put, start, _, counted) in enumerate(chunks):
      rows = np.asarray(reading.result())
      if k + 1 < len(chunks):
        reading = read(k + 1)  # the next chunk's read in flight meanwhile
      if counted:
        total += checksum_rows(rows, index, array.shape, start)
      put(start, rows)
    sums[name] = total % MOD
  return sums


def fill(step_directory: pathlib.Path, name: str, abstract):
  """The saved array `name` as a global array in `abstract`'s sharding and dtype (an all-device
  run's, which its devices hold whole), each process reading its own shards."""
  store = open_saved(step_directory, name)
  return jax.make_array_from_callback(
      abstract.shape, abstract.sharding,
      lambda index: np.asarray(store[index].read().result()).astype(abstract.dtype))
