"""Packing documents into fixed-length rows, one lane per batch row.

A document of n tokens `BOS t1 … EOS` gives n-1 (input, target) pairs. Lane j of a global batch of
B rows reads documents j, j+B, j+2B, … of the (shuffled, repeating) document sequence and lays
their pairs end to end, one row of seq_len pairs per step: a document longer than what is left of a
row continues at the start of the lane's next row, so nothing is dropped or padded in training (an
evaluation pass pads its lanes' last rows, with weight 0). Within a row, segment_ids number the
pieces from 1 (0 is padding) and positions count from the document's start, continuing across rows.

Because each lane is independent, a process builds only its own lanes, worker processes can split
them among themselves, and the global batch is the same for any number of processes or workers.
A lane's whole state is two integers: documents started, and pairs of the current one emitted.

A pair weighs 1, or, for a document that carries weights (`[2, n]`: ids, then the weight of
predicting each; data/chat.py), the weight of its target: a chat's prompt tokens weigh 0 wherever
packing cuts it.

A preference pair (data/chat.py: `BOS prompt chosen EOS` then `BOS prompt rejected EOS`, the
weights' second bit marking the rejected sequence) takes a row of its own (`pairs`): the chosen
sequence as segment 1, the rejected as segment 2, each positioned from 0, the rest padding. A pair
longer than the row loses the ends of its longer sequences (as other trainers' max_length cuts);
one left with no answer token on a side, or with its two sides the same, is passed over
(`pair_problem`).
"""

import dataclasses
from typing import Callable

import numpy as np

from data.chat import ids_and_weights

ROW_KEYS = ('inputs', 'targets', 'positions', 'segment_ids', 'weights')


@dataclasses.dataclass
class LaneState:
  docs_started: int = 0
  offset: int = 0  # pairs of the current document already emitted


class Lane:
  """Row after row of packed pairs for one batch row.

  `document(g)` returns the tokens (int32, BOS…EOS; `[n]`, or `[2, n]` with weights) of the g-th
  document of the sequence, or None past its end (a finite pass); this lane reads g = lane,
  lane + stride, lane + 2·stride, …
  """

  def __init__(self, document: Callable[[int], np.ndarray | None], lane: int, stride: int,
               seq_len: int, pad_id: int, state: LaneState | None = None, pairs: bool = False):
    self.document, self.lane, self.stride, self.pairs = document, lane, stride, pairs
    self.seq_len, self.pad_id = seq_len, pad_id
    self.state = dataclasses.replace(state) if state else LaneState()
    self._tokens = None  # the current document, re-read after a restore
    self.exhausted = False

  def _current(self) -> np.ndarray | None:
    """The document being emitted, moving on to the next when it is used up."""
    s = self.state
    while not self.exhausted:
      if s.docs_started and self._tokens is None:
        self._tokens = self.document((s.docs_started - 1) * self.stride + self.lane)
      if self._tokens is not None and s.offset < self._tokens.shape[-1] - 1:
        return self._tokens
      tokens = self.document(s.docs_started * self.stride + self.lane)
      if tokens is None:
        self.exhausted = True
        break
      s.docs_started, s.offset, self._tokens = s.docs_started + 1, 0, tokens
    return None

  def next_row(self) -> dict[str, np.ndarray]:
    L = self.seq_len
    row = {'inputs': np.full(L, self.pad_id, np.int32), 'targets': np.full(L, self.pad_id, np.int32),
           'positions': np.zeros(L, np.int32), 'segment_ids': np.zeros(L, np.int32),
           'weights': np.zeros(L, np.float32)}
    if self.pairs:
      return self._pair_row(row)
    filled, segment = 0, 0
    while filled < L and (document := self._current()) is not None:
      tokens, weights = ids_and_weights(document)
      start = self.state.offset
      n = min(L - filled, len(tokens) - 1 - start)
      end = filled + n
      segment += 1
      row['inputs'][filled:end] = tokens[start:start + n]
      row['targets'][filled:end] = tokens[start + 1:start + n + 1]
      row['positions'][filled:end] = np.arange(start, start + n, dtype=np.int32)
      row['segment_ids'][filled:end] = segment
      row['weights'][filled:end] = 1.0 if weights is None else weights[start + 1:start + n + 1]
      self.state.offset += n
      filled = end
    return row

  def _pair_row(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The lane's next preference pair laid out in `row` (module docstring), or padding past the
    end of a finite pass. A pair the row's length leaves nothing to learn from (pair_problem) is
    passed over: data/corpus.py: check_pairs counted those before the run started, and refused a
    corpus of nothing else, so a lane always finds one."""
    while (document := self._current()) is not None:
      self.state.offset = document.shape[-1] - 1  # used up: the next row takes the next pair
      if not _cut_problem(cut := _pair_cut(document, self.seq_len), self.seq_len):
        break
    if document is None:
      return row
    start = 0
    for segment, (ids, weights, n) in enumerate(cut, 1):
      end = start + n
      row['inputs'][start:end], row['targets'][start:end] = ids[:n], ids[1:n + 1]
      row['positions'][start:end] = np.arange(n, dtype=np.int32)
      row['segment_ids'][start:end] = segment
      row['weights'][start:end] = weights[1:n + 1]
      start = end
    return row


def _pair_cut(document: np.ndarray, seq_len: int):
  """[(ids, weights, pairs kept)] of a preference pair's chosen and rejected sequences in a row
  of seq_len: the longer gives way first, neither below half the row while the other needs it."""
  tokens, codes = document
  rejected = (codes >> 1).astype(bool)
  sequences = [(tokens[~rejected], codes[~rejected] & 1), (tokens[rejected], codes[rejected] & 1)]
  chosen_n, rejected_n = (len(ids) - 1 for ids, _ in sequences)
  chosen_n = min(chosen_n, max(seq_len // 2, seq_len - rejected_n))
  return [(ids, weights, min(n, len(ids) - 1))
          for (ids, weights), n in zip(sequences, (chosen_n, seq_len - chosen_n))]


def pair_problem(document: np.ndarray, seq_len: int) -> str:
  """Why a preference pair laid out in a row of seq_len teaches nothing ('' if it does): an
  answer of which no token is left to predict (the prompt fills its share of the row), or two
  answers the same in what is left."""
  return _cut_problem(_pair_cut(document, seq_len), seq_len)


def _cut_problem(cut, seq_len: int) -> str:
  """pair_problem of a pair already cut (_pair_cut's)."""
  (c_ids, c_w, c_n), (r_ids, r_w, r_n) = cut
  for name, weights, n in (('chosen', c_w, c_n), ('rejected', r_w, r_n)):
    if not weights[1:n + 1].any():
      return f'no token of its {name} answer within config.seq_len={seq_len}'
  if (c_n == r_n and np.array_equal(c_ids[:c_n + 1], r_ids[:r_n + 1])
      and np.array_equal(c_w[1:c_n + 1], r_w[1:r_n + 1])):
    return f'its two answers are the same within config.seq_len={seq_len}'
  return ''
