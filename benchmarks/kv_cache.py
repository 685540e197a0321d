"""What each cache kind (model/kv_cache.py) keeps per token and what it costs a trained model:
the validation documents decoded against each kind of cache, their loss and bits per byte beside
the full cache's, and how many greedy tokens stay those of the full cache.

  python train.py --config=configs/default.py --config.workdir=/tmp/meshlm-default   # once
  python -m benchmarks.kv_cache --workdir=/tmp/meshlm-default
  python -m benchmarks.kv_cache --plan=8b --batch=8 --slots=32768   # one decode step, each kind,
                                                                    # compiled for an H100

Each row (--rows of seq_len tokens: the validation documents cut into consecutive windows, as
packing cuts them) goes through `Transformer.decode` in one call against an empty cache of the
kind: every position's query reads every earlier position's
keys and values from the cache as stored, so a quantized cache gives the loss that decoding with
it would (each next token's loss with the text before it in the cache), not the training
forward's. Bits per byte counts the bytes the targets stand for (training/evaluation.py).

Greedy agreement: --prompts rows' first --prompt_tokens tokens continued greedily for
--new_tokens with each kind; the share of new tokens equal to the full cache's, position by
position, and how many come before the first that differs (mean over prompts).

Bytes are per token and layer, from the kind's shapes (tests check them against the arrays
allocated), so they hold for any device. The quality figures are the model's on this machine's
CPU; a GPU computes the same arithmetic.

--plan=PRESET (of configs/llama.py) compiles one decode step (--batch rows, one new token each,
against a cache of --slots) for each kind, deviceless for --target (planning/gpu_compiler.py),
with bf16 weights: the compiled program's memory (arguments: weights and cache; temporaries) and
the time model's prediction of its step (planning/timing.py), never a measurement.
"""

import argparse
import importlib
import math
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import report
from configs import llama
from inference import generate as gen
from inference import sampling
from model import ModelConfig, Transformer, kv_cache
from planning import gpu_compiler, gpus, timing
from training import loop

LLAMA3_VOCAB = 128_256  # the presets leave vocab_size to the tokenizer


def windows(loaded, count: int, length: int) -> list[np.ndarray]:
  """Up to `count` rows of `length` tokens: the validation documents in order, each cut into
  consecutive windows (a document's first starts with its BOS), as packing cuts them."""
  _, docs = loop.load_data(loaded.run)
  out = []
  for i in range(len(docs.validation)):
    ids = np.asarray(docs.validation.get([i])[0])
    ids = ids[0] if ids.ndim == 2 else ids  # weighted documents: their ids
    out += [ids[s:s + length].astype(np.int32) for s in range(0, len(ids) - 1, length)]
    if len(out) >= count:
      break
  return out[:count]


def losses(model, rows: list[np.ndarray], kind: str, token_bytes: np.ndarray, pad_id: int):
  """(nats, tokens, bytes) of predicting each row's tokens after its first, decoded against a
  cache of `kind`."""
  L = max(map(len, rows))
  tokens = np.full((len(rows), L), pad_id, np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  valid = np.arange(L)[None, 1:] < np.array([len(r) for r in rows])[:, None]
  graphdef, state = nnx.split(model)

  @jax.jit
  def nll(state, tokens):
    m = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(L), tokens.shape)
    logits, _ = m.decode(tokens, positions, m.init_cache(*tokens.shape, kind))
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

  nats = np.asarray(nll(state, tokens), np.float64)
  targets = tokens[:, 1:]
  return (float((nats * valid).sum()), int(valid.sum()),
          float((token_bytes[targets] * valid).sum()))


def agreement(new: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
  """(share of positions equal, mean count of new tokens before the first that differs)."""
  same = new == reference
  before = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
  return float(same.mean()), float(before.mean())


class Served(NamedTuple):
  """A preset's model as served on one GPU of a kind, compiled for it deviceless."""
  cfg: ModelConfig
  gpu: gpus.GPU
  device: jax.Device
  graphdef: nnx.GraphDef
  abstract: nnx.State  # the weights, bf16, on `device`

  def on_device(self, tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(self.device)), tree)

  def decode_step(self, state, tokens, positions, cache):
    return nnx.merge(self.graphdef, state).decode(tokens, positions, cache)


def served(preset: str, target: str, module: str, **model) -> Served:
  """`preset` (of configs/llama.py, or FAMILY:NAME of configs/FAMILY.py, e.g. gemma3:4b; with
  `model`'s settings) with bf16 weights on one `target` GPU; this process becomes the GPU
  compiler's (running `module` again there) if it is not."""
  gpu_compiler.run_as_compiler_process(['-m', module, *sys.argv[1:]])
  family, _, name = preset.rpartition(':')
  config = (importlib.import_module(f'configs.{family}') if family else llama).get_config(name)
  config.model.vocab_size = config.model.vocab_size or LLAMA3_VOCAB
  config.model.param_dtype = 'bfloat16'  # served weights
  config.model.update(model)
  cfg = ModelConfig.from_config(config.model)
  gpu = gpus.get(target)
  device, = gpu_compiler.devices(gpu, 1)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  model = Served(cfg, gpu, device, graphdef, abstract)
  return model._replace(abstract=model.on_device(abstract))


def plan(preset: str, batch: int, slots: int, target: str, kinds=kv_cache.KINDS) -> dict:
  """Each kind's (of `kinds`) decode step compiled for `target` GPUs: memory and the time
  model's step."""
  model = served(preset, target, 'benchmarks.kv_cache')
  cfg, gpu, device, graphdef, abstract = model[:5]
  on_device, step = model.on_device, model.decode_step
  tokens = on_device(jax.ShapeDtypeStruct((batch, 1), jnp.int32))

  print(f'# {preset}: one decode step of {batch} rows against {slots:,} slots, compiled for '
        f'{device.device_kind} (deviceless); step: the time model\'s prediction')
  print(f'\n{"cache":8} {"cache GiB":>10} {"weights GiB":>12} {"temp GiB":>9} {"step ms":>8} '
        f'{"tokens/s":>9}')
  weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
  rows = {}
  for kind in kinds:
    cache = on_device(jax.eval_shape(
        lambda s, kind=kind: nnx.merge(graphdef, s).init_cache(batch, slots, kind), abstract))
    compiled = jax.jit(step, donate_argnums=3).lower(abstract, tokens, tokens, cache).compile()
    memory, predicted = compiled.memory_analysis(), timing.predict(compiled.as_text(), gpu)
    rows[kind] = {'cache_bytes': sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache)),
                  'weights_bytes': weights, 'temp_bytes': memory.temp_size_in_bytes,
                  'predicted_step_s': predicted.seconds,
                  'predicted_tokens_per_s': batch / predicted.seconds}
    r = rows[kind]
    print(f'{kind:8} {r["cache_bytes"] / 2**30:>10.2f} {weights / 2**30:>12.2f} '
          f'{r["temp_bytes"] / 2**30:>9.2f} {1e3 * predicted.seconds:>8.2f} '
          f'{r["predicted_tokens_per_s"]:>9,.0f}', flush=True)
  return {'benchmark': 'kv_cache_plan', 'preset': preset, 'batch': batch, 'slots': slots,
          'compiled_for': device.device_kind, 'deviceless': True, 'jax': jax.__version__,
          'kinds': rows, 'command': report.command()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', default='/tmp/meshlm-default')
  parser.add_argument('--rows', type=int, default=128)
  parser.add_argument('--prompts', type=int, default=16)
  parser.add_argument('--prompt_tokens', type=int, default=64)
  parser.add_argument('--new_tokens', type=int, default=64)
  parser.add_argument('--plan', default='', help='a preset of configs/llama.py (or FAMILY:NAME, '
                      'e.g. gemma3:4b): plan its decode '
                      'step per kind for --target instead')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--slots', type=int, default=32768)
  parser.add_argument('--target', default='H100')
  parser.add_argument('--kinds', default=','.join(kv_cache.KINDS),
                      help='with --plan: the cache kinds to plan, comma-separated')
  parser.add_argument('--out', default='', help='also write the figures here (JSON)')
  args = parser.parse_args(argv)
  if args.plan:
    return report.emit(plan(args.plan, args.batch, args.slots, args.target,
                            tuple(args.kinds.split(','))), args.out)
  loaded = sampling.load(args.workdir)
  cfg, tok = loaded.model.cfg, loaded.tokenizer
  rows = windows(loaded, args.rows, loaded.run.seq_len)
  prompts = [list(r[:args.prompt_tokens]) for r in rows[:args.prompts]]
  print(f'# {loaded.checkpoint}: {len(rows)} rows of validation text, {sum(map(len, rows)):,} '
        f'tokens; d_model {cfg.d_model}, {cfg.n_kv_heads} kv heads × {cfg.head_dim}, compute '
        f'{cfg.dtype.name}')
  results, reference = {}, None
  for kind in kv_cache.KINDS:
    nats, tokens, n_bytes = losses(loaded.model, rows, kind, tok.token_bytes(), tok.pad_id)
    new = gen.generate(loaded.model, prompts, args.new_tokens, cache=kind, pad_id=tok.pad_id,
                       vocab_size=tok.vocab_size)
    reference = new if reference is None else reference
    same, before = agreement(new, reference)
    results[kind] = {'bytes_per_token_layer': kv_cache.bytes_per_token(cfg, kind),
                     'loss': nats / tokens, 'bits_per_byte': nats / math.log(2) / n_bytes,
                     'greedy_same': same, 'greedy_tokens_before_change': before}
  full = results['full']
  print(f'\n{"cache":8} {"bytes/token/layer":>18} {"of full":>8} {"loss":>8} {"bits/byte":>10} '
        f'{"Δ bits/byte":>12} {"greedy same":>12} {"first change":>13}')
  for kind, r in results.items():
    r['bytes_of_full'] = r['bytes_per_token_layer'] / full['bytes_per_token_layer']
    r['bits_per_byte_change'] = r['bits_per_byte'] / full['bits_per_byte'] - 1
    print(f'{kind:8} {r["bytes_per_token_layer"]:>18,} {r["bytes_of_full"]:>8.3f} '
          f'{r["loss"]:>8.4f} {r["bits_per_byte"]:>10.4f} {100 * r["bits_per_byte_change"]:>+11.3f}% '
          f'{100 * r["greedy_same"]:>11.1f}% {r["greedy_tokens_before_change"]:>13.1f}')
  report.emit({'benchmark': 'kv_cache', 'checkpoint': loaded.checkpoint,
               'rows': len(rows), 'tokens': int(sum(map(len, rows))) - len(rows),
               'device': jax.devices()[0].device_kind, 'jax': jax.__version__,
               'kinds': results, 'command': report.command()}, args.out)


if __name__ == '__main__':
  main()
