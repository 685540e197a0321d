"""What Pallas' Mosaic GPU backend reaches for attention on this jax, on the GPU at hand: JAX's own
Hopper kernel (jax.experimental.pallas.ops.gpu.attention_mgpu: warpgroup matmuls, TMA loads, a
producer warpgroup feeding two compute warpgroups) beside cuDNN, at benchmarks/calibrate.py's
attention shapes (GQA 32/8, --tokens a call). The ceiling our own Mosaic GPU kernel (issue 51)
starts from, measured before it is written: where JAX's kernel is slower than cuDNN, tiles and
scheduling are what a kernel of ours would have to add; where it cannot run (its backward has no
causal mask; it takes float16, not bfloat16), the row says so with the error.

  python -m benchmarks.mosaic_attention --out=benchmarks/results/mosaic_attention-h100.json  # GPU

Rows: per head dim and keys, causal forward; non-causal forward and forward+backward; each
kernel's TFLOP/s as FlashAttention counts them (forward 4·B·N·L·S·H, halved when causal;
backward 2.5 × forward), float16 for both, and the largest difference between the two outputs.
Time: --iters calls back to back, waited for once, the median of three rounds (as calibrate's). Needs a Hopper GPU.
"""

import functools
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import inputs, report

_HEAD_DIMS = flags.DEFINE_list('head_dims', ['64', '128'], 'Head dims.')
_SEQ_LENS = flags.DEFINE_list('seq_lens', ['2048', '4096', '8192'], 'Keys (= queries) a row.')
_HEADS = flags.DEFINE_string('heads', '32/8', 'Query/kv heads.')
_TOKENS = flags.DEFINE_integer('tokens', 16384, 'Batch × length of a call.')
_BLOCKS = flags.DEFINE_list('blocks', ['64x128', '64x64'],
                            "JAX's kernel's forward tiles tried, block_q x block_kv (the fastest "
                            'reported); the backward takes 64x128 for dq and dk/dv.')
_ITERS = flags.DEFINE_integer('iters', 20, 'Calls a round.')
_BUDGET = flags.DEFINE_float('budget_s', 240, 'No new shape after this long.')
_OUT = flags.DEFINE_string('out', None, 'JSON file for the figures.')


def tried(fn, *args) -> dict:
  """{'s': seconds a call, as benchmarks/calibrate.py times them} or {'error': the first line of
  why it did not run}."""
  try:
    return {'s': inputs.back_to_back_s(jax.jit(fn).lower(*args).compile(), args, _ITERS.value)}
  except Exception as e:  # a refusal is a result
    return {'error': f'{type(e).__name__}: {(str(e).strip().splitlines() or [""])[0][:300]}'}


def cudnn(causal):
  # scale 1: JAX's Mosaic kernel does not scale the scores by 1/√H, so cuDNN does not either
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=1.0,
                                                      implementation='cudnn')


def mosaic(causal, block_q, block_kv):
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(
      block_q=block_q, block_kv=block_kv, max_concurrent_steps=2, causal=causal,
      block_q_dq=64, block_kv_dq=128, block_q_dkv=64, block_kv_dkv=128)
  return functools.partial(attention_mgpu.attention, config=config)


def with_backward(call, ct):
  return jax.grad(lambda q, k, v: (call(q, k, v).astype(jnp.float32) * ct).sum(), (0, 1, 2))


def rows():
  started = time.perf_counter()
  N, K = map(int, _HEADS.value.split('/'))
  blocks = [tuple(map(int, b.split('x'))) for b in _BLOCKS.value]
  for H in map(int, _HEAD_DIMS.value):
    for S in map(int, _SEQ_LENS.value):
      if time.perf_counter() - started > _BUDGET.value:
        yield {'what': f'H={H} S={S}', 'skipped': f'past --budget_s={_BUDGET.value:g}'}
        continue
      B = max(1, _TOKENS.value // S)
      keys = jax.random.split(jax.random.key(0), 4)
      q = jax.random.normal(keys[0], (B, S, N, H), jnp.float16)
      k, v = (jax.random.normal(key, (B, S, K, H), jnp.float16) for key in keys[1:3])
      ct = jax.random.normal(keys[3], (B, S, N, H), jnp.float16)
      for causal in (True, False):
        forward_flops = 4 * B * N * S * S * H / (2 if causal else 1)
        row = {'what': f'H={H} S={S} {"causal" if causal else "full"}', 'head_dim': H,
               'seq_len': S, 'batch': B, 'causal': causal}
        row['cudnn'] = tried(cudnn(causal), q, k, v)
        best = None
        for block_q, block_kv in blocks:
          timed = tried(mosaic(causal, block_q, block_kv), q, k, v)
          row[f'mosaic {block_q}x{block_kv}'] = timed
          if 's' in timed and (best is None or timed['s'] < row[best]['s']):
            best = f'mosaic {block_q}x{block_kv}'
        row['mosaic'] = best
        if best and 's' in row['cudnn']:
          out = jax.jit(mosaic(causal, *map(int, best.split()[1].split('x'))))(q, k, v)
          row['max_difference'] = float(jnp.abs(
              out.astype(jnp.float32) - jax.jit(cudnn(causal))(q, k, v).astype(jnp.float32)).max())
        row['cudnn fwd_bwd'] = tried(with_backward(cudnn(causal), ct), q, k, v)
        row['mosaic fwd_bwd'] = tried(with_backward(mosaic(causal, *blocks[0]), ct), q, k, v)
        for name in ('cudnn', best or ''):
          if name and 's' in row[name]:
            row[f'{name.split()[0]} fwd_tflops'] = forward_flops / row[name]['s'] / 1e12
        for name in ('cudnn', 'mosaic'):
          both = row[f'{name} fwd_bwd']
          fwd = row[f'mosaic {blocks[0][0]}x{blocks[0][1]}' if name == 'mosaic' else name]
          if 's' in both and 's' in fwd:
            row[f'{name} bwd_tflops'] = 2.5 * forward_flops / max(both['s'] - fwd['s'], 1e-9) / 1e12
        yield row


def main(argv):
  del argv
  device = jax.devices()[0]
  print(f'{device.device_kind}, jax {jax.__version__}: JAX\'s Mosaic GPU attention against cuDNN, '
        'float16, TFLOP/s (forward / backward)')
  print(f'{"shape":28s} {"cuDNN":>17s} {"Mosaic GPU (JAX)":>17s}  ratio   tiles')
  found = []
  for row in rows():
    found.append(row)
    if 'skipped' in row:
      print(f'{row["what"]:28s} skipped')
      continue

    def pair(name):
      f, b = row.get(f'{name} fwd_tflops'), row.get(f'{name} bwd_tflops')
      return f'{f or 0:7.1f} / {b or 0:7.1f}' if f else 'error'.rjust(17)
    ratio = (row['mosaic fwd_tflops'] / row['cudnn fwd_tflops']
             if 'mosaic fwd_tflops' in row and 'cudnn fwd_tflops' in row else float('nan'))
    print(f'{row["what"]:28s} {pair("cudnn"):>17s} {pair("mosaic"):>17s}  {ratio:5.2f}   '
          f'{row["mosaic"] or "-"}')
    for key, value in row.items():
      if isinstance(value, dict) and 'error' in value:
        print(f'    {key}: {value["error"]}')
  report.emit({'benchmark': 'mosaic_attention', 'device': device.device_kind,
               'jax': jax.__version__, 'command': report.command(), 'rows': found}, _OUT.value)


if __name__ == '__main__':
  app.run(main)
