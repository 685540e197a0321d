"""Attention TFLOP/s, forward, backward and both, for pallas (ours), cudnn and xla.

  python -m benchmarks.attention --out=benchmarks/results/attention-h100.json     # on a GPU
  python -m benchmarks.attention --seq_lens=256 --head_dims=64 --tokens=512 --impls=pallas,xla  # CPU smoke run

FLOP convention (FlashAttention's): forward = 4·B·N·S²·H (two matmuls of 2·S²·H per head), halved
when causal; backward = 2.5 × forward (five matmuls to the forward's two); forward+backward =
3.5 × forward. N counts query heads, so GQA does the same FLOPs as MHA. B = --tokens / S, bf16.
Time: median of --iters calls of a jitted function after --warmup, each waited for; the forward
is `attention(q, k, v)`, forward+backward is the gradient of Σ out·ct with respect to q, k, v, and
backward is their difference. cuDNN needs an NVIDIA GPU; on CPU pallas runs in interpret mode and
its figures mean nothing for speed (the CPU run only proves the script works).
Targets (H100 SXM, bf16, head dim 128, causal, 8k; published figures): FlashAttention-3 ≈ 600
TFLOP/s forward; cuDNN ≈ 530 forward, 520 backward; Pallas Triton op ≈ 360 forward, 230
forward+backward. Goal: pallas forward+backward ≥ cuDNN's in the same run; the JSON holds the
ratio for every shape.
"""

import functools
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags

from benchmarks import report
from runtime import cli

from kernels import attention

_IMPLS = flags.DEFINE_list('impls', ['pallas', 'cudnn', 'xla'], 'Implementations.')
_SEQ_LENS = flags.DEFINE_list('seq_lens', ['1024', '2048', '4096', '8192', '16384'], 'S.')
_HEAD_DIMS = flags.DEFINE_list('head_dims', ['64', '128'], 'Head dims.')
_HEADS = flags.DEFINE_list('heads', ['32/32', '32/8'], 'query/kv heads (MHA, GQA).')
_CAUSAL = flags.DEFINE_list('causal', ['true', 'false'], 'Causal masks to run.')
_TOKENS = flags.DEFINE_integer('tokens', 16384, 'Batch × sequence length per call.')
_ITERS = flags.DEFINE_integer('iters', 10, 'Timed calls.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed calls after compiling.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def timed(fn, *args) -> float:
  for _ in range(_WARMUP.value):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_ITERS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(impl, S, H, N, K, causal) -> dict:
  B = max(1, _TOKENS.value // S)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, S, N, H), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, K, H), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, K, H), jnp.bfloat16)
  ct = jax.random.normal(keys[3], (B, S, N, H), jnp.bfloat16)
  call = functools.partial(attention, causal=causal, implementation=impl)
  forward = jax.jit(call)
  both = jax.jit(jax.grad(lambda q, k, v: (call(q, k, v).astype(jnp.float32) * ct).sum(),
                          (0, 1, 2)))
  flops = 4 * B * N * S * S * H / (2 if causal else 1)
  fwd_s, both_s = timed(forward, q, k, v), timed(both, q, k, v)
  bwd_s = max(both_s - fwd_s, 1e-9)
  return {'impl': impl, 'seq_len': S, 'head_dim': H, 'heads': N, 'kv_heads': K, 'causal': causal,
          'batch': B, 'fwd_ms': fwd_s * 1e3, 'bwd_ms': bwd_s * 1e3, 'fwd_bwd_ms': both_s * 1e3,
          'fwd_tflops': flops / fwd_s / 1e12, 'bwd_tflops': 2.5 * flops / bwd_s / 1e12,
          'fwd_bwd_tflops': 3.5 * flops / both_s / 1e12}


def main(argv):
  del argv
  device = jax.devices()[0]
  results = []
  shapes = itertools.product(map(int, _HEAD_DIMS.value), _HEADS.value, _CAUSAL.value,
                             map(int, _SEQ_LENS.value))
  print(f'{"impl":<7}{"H":>4}{"N/K":>7}{"causal":>7}{"S":>7}{"fwd":>9}{"bwd":>9}{"fwd+bwd":>9}'
        '   TFLOP/s')
  for H, heads, causal, S in shapes:
    N, K = map(int, heads.split('/'))
    causal = causal.lower() == 'true'
    for impl in _IMPLS.value:
      if impl == 'cudnn' and device.platform != 'gpu':
        continue
      try:
        r = measure(impl, S, H, N, K, causal)
      except Exception as e:  # one failing shape must not lose the rest of the table
        r = {'impl': impl, 'seq_len': S, 'head_dim': H, 'heads': N, 'kv_heads': K,
             'causal': causal, 'error': f'{type(e).__name__}: {str(e)[:300]}'}
        print(f'{impl:<7}{H:>4}{heads:>7}{causal!s:>7}{S:>7}  failed: {r["error"][:80]}')
      else:
        print(f'{impl:<7}{H:>4}{heads:>7}{causal!s:>7}{S:>7}{r["fwd_tflops"]:>9.4g}'
              f'{r["bwd_tflops"]:>9.4g}{r["fwd_bwd_tflops"]:>9.4g}', flush=True)
      results.append(r)

  ratios = []
  for r in results:
    if r['impl'] != 'pallas' or 'error' in r:
      continue
    match = [c for c in results if c['impl'] == 'cudnn' and 'error' not in c and all(
        c[f] == r[f] for f in ('seq_len', 'head_dim', 'heads', 'kv_heads', 'causal'))]
    if match:
      ratios.append({f: r[f] for f in ('seq_len', 'head_dim', 'heads', 'kv_heads', 'causal')} |
                    {'fwd_bwd_pallas_over_cudnn': r['fwd_bwd_tflops'] / match[0]['fwd_bwd_tflops'],
                     'fwd_pallas_over_cudnn': r['fwd_tflops'] / match[0]['fwd_tflops']})
  for x in ratios:
    print(f'pallas/cudnn H={x["head_dim"]} {x["heads"]}/{x["kv_heads"]} causal={x["causal"]} '
          f'S={x["seq_len"]}: fwd+bwd {x["fwd_bwd_pallas_over_cudnn"]:.2f}, '
          f'fwd {x["fwd_pallas_over_cudnn"]:.2f}')
  figures = {'benchmark': 'attention', 'device': device.device_kind, 'platform': device.platform,
             'jax': jax.__version__, 'dtype': 'bfloat16', 'tokens_per_call': _TOKENS.value,
             'results': results, 'pallas_over_cudnn': ratios,
             'command': report.command()}
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
