"""Sample text from a trained run's checkpoint (KV-cached decoding: inference/generate.py).

  python sample.py --workdir=/tmp/meshlm-default --prompt='def ' --max_new_tokens=300
  python sample.py --workdir=/tmp/meshlm-default/checkpoints/100 --temperature=0 --prompt='import '

--temperature=0 is greedy; otherwise a draw at that temperature from the --top_k most likely
tokens (0: all), and of those from the fewest whose probabilities reach --top_p (1: all). The model, tokenizer and data settings come from the config saved with the
checkpoint. --kv_cache=int8 (or xquant) keeps about half the bytes of past tokens, int4 (or
xquant4) about a quarter (docs/sampling.md). A run trained with draft heads
(config.model.draft_heads) decodes speculatively, the heads guessing and one forward checking
their guesses, unless --nospeculative. --chat asks each prompt as a user's message, in the
run's chat template with its generation prompt (docs/fine-tuning.md); the answer runs until the
model ends the document:
  python sample.py --workdir=/tmp/meshlm-finetune --chat --temperature=0 \
      --prompt='What does `json.dumps(obj)` do?'
"""

from absl import app, flags

from inference import sampling
from model import kv_cache
from runtime import cli

_WORKDIR = flags.DEFINE_string('workdir', None, "A run's workdir, checkpoints/ or checkpoints/STEP.",
                               required=True)
_PROMPT = flags.DEFINE_multi_string('prompt', [''], 'Text to continue; repeat for several.')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 200, 'Tokens to generate at most.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, '0: greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 40, 'Sample among this many most likely tokens; 0: all.')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Then among the fewest most likely whose probabilities '
                            'reach this (nucleus sampling); 1: all.')
_SEED = flags.DEFINE_integer('seed', 0, 'Random seed of the draws.')
_CHAT = flags.DEFINE_bool('chat', False, "Each prompt is a user's message, in the run's chat "
                          'template.')
_KV_CACHE = flags.DEFINE_string('kv_cache', 'full', 'What decoding keeps of past tokens: full (K '
                                'and V in the compute dtype), int8 or int4 (K and V), x, xquant '
                                "or xquant4 (XQuant: each layer's input, in the compute dtype, "
                                'int8 or int4); docs/sampling.md.')
_SPECULATIVE = flags.DEFINE_bool('speculative', True, "Decode with the checkpoint's draft heads, "
                                  'if it has them (config.model.draft_heads): the same text '
                                  'greedy, the same distribution sampled, fewer forwards.')
_MAX_LEN = flags.DEFINE_integer('max_len', 0, 'Prompt + continuation at most, in tokens; 0: the '
                                'seq_len the model was trained at.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  sampling.check_arguments(_MAX_NEW_TOKENS.value, _TEMPERATURE.value, _TOP_K.value,
                           _MAX_LEN.value, _KV_CACHE.value, _TOP_P.value)
  loaded = sampling.load(_WORKDIR.value)
  per_token = kv_cache.bytes_per_token(loaded.model.cfg, _KV_CACHE.value)
  print(f'# {loaded.checkpoint}: temperature {_TEMPERATURE.value}, top_k {_TOP_K.value}, '
        f'top_p {_TOP_P.value}, seed {_SEED.value}, {_KV_CACHE.value} cache ({per_token:,} bytes a token a layer)',
        flush=True)
  prompts = ([sampling.chat_prompt(loaded, p) for p in _PROMPT.value] if _CHAT.value else
             _PROMPT.value)
  texts = sampling.complete(loaded, prompts, _MAX_NEW_TOKENS.value,
                            temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                            top_p=_TOP_P.value, seed=_SEED.value,
                            max_len=_MAX_LEN.value, cache=_KV_CACHE.value,
                            speculative=_SPECULATIVE.value, report=print,
                            chat_prompts=_CHAT.value)
  for prompt, text in zip(_PROMPT.value, texts):
    print(f'--- prompt {prompt!r}\n{"" if _CHAT.value else prompt}{text}')


if __name__ == '__main__':
  cli.run(main)
