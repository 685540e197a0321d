"""What our flash-attention kernels take of a GPU: launch grid, threads, shared memory, registers
and spills, from the GPU compiler itself (deviceless, planning/gpu_compiler.py: no GPU needed).

  python -m benchmarks.kernel_resources                         # H100; head dims 64, 128, 256
  python -m benchmarks.kernel_resources --sweep --head_dims=64,128   # how default_blocks was chosen

Each variant is one attention call, forward and backward (the fwd, dq and dkv kernels), compiled
for --target: causal, GQA --heads (32/8), B = 1, L = S = --seq_len, --dtype (bf16), with and without segment
ids (packed rows), with the tiles of kernels.flash_attention.default_blocks(head_dim) unless
--block_q/--block_k/--num_warps/--num_stages say otherwise. Grid, threads per block and shared
memory per block are XLA's launch of the kernel; registers per thread, spill stores and loads
(bytes per thread) are `ptxas -v` on the PTX XLA emitted. A variant the compiler rejects (too
much shared memory, say) is a row with the compiler's message, not the end of the table.

--sweep compiles every candidate tile per head dim (block_q 64/128 × block_k 32/64/128 ×
num_warps 4/8 × num_stages 1/2/3; causal, with segment ids, which use the most registers) and
picks, among those where no kernel spills, the largest block_q × block_k, then the larger
block_q, then the most stages that fit shared memory (deeper prefetch), then fewer warps (more
registers per thread, more rows per warp). That is the rule default_blocks follows.
"""

import itertools
import sys

import jax
from absl import flags

from benchmarks import report
from kernels.flash_attention import default_blocks
from planning import gpu_compiler, gpus
from runtime import cli

_TARGET = flags.DEFINE_string('target', 'H100', f'GPU to compile for: {sorted(gpus.GPUS)}.')
_HEAD_DIMS = flags.DEFINE_list('head_dims', ['64', '128', '256'], 'Head dims.')
_HEADS = flags.DEFINE_string('heads', '32/8', 'query/kv heads.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 4096, 'L = S.')
_BLOCK_Q = flags.DEFINE_integer('block_q', 0, 'Query tile (0: default_blocks).')
_BLOCK_K = flags.DEFINE_integer('block_k', 0, 'Key tile (0: default_blocks).')
_WARPS = flags.DEFINE_integer('num_warps', 0, 'Triton warps (0: default_blocks).')
_STAGES = flags.DEFINE_integer('num_stages', 0, 'Triton pipeline stages (0: default_blocks).')
_SWEEP = flags.DEFINE_bool('sweep', False, 'Compile every candidate tile and pick as documented.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')
_DTYPE = flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'],
                           "q, k and v's dtype (config.model.compute_dtype).")

def tiles_for(head_dim: int):
  default = default_blocks(head_dim, _DTYPE.value)
  return tuple(flag or d for flag, d in
               zip((_BLOCK_Q.value, _BLOCK_K.value, _WARPS.value, _STAGES.value), default))


def spills(result: dict) -> bool:
  return any(k['spill_stores'] or k['spill_loads'] for k in result['kernels'].values())


def choose(candidates: list[dict]) -> dict | None:
  """The module docstring's rule over candidates that compiled without spilling."""
  ok = [c for c in candidates if 'kernels' in c and not spills(c)]
  return max(ok, key=lambda c: (c['block_q'] * c['block_k'], c['block_q'], c['num_stages'],
                                -c['num_warps']), default=None)


def print_row(r: dict) -> None:
  head = (f'{r["head_dim"]:>4}{"yes" if r["segments"] else "no":>5} '
          f'{r["block_q"]:>4}×{r["block_k"]:<4}{r["num_warps"]:>3}{r["num_stages"]:>3}  ')
  if 'error' in r:
    print(f'{head}{"compile failed: " + r["error"]}', flush=True)
    return
  for i, name in enumerate(gpu_compiler.FLASH_KERNELS):
    k = r['kernels'].get(name)
    lead = head if i == 0 else ' ' * len(head)
    if k is None:
      print(f'{lead}{name[16:]:<4} not found in the compiled program')
      continue
    grid = '×'.join(map(str, k['grid']))
    print(f'{lead}{name[16:]:<4}{grid:>14}{k["threads"]:>8}{k["shared_memory"] / 1024:>9.1f}'
          f'{k["registers"]:>6}{k["spill_stores"]:>7}{k["spill_loads"]:>7}', flush=True)


def main(argv):
  del argv
  gpu_compiler.run_as_compiler_process(['-m', 'benchmarks.kernel_resources', *sys.argv[1:]])
  gpu = gpus.get(_TARGET.value)
  device, = gpu_compiler.devices(gpu, 1)
  head_dims = [int(h) for h in _HEAD_DIMS.value]
  print(f'compiled for {device.device_kind} (deviceless), heads {_HEADS.value}, '
        f'L = S = {_SEQ_LEN.value}, causal, {_DTYPE.value}')
  print(f'{"H":>4}{"seg":>5} {"tiles":<9}{"wp":>3}{"st":>3}  {"kern":<4}{"grid":>14}'
        f'{"threads":>8}{"smem KiB":>9}{"regs":>6}{"spillS":>7}{"spillL":>7}')
  results, chosen = [], {}
  for head_dim in head_dims:
    if _SWEEP.value:
      variants = [(True, tiles) for tiles in itertools.product((64, 128), (32, 64, 128), (4, 8),
                                                              (1, 2, 3))]
    else:
      variants = [(segments, tiles_for(head_dim)) for segments in (False, True)]
    rows = []
    for segments, tiles in variants:
      r = {'head_dim': head_dim, 'segments': segments,
           **dict(zip(('block_q', 'block_k', 'num_warps', 'num_stages'), tiles)),
           **gpu_compiler.flash_attention_kernels(
               device, head_dim, segments, tiles, tuple(map(int, _HEADS.value.split('/'))),
               _SEQ_LEN.value, _DTYPE.value)}
      print_row(r)
      rows.append(r)
    results += rows
    if _SWEEP.value and (best := choose(rows)):
      chosen[head_dim] = [best[k] for k in ('block_q', 'block_k', 'num_warps', 'num_stages')]
      print(f'head_dim {head_dim}: chosen block_q={best["block_q"]} block_k={best["block_k"]} '
            f'num_warps={best["num_warps"]} num_stages={best["num_stages"]}', flush=True)
  compiled = [r for r in results if 'kernels' in r]
  figures = {'benchmark': 'kernel_resources', 'compiled_for': device.device_kind,
             'deviceless': True, 'jax': jax.__version__, 'heads': _HEADS.value,
             'dtype': _DTYPE.value,
             'seq_len': _SEQ_LEN.value, 'results': results,
             'spilling_variants': sum(spills(r) for r in compiled),
             'failed_variants': len(results) - len(compiled),
             'command': report.command()}
  if _SWEEP.value:
    figures['chosen'] = chosen
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
