"""What a directory's disk reads and writes: `dd`'s direct I/O as the reference, beside the ways
an NVMe tier for optimizer state could move its bytes from Python (issue 52), each timed on the
same directory, as GB/s and as a fraction of dd's.

  python -m benchmarks.nvme --dir=/path/on/nvme --gib=4

Ways, each writing --gib in --block_mib blocks (random bytes, but dd's zeros), syncing them to the
disk, dropping them from the page cache (posix_fadvise DONTNEED, no root needed), then reading
them back (and checking that every random byte came back):
  dd          dd if=/dev/zero bs=BLOCK oflag=direct conv=fsync, then reads it back iflag=direct
  direct      os.pwrite/os.preadv with O_DIRECT from one page-aligned buffer (mmap), one thread
  buffered    numpy tofile/fromfile through the page cache (then fsync), one thread
  tensorstore a zarr3 array of --block_mib chunks on tensorstore's file kvstore (its own threads;
              orbax's storage layer)
  tier        the NVMe tier's own files (training/tiers.py: NvmeTier): the bytes as one
              parameter's shard, written a group of rows at a time through its memory map (then
              msync), its map closed, read back a group at a time as the update reads them (a
              group's range asked of the kernel whole, then its rows of the memory map put on the
              device)
  checkpoint  a checkpoint's pieces of the tier (runtime/pieces.py): the bytes as one piece of an
              array, saved a chunk of rows at a time into a zarr3 array with their checksum share,
              then restored a chunk at a time (checksummed) into an array in memory
Time: each way's median of --repeats rounds. A small --gib on a machine with much free memory
still measures the disk: every read starts from a dropped cache and every write ends in fsync.
Goal (issue 52): the tier's own reads and writes at ≥ 70% of dd's on the same directory.
"""

import gc
import mmap
import os
import pathlib
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np
from absl import flags, logging

from benchmarks import report
from reporting.metrics import print_table
from runtime import cli

_DIR = flags.DEFINE_string('dir', '', 'The directory measured (a temporary folder made inside '
                           'it, removed after); empty: the system temporary directory.')
_GIB = flags.DEFINE_float('gib', 2.0, 'Bytes written and read by each way, GiB.')
_BLOCK_MIB = flags.DEFINE_integer('block_mib', 64, 'One write or read, MiB (a multiple of 4 KiB).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Rounds of each way; the median is reported.')
_WAYS = flags.DEFINE_list('ways', ['dd', 'direct', 'buffered', 'tensorstore', 'tier',
                                   'checkpoint'],
                          'Ways measured.')
_OUT = flags.DEFINE_string('out', '', 'Also write the figures here as JSON.')


def evict(path: str) -> None:
  """Drops a synced file's pages from the page cache, so the next read comes from the disk, and
  checks that they went: the kernel keeps pages a live memory map holds (JAX's CPU arrays alias
  a map's rows, for one), and a read of those would time the cache."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  held = resident(path)
  if held > 0.01:
    raise RuntimeError(f'{path}: {held:.0%} of it is still in the page cache after it was dropped '
                       '(a memory map of it still alive?): its read would not measure the disk')


def resident(path: str) -> float:
  """The share of a file's pages in the page cache (mincore(2) over a map of it)."""
  import ctypes
  size = os.path.getsize(path)
  if not size:
    return 0.0
  with open(path, 'rb') as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
    view = np.frombuffer(mapped, np.uint8)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    if ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(view.ctypes.data),
                                                 ctypes.c_size_t(size), vector):
      raise OSError(ctypes.get_errno(), f'mincore({path})')
    held = np.frombuffer(vector, np.uint8) & 1
    del view
  return float(held.mean())


def evict_tree(folder: str) -> None:
  for root, _, files in os.walk(folder):
    for name in files:
      evict(os.path.join(root, name))


def timed(fn) -> tuple[float, object]:
  """(seconds fn() took, what it returned)."""
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def dd(data: np.ndarray, folder: str, block: int) -> tuple[float, float]:
  target, count = f'{folder}/dd.bin', data.nbytes // block
  write, _ = timed(lambda: subprocess.run(
      ['dd', 'if=/dev/zero', f'of={target}', f'bs={block}', f'count={count}', 'oflag=direct',
       'conv=fsync', 'status=none'], check=True))
  evict(target)
  read, _ = timed(lambda: subprocess.run(
      ['dd', f'if={target}', 'of=/dev/null', f'bs={block}', 'iflag=direct', 'status=none'],
      check=True))
  return write, read


def direct(data: np.ndarray, folder: str, block: int) -> tuple[float, float]:
  path, flat = f'{folder}/direct.bin', data.view(np.uint8)
  buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
  staged = np.frombuffer(buffer, np.uint8)

  def write():
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    try:
      for offset in range(0, flat.size, block):
        staged[:] = flat[offset:offset + block]
        os.pwrite(fd, buffer, offset)
      os.fsync(fd)
    finally:
      os.close(fd)

  back = np.empty_like(flat)

  def read():
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
      for offset in range(0, flat.size, block):
        os.preadv(fd, [buffer], offset)
        back[offset:offset + block] = staged
    finally:
      os.close(fd)
  write_s, _ = timed(write)
  evict(path)
  read_s, _ = timed(read)
  if not np.array_equal(back, flat):
    raise RuntimeError(f'{path}: the bytes read back differ from those written')
  return write_s, read_s


def buffered(data: np.ndarray, folder: str, block: int) -> tuple[float, float]:
  path = f'{folder}/buffered.bin'

  def write():
    with open(path, 'wb') as f:
      data.tofile(f)
      f.flush()
      os.fsync(f.fileno())
  seconds, _ = timed(write)
  evict(path)
  seconds_read, back = timed(lambda: np.fromfile(path, data.dtype))
  if not np.array_equal(back, data):
    raise RuntimeError(f'{path}: the bytes read back differ from those written')
  return seconds, seconds_read


def tensorstore(data: np.ndarray, folder: str, block: int) -> tuple[float, float]:
  import tensorstore as ts
  path = f'{folder}/tensorstore'
  spec = {'driver': 'zarr3', 'kvstore': {'driver': 'file', 'path': path},
          'metadata': {'shape': [data.size], 'data_type': 'uint32',
                       'chunk_grid': {'name': 'regular',
                                      'configuration': {'chunk_shape': [block // 4]}}}}
  shutil.rmtree(path, ignore_errors=True)
  array = ts.open(spec, create=True, delete_existing=True).result()
  # the write's time includes evict_tree's fsync (to the disk, as the others'), which also drops
  # the pages for the read
  seconds, _ = timed(lambda: (array.write(data).result(), evict_tree(path)))
  reopened = ts.open({'driver': 'zarr3', 'kvstore': {'driver': 'file', 'path': path}},
                     context=ts.Context({'cache_pool': {'total_bytes_limit': 0}})).result()
  seconds_read, back = timed(lambda: reopened.read().result())
  if not np.array_equal(back, data):
    raise RuntimeError(f'{path}: the bytes read back differ from those written')
  return seconds, seconds_read


def tier(data: np.ndarray, folder: str, block: int) -> tuple[float, float]:
  import jax
  from training import tiers
  rows = data.nbytes // block
  matrix = data.reshape(rows, block // data.itemsize)
  shard = tiers.Shard(leaf=0, index=(slice(None), slice(None)), devices=(jax.devices()[0],),
                      shape=matrix.shape, dtype=matrix.dtype)
  step = max(1, tiers.GROUP_BYTES // 3 // block)  # a group's rows of one kind of state
  parts = [tiers.Part(0, start, min(rows, start + step)) for start in range(0, rows, step)]
  store = tiers.NvmeTier([shard], pathlib.Path(folder) / 'tier', 'master')  # made at a run's start
  path = str(pathlib.Path(folder) / 'tier' / 'master-0000.bin')

  def write():
    for part in parts:
      store.write(part, matrix[part.start:part.stop])
    store.files[0].flush()
  seconds, _ = timed(write)
  store.close()  # its map dropped, or the page cache keeps the mapped pages
  store = None  # the last reference, so the map is collected
  gc.collect()
  evict(path)
  back = np.empty_like(matrix)
  device = jax.devices()[0]

  def read():  # as NvmeTier.read: a part's range asked for whole, its rows of the map put on
    fd = os.open(path, os.O_RDONLY)  # the device
    mapped = np.memmap(path, dtype=matrix.dtype, mode='r', shape=(1, *matrix.shape))
    try:
      for part in parts:
        tiers.will_need(fd, part.start * block, (part.stop - part.start) * block)
        back[part.start:part.stop] = np.asarray(
            jax.device_put(mapped[0, part.start:part.stop], device))
    finally:
      os.close(fd)
  seconds_read, _ = timed(read)
  if not np.array_equal(back, matrix):
    raise RuntimeError(f'{path}: the bytes read back differ from those written')
  return seconds, seconds_read


def checkpoint(data: np.ndarray, folder: str, block: int) -> tuple[float, float]:
  from runtime import pieces
  matrix = data.reshape(data.nbytes // block, block // data.itemsize)
  index = (slice(0, matrix.shape[0]), slice(0, matrix.shape[1]))
  path = pathlib.Path(folder) / 'checkpoint'
  shutil.rmtree(path, ignore_errors=True)
  seconds, _ = timed(lambda: (pieces.save(path / pieces.ITEM, {'x': pieces.Pieces(
      matrix.shape, matrix.dtype, ((index, lambda: matrix),))}), evict_tree(str(path))))
  back = np.empty_like(matrix)

  def put(start, rows):
    back[start:start + len(rows)] = rows
  sums = {}
  seconds_read, _ = timed(lambda: sums.update(pieces.restore(path, {'x': pieces.Pieces(
      matrix.shape, matrix.dtype, ((index, put),))})))
  if not np.array_equal(back, matrix) or sums != pieces.saved_checksums(path / pieces.ITEM):
    raise RuntimeError(f'{path}: the bytes or checksums read back differ from those written')
  return seconds, seconds_read


WAYS = {'dd': dd, 'direct': direct, 'buffered': buffered, 'tensorstore': tensorstore,
        'tier': tier, 'checkpoint': checkpoint}


def main(argv):
  del argv
  block = _BLOCK_MIB.value * 2**20
  nbytes = int(_GIB.value * 2**30) // block * block
  if nbytes == 0 or block % 4096:
    raise ValueError(f'--gib={_GIB.value} --block_mib={_BLOCK_MIB.value}: at least one block of '
                     f'a multiple of 4 KiB is needed')
  if unknown := set(_WAYS.value) - set(WAYS):
    raise ValueError(f'--ways: {sorted(unknown)} are not among {sorted(WAYS)}')
  parent = _DIR.value or tempfile.gettempdir()
  free = shutil.disk_usage(parent).free
  if free < 3 * nbytes:
    raise ValueError(f'--dir={parent}: {free / 2**30:.1f} GiB free, the benchmark needs '
                     f'{3 * nbytes / 2**30:.1f}; lower --gib')
  data = np.random.default_rng(0).integers(0, 2**32, nbytes // 4, dtype=np.uint32)
  folder = tempfile.mkdtemp(prefix='meshlm-nvme-', dir=parent)
  figures = {'benchmark': 'nvme', 'dir': parent, 'bytes': nbytes, 'block_bytes': block,
             'ways': {}, 'command': report.command()}
  try:
    for way in _WAYS.value:
      rounds = [WAYS[way](data, folder, block) for _ in range(_REPEATS.value)]
      write_s = statistics.median(w for w, _ in rounds)
      read_s = statistics.median(r for _, r in rounds)
      figures['ways'][way] = {'write_s': write_s, 'read_s': read_s,
                              'write_gb_per_s': nbytes / write_s / 1e9,
                              'read_gb_per_s': nbytes / read_s / 1e9}
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  ways = figures['ways']
  reference = ways.get('dd')
  rows = [('directory', parent), ('bytes a way', f'{nbytes / 2**30:.2f} GiB in '
                                                 f'{_BLOCK_MIB.value} MiB blocks')]
  for way, w in ways.items():
    if reference:
      w['write_of_dd'] = w['write_gb_per_s'] / reference['write_gb_per_s']
      w['read_of_dd'] = w['read_gb_per_s'] / reference['read_gb_per_s']
    rows.append((way, f'write {w["write_gb_per_s"]:6.2f} GB/s'
                      + (f' ({w["write_of_dd"]:.0%} of dd)' if reference else '')
                      + f'   read {w["read_gb_per_s"]:6.2f} GB/s'
                      + (f' ({w["read_of_dd"]:.0%} of dd)' if reference else '')))
  print_table(rows)
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main, log_level=logging.ERROR)
