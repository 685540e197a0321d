"""What a run's draft heads (model/draft.py) buy when sampling: how many tokens each forward of the
base model commits, how often each head's guess is kept, and whether greedy speculation gave
plain greedy decoding's tokens.

  python train.py --config=configs/default.py --config.workdir=/tmp/meshlm-draft \
      --config.model.draft_heads=3                                   # once
  python -m benchmarks.speculative --workdir=/tmp/meshlm-draft
  python -m benchmarks.speculative --plan=8b --heads=3 --batch=8 --slots=8192   # an H100's round

--prompts rows of the validation text (their first --prompt_tokens tokens) are continued for
--new_tokens, plainly and speculatively: greedy, then at each --temperatures (top_k 0). Tokens
per forward: the new tokens the rounds committed over the rounds (the prompt's forward, which
gives the first new token either way, not counted). Greedy, head by head: its top-1 accuracy as
training counts it (against the base's greedy token) at every position of the text speculation
wrote; how often its guess was kept when the heads before it had been (kept when tried); and
in how many rounds (kept a round). A round starts where the last one's guesses failed, so its
positions are harder than the average one: kept a round falls below top-1 on the text, and
tests/test_speculate.py replays the rounds from the training's counts exactly. The wall times
are this machine's, CPU, measured after a warm-up call; they say nothing of a GPU's.

--plan=PRESET (of configs/llama.py, bf16 weights, --heads Clover heads) compiles for --target,
deviceless (planning/gpu_compiler.py), one plain decode step (one token a row) and one round of
speculation (the heads' K guesses, the base's forward over K + 1 tokens, the acceptance) for
--batch rows against --slots: their memory and the time model's predictions (planning/timing.py),
never a measurement. A round is worth its time where the heads commit more tokens a round than
its time over the plain step's (the break-even printed).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import report
from benchmarks.kv_cache import agreement, served, windows
from inference import generate as gen
from inference import sampling
from inference import speculate as spec
from planning import timing


def timed(fn):
  """(fn()'s result, seconds of a second call: the first compiles)."""
  fn()
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def measure(loaded, prompts, new_tokens: int, temperature: float) -> dict:
  tok = loaded.tokenizer
  args = dict(temperature=temperature, key=jax.random.key(0), pad_id=tok.pad_id,
              vocab_size=tok.vocab_size)
  plain, plain_s = timed(lambda: gen.generate(loaded.model, prompts, new_tokens, **args))
  (tokens, stats), spec_s = timed(lambda: spec.speculate(loaded.model, prompts, new_tokens,
                                                         **args))
  forwards = int(stats['forwards'].sum())
  row = {'temperature': temperature, 'tokens_per_forward': float(stats['tokens'].sum() / forwards),
         'kept_per_head': (stats['accepted'].sum(0) / forwards).tolist(),
         'cpu_plain_s': plain_s, 'cpu_speculative_s': spec_s}
  if temperature == 0:
    row['greedy_same'], row['greedy_tokens_before_change'] = agreement(tokens, plain)
    row['top1_on_text'] = top1_on_text(loaded.model, prompts, plain)
    accepted = stats['accepted'].sum(0)
    row['kept_when_tried'] = (accepted / np.concatenate([[forwards], accepted[:-1]])).tolist()
  return row


def top1_on_text(model, prompts, new_BN) -> list[float]:
  """Each head's top-1 accuracy as training counts it (its guess against the base's greedy token,
  the text's tokens before it) at every position of the prompts' greedy continuations `new_BN`
  where its target lies in them: what greedy speculation's guesses are checked against."""
  K = model.cfg.draft_heads
  texts = [list(p) + list(n) for p, n in zip(prompts, np.asarray(new_BN))]
  L = max(map(len, texts))
  text_BL = jnp.asarray([t + [0] * (L - len(t)) for t in texts], jnp.int32)
  graphdef, state = nnx.split(model)
  gap_KBL = jax.jit(lambda state, text_BL: nnx.merge(graphdef, state).output(
      text_BL[:, :-1])[0].draft_losses(text_BL[:, 1:])[1])(state, text_BL)
  hits_KBL = np.asarray(gap_KBL == 0)
  t_L = np.arange(L - 1)
  out = []
  for k in range(K):  # head k at t guesses the token at t + k + 2, the base's there from t + k + 1
    valid_BL = np.stack([(t_L >= len(p) - 1) & (t_L + k + 2 < len(text))
                         for p, text in zip(prompts, texts)])
    out.append(float(hits_KBL[k][valid_BL].mean()))
  return out


def plan(preset: str, heads: int, batch: int, slots: int, target: str) -> dict:
  """A plain decode step and a round of speculation compiled for `target` GPUs: memory and the
  time model's predictions."""
  model = served(preset, target, 'benchmarks.speculative', draft_heads=heads)
  cfg, gpu, device, graphdef, abstract = model[:5]
  on_device, step = model.on_device, model.decode_step
  cache = on_device(jax.eval_shape(
      lambda s: nnx.merge(graphdef, s).init_cache(batch, slots), abstract))
  B = jax.ShapeDtypeStruct((batch,), jnp.int32)
  rows = on_device(spec.Rows(
      i=jax.ShapeDtypeStruct((), jnp.int32), cache=cache,
      h_BD=jax.ShapeDtypeStruct((batch, cfg.d_model), cfg.dtype), token_B=B, pos_B=B,
      out_BN=jax.ShapeDtypeStruct((batch, 64 + heads + 1), jnp.int32), count_B=B,
      done_B=jax.ShapeDtypeStruct((batch,), jnp.bool_), forwards_B=B,
      accepted_BK=jax.ShapeDtypeStruct((batch, heads), jnp.int32)))
  key = on_device(jax.eval_shape(lambda: jax.random.key(0)))
  tokens = on_device(jax.ShapeDtypeStruct((batch, 1), jnp.int32))

  def round_(state, rows, key):
    return spec.one_round(nnx.merge(graphdef, state), rows, key, max_new_tokens=64,
                          sampling=gen.Sampling(), eos_id=-1, pad_id=0, vocab_size=None)

  figures = {}
  for name, fn, args in (('plain step', step, (abstract, tokens, tokens, cache)),
                         ('speculative round', round_, (abstract, rows, key))):
    compiled = jax.jit(fn, donate_argnums=3 if fn is step else 1).lower(*args).compile()
    memory, predicted = compiled.memory_analysis(), timing.predict(compiled.as_text(), gpu)
    figures[name] = {'temp_bytes': memory.temp_size_in_bytes,
                     'predicted_s': predicted.seconds}
  plain_s, round_s = (figures[n]['predicted_s'] for n in ('plain step', 'speculative round'))
  draft_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
      nnx.state(nnx.merge(graphdef, abstract).draft)))
  print(f'# {preset} with {heads} Clover heads ({draft_bytes / 2**30:.2f} GiB): {batch} rows '
        f'against {slots:,} slots, compiled for {device.device_kind} (deviceless); times: the '
        'time model\'s predictions\n')
  print(f'{"":18} {"temp GiB":>9} {"predicted ms":>13}')
  for name, f in figures.items():
    print(f'{name:18} {f["temp_bytes"] / 2**30:>9.2f} {1e3 * f["predicted_s"]:>13.2f}')
  print(f'\nbreak-even: {round_s / plain_s:.2f} tokens a round; at τ tokens a round the '
        f'speed-up is τ × {plain_s / round_s:.3f}')
  return {'benchmark': 'speculative_plan', 'preset': preset, 'heads': heads, 'batch': batch,
          'slots': slots, 'compiled_for': device.device_kind, 'deviceless': True,
          'jax': jax.__version__, 'draft_bytes': draft_bytes, **{
              name.replace(' ', '_'): f for name, f in figures.items()},
          'break_even_tokens_per_round': round_s / plain_s, 'command': report.command()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', default='/tmp/meshlm-draft')
  parser.add_argument('--prompts', type=int, default=16)
  parser.add_argument('--prompt_tokens', type=int, default=64)
  parser.add_argument('--new_tokens', type=int, default=128)
  parser.add_argument('--temperatures', default='0.8', help='comma-separated, besides greedy')
  parser.add_argument('--plan', default='', help='a preset of configs/llama.py: plan a round of '
                      'speculation and a plain step for --target instead')
  parser.add_argument('--heads', type=int, default=3)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--slots', type=int, default=8192)
  parser.add_argument('--target', default='H100')
  parser.add_argument('--out', default='', help='also write the figures here (JSON)')
  args = parser.parse_args(argv)
  if args.plan:
    return report.emit(plan(args.plan, args.heads, args.batch, args.slots, args.target),
                       args.out)
  loaded = sampling.load(args.workdir)
  cfg = loaded.model.cfg
  if not cfg.draft_heads:
    raise SystemExit(f'{loaded.checkpoint}: the run has no draft heads; train one with '
                     '--config.model.draft_heads=3')
  rows = windows(loaded, args.prompts, args.prompt_tokens)
  prompts = [list(r) for r in rows]
  print(f'# {loaded.checkpoint}: {cfg.draft_heads} {cfg.draft_kind} heads; {len(prompts)} '
        f'prompts of {args.prompt_tokens} validation tokens, {args.new_tokens} new tokens each; '
        'times: this machine\'s CPU, measured\n')
  temperatures = [0.0] + [float(t) for t in args.temperatures.split(',') if t]
  results = [measure(loaded, prompts, args.new_tokens, t) for t in temperatures]
  print(f'{"temperature":>11} {"tokens/forward":>15} {"kept, head by head":>24} '
        f'{"greedy same":>12} {"CPU plain s":>12} {"CPU spec. s":>12}')
  for r in results:
    kept = ' / '.join(f'{100 * k:.0f}%' for k in r['kept_per_head'])
    same = f'{100 * r["greedy_same"]:.1f}%' if 'greedy_same' in r else '—'
    print(f'{r["temperature"]:>11} {r["tokens_per_forward"]:>15.2f} {kept:>24} {same:>12} '
          f'{r["cpu_plain_s"]:>12.2f} {r["cpu_speculative_s"]:>12.2f}')
  greedy = results[0]
  print(f'\ngreedy, head by head: {"top-1 on its text":>18} {"kept when tried":>16} '
        f'{"kept a round":>13}')
  for k in range(cfg.draft_heads):
    top1, tried, kept = (100 * greedy[name][k] for name in
                         ('top1_on_text', 'kept_when_tried', 'kept_per_head'))
    print(f'{"":14}head {k + 1} {top1:>17.1f}% {tried:>15.1f}% {kept:>12.1f}%')
  report.emit({'benchmark': 'speculative', 'checkpoint': loaded.checkpoint,
               'heads': cfg.draft_heads, 'kind': cfg.draft_kind, 'draft_only': cfg.draft_only,
               'prompts': len(prompts), 'new_tokens': args.new_tokens,
               'device': jax.devices()[0].device_kind, 'jax': jax.__version__,
               'results': results, 'command': report.command()}, args.out)


if __name__ == '__main__':
  main()
