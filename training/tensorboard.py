"""TensorBoard event files without TensorFlow: `tensorboard --logdir=WORKDIR` shows every logged
number as a scalar named by its metrics.jsonl key.

The format is small enough to write by hand. A file is a sequence of TFRecords,
  uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)   (little-endian)
each holding an `Event` protocol buffer (tensorflow/core/util/event.proto):
  Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
  Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
The first event names the format ('brain.Event:2').
"""

import os
import pathlib
import socket
import struct
import time


def _crc32c_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
    table.append(crc)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    low, n = n & 0x7F, n >> 7
    out.append(low | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:  # wire type 2: length-delimited
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
  """One serialised Event."""
  out = _varint(1 << 3 | 1) + struct.pack('<d', wall_time) + _varint(2 << 3) + _varint(step)
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    values = b''.join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) +
                     struct.pack('<f', value))
        for tag, value in scalars.items())
    out += _bytes_field(5, values)
  return out


def record(data: bytes) -> bytes:
  """`data` framed as a TFRecord."""
  length = struct.pack('<Q', len(data))
  return (length + struct.pack('<I', _masked(crc32c(length))) + data +
          struct.pack('<I', _masked(crc32c(data))))


class EventWriter:
  """Appends scalar events to a new events.out.tfevents.* file in `logdir`, flushed per write."""

  def __init__(self, logdir: pathlib.Path):
    name = f'events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}.meshlm'
    self.path = pathlib.Path(logdir) / name
    with self.path.open('ab') as f:
      f.write(record(event(time.time(), file_version='brain.Event:2')))

  def scalars(self, step: int, values: dict[str, float]) -> None:
    with self.path.open('ab') as f:
      f.write(record(event(time.time(), step, scalars=values)))
