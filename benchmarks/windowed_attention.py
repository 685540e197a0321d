"""What our kernels do of a sliding window's attention: the keys their loops visit, against the
keys the window lets its queries see, for Gemma 3's windows and tiles (configs/gemma3.py), in
Triton and in Mosaic GPU for Hopper.

  python -m benchmarks.windowed_attention --out=benchmarks/results/windowed_attention.json

Counted from the kernels' own loop bounds (kernels/flash_attention.py and
kernels/flash_attention_hopper.py: the forward's and dq's key blocks per query block, dk/dv's
query blocks per key block), with the tiles each takes for a window (windowed_blocks; Hopper's
wgmma tiles are at least 64); tests/test_kernels.py and tests/test_flash_attention_hopper.py
prove the loops skip the blocks outside those bounds. Every visited block is computed whole, masked entries too, so visited ÷ seen is the
windowed work's FLOPs against the window's exact work; the goal is at most
kernels.flash_attention.WINDOW_WASTE. Nothing is timed; no GPU is needed.
"""

import argparse
import importlib

import numpy as np

from benchmarks import report
from configs import gemma3

fa = importlib.import_module('kernels.flash_attention')  # the module: kernels names its function so
hopper = importlib.import_module('kernels.flash_attention_hopper')


def visited(length: int, window: int, head_dim: int) -> dict:
  """Keys a row's queries see within `window`, and the share more the kernels visit (forward and
  dq; dk and dv) with the tiles a window takes, and with those of causal attention."""
  bq_default, bk_default = fa.default_blocks(head_dim)[:2]
  bq, bk = fa.windowed_blocks(window, bq_default, bk_default)
  mine = _visited(length, window, bq, bk)
  causal_tiles = _visited(length, window, bq_default, bk_default)
  return {'window': window, 'head_dim': head_dim, 'block_q': bq, 'block_k': bk,
          **mine, 'causal_tiles': {'block_q': bq_default, 'block_k': bk_default, **causal_tiles},
          'hopper': visited_hopper(length, window, head_dim)}


def visited_hopper(length: int, window: int, head_dim: int) -> dict:
  """As `visited`, for the Hopper kernels: the forward's query blocks of 64 against key blocks
  of the windowed tile, the backward's blocks of 64 both ways (dq as the forward, dk/dv)."""
  bq, bk = fa.windowed_blocks(window, *fa.hopper_blocks(head_dim), smallest=64)
  seen = sum(min(i + 1, window) for i in range(length))

  def keys_visited(block_k):
    total = 0
    for i in range(length // bq):
      steps, full = hopper._key_blocks(i * bq, bq, block_k, length // block_k, True, 0)
      lower, _ = hopper._window_blocks(i * bq, bq, block_k, 0, window, full)
      total += bq * block_k * (int(steps) - int(lower))
    return total / seen
  dkv = 0
  for j in range(length // 64):
    first, end = hopper._query_blocks_seeing(j * 64, 64, length // 64, True, 0, window)
    dkv += 64 * 64 * (int(end) - int(first))
  return {'block_q': bq, 'block_k': bk, 'forward': keys_visited(bk), 'dq': keys_visited(64),
          'dkv': dkv / seen}


def _visited(length: int, window: int, bq: int, bk: int) -> dict:
  n_q, n_kv = length // bq, length // bk
  seen = sum(min(i + 1, window) for i in range(length))
  forward = 0
  for i in range(n_q):  # each query block's rows against its key blocks
    first_q, last_q = i * bq, (i + 1) * bq - 1
    lower = int(fa._first_kv_block(np.int32(first_q), np.int32(window), bk=bk, n_kv=n_kv))
    upper = int(fa._kv_blocks_to_visit(np.int32(last_q), causal=True, bk=bk, n_kv=n_kv))
    forward += bq * bk * (upper - lower)
  backward = 0
  for j in range(n_kv):  # each key block's keys against the query blocks that reach it
    first, end = fa._query_blocks_reaching(np.int32(j), np.int32(window), causal=True, offset=0,
                                           bq=bq, bk=bk, n_q=n_q)
    backward += bq * bk * (int(end) - int(first))
  return {'seen': seen, 'forward_dq': forward / seen, 'dkv': backward / seen}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='', help='also write the figures here (JSON)')
  args = parser.parse_args(argv)
  rows = {}
  for name, preset in gemma3.PRESETS.items():
    seq_len = gemma3.RUNS[name][1]
    rows[name] = {'seq_len': seq_len, **visited(seq_len, preset['sliding_window'],
                                                 preset['head_dim'])}
  print(f'{"preset":<8}{"seq_len":>8}{"window":>8}{"head_dim":>9}{"tiles":>10}'
        f'{"fwd, dq ÷ seen":>16}{"dk, dv ÷ seen":>15}{"causal tiles":>14}{"their fwd, dq":>15}'
        f'{"hopper":>10}{"fwd":>7}{"dq":>7}{"dk, dv":>8}')
  for name, r in rows.items():
    c, h = r['causal_tiles'], r['hopper']
    print(f'{name:<8}{r["seq_len"]:>8}{r["window"]:>8}{r["head_dim"]:>9}'
          f'{r["block_q"]:>5}×{r["block_k"]:<4}{r["forward_dq"]:>16.3f}{r["dkv"]:>15.3f}'
          f'{c["block_q"]:>9}×{c["block_k"]:<4}{c["forward_dq"]:>15.3f}'
          f'{h["block_q"]:>5}×{h["block_k"]:<4}{h["forward"]:>7.3f}{h["dq"]:>7.3f}{h["dkv"]:>8.3f}')
  report.emit({'benchmark': 'windowed_attention', 'presets': rows, 'goal': fa.WINDOW_WASTE,
               'command': report.command()}, args.out or None)


if __name__ == '__main__':
  main()
