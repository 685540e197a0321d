"""Makes the Hugging Face test data: tiny random Llama, Qwen3, Mixtral and Qwen3-MoE models saved
by transformers, with their logits on fixed tokens and greedy continuations, and a byte-level BPE tokenizer
trained on the standard library. tests/test_huggingface.py checks meshlm against these without
torch.

  python3.11 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors tokenizers
  cd /tmp && /tmp/hf/bin/python REPO/tests/data/make_hf_goldens.py [NAME ...]   # all of MODELS by default

(from outside the repository: its kernels/ package would hide the one transformers imports)

Each model directory holds what from_pretrained wrote (config.json, safetensors) and
goldens.npz: `tokens` [2, 24], their float32 `logits` [2, 24, vocab], and `greedy`, 12 tokens
generate() appends greedily to tokens[:, :8].
"""

import pathlib
import sys
import sysconfig

import numpy as np
import tokenizers
import torch
import transformers

HERE = pathlib.Path(__file__).parent
VOCAB = 320

MODELS = {
    # Untied, plain RoPE, float32 weights in one file, HF's default eps.
    'hf-llama-untied': dict(tie_word_embeddings=False, rms_norm_eps=1e-6, dtype=torch.float32,
                            num_key_value_heads=2, shard='1GB'),
    # Tied, one KV head, Llama 3.1's RoPE rescaling with all three bands present at head_dim 16
    # (wavelengths 6, 20, 63, 199, ... against 64/4 = 16 and 64/1 = 64), bf16 weights sharded
    # over several files with an index.
    'hf-llama-tied-llama3': dict(
        tie_word_embeddings=True, rms_norm_eps=1e-5, dtype=torch.bfloat16, num_key_value_heads=1,
        rope_parameters=dict(rope_type='llama3', rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64),
        shard='60KB'),
    # Qwen3: per-head q/k norms, tied head (as Qwen3-0.6B to 4B), its RoPE base, float32; every
    # norm's weight drawn around 1, so that a norm read into another's place shows.
    'hf-qwen3': dict(architecture='qwen3', tie_word_embeddings=True, rms_norm_eps=1e-6, norms=0.2,
                     rope_parameters=dict(rope_type='default', rope_theta=1e6),
                     num_key_value_heads=2, dtype=torch.float32, shard='1GB'),
    # Gemma 3 (text): norms scaling by (1 + w) before and after attention and the MLP, GeGLU,
    # embeddings × √64, q/k norms, query_pre_attn_scalar 24 (not head_dim's 16), tied; three layers
    # local, global, local (sliding_window_pattern 2) with a window of 4 keys, the local ones'
    # RoPE base 10,000, the global one's 1e6 scaled linearly by 8; float32.
    'hf-gemma3': dict(architecture='gemma3_text', num_hidden_layers=3, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, norms=0.2, query_pre_attn_scalar=24, sliding_window=4,
                      sliding_window_pattern=2, hidden_activation='gelu_pytorch_tanh',
                      rope_parameters={
                          'full_attention': dict(rope_type='linear', factor=8.0, rope_theta=1e6),
                          'sliding_attention': dict(rope_type='default', rope_theta=10000.0)},
                      num_key_value_heads=2, dtype=torch.float32, shard='1GB'),
    # Gemma 3 with a vision tower (Gemma3ForConditionalGeneration, as the Hub's 4B to 27B are):
    # the text model as hf-gemma3's (its own random weights, RoPE unscaled) beside a tiny SigLIP
    # tower and projector, which an import leaves out, saying so; goldens on text alone.
    'hf-gemma3-vision': dict(architecture='gemma3', num_hidden_layers=3,
                             tie_word_embeddings=True, rms_norm_eps=1e-6, norms=0.2,
                             query_pre_attn_scalar=24, sliding_window=4, sliding_window_pattern=2,
                             num_key_value_heads=2, dtype=torch.float32, shard='1GB'),
    # Mixtral: 4 experts of width 32, 2 a token, softmax router renormalised; float32, one file.
    'hf-mixtral': dict(architecture='mixtral', num_local_experts=4, num_experts_per_tok=2,
                       intermediate_size=32, router_aux_loss_coef=0.02, tie_word_embeddings=False,
                       rms_norm_eps=1e-5, num_key_value_heads=2, dtype=torch.float32,
                       shard='1GB'),
    # Qwen3-MoE: per-head q/k norms, 8 experts of width 16, 2 a token, its top-k not renormalised.
    'hf-qwen3-moe': dict(architecture='qwen3_moe', num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=False,
                         router_aux_loss_coef=0.001, tie_word_embeddings=False, rms_norm_eps=1e-6,
                         num_key_value_heads=2, dtype=torch.float32, shard='1GB'),
}
CLASSES = {'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           'gemma3_text': (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
           'gemma3': (transformers.Gemma3TextConfig, transformers.Gemma3ForConditionalGeneration),
           'mixtral': (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           'qwen3_moe': (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}


def tokenizer():
  """A byte-level BPE (GPT-2/Llama 3 style) of VOCAB - 2 tokens plus <s> and </s>."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=VOCAB - 20, special_tokens=['<s>', '</s>'],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  stdlib = pathlib.Path(sysconfig.get_paths()['stdlib'])
  tok.train([str(p) for p in sorted((stdlib / 'json').glob('*.py'))], trainer)
  return tok


def main(names):
  tok = tokenizer()
  for name in names or MODELS:
    settings = {'intermediate_size': 128, **MODELS[name]}
    dtype, shard, norms = settings.pop('dtype'), settings.pop('shard'), settings.pop('norms', 0)
    architecture = settings.pop('architecture', 'llama')
    config_class, model_class = CLASSES[architecture]
    config = config_class(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=settings.pop('num_hidden_layers', 2),
        num_attention_heads=4, head_dim=16, max_position_embeddings=128, bos_token_id=0,
        eos_token_id=1, **settings)
    if architecture == 'gemma3':  # the text config inside a multimodal one
      vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2,
                                               image_size=28, patch_size=14)
      config = transformers.Gemma3Config(text_config=config, vision_config=vision,
                                         mm_tokens_per_image=4, boi_token_index=VOCAB - 4,
                                         eoi_token_index=VOCAB - 3, image_token_index=VOCAB - 2)
    torch.manual_seed(0)
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():
      for param_name, param in model.named_parameters():
        if norms and param_name.endswith('norm.weight'):
          param.add_(torch.randn_like(param) * norms)
    directory = HERE / name
    model.save_pretrained(directory, max_shard_size=shard)
    tok.save(str(directory / 'tokenizer.json'))
    (directory / 'tokenizer_config.json').write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", '
        '"tokenizer_class": "PreTrainedTokenizerFast"}\n')
    model = model.float()  # the goldens in float32, from the saved (maybe bf16) weights
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, (2, 24)))
    with torch.no_grad():
      logits = model(tokens).logits
      greedy = model.generate(tokens[:, :8], max_new_tokens=12, do_sample=False,
                              attention_mask=torch.ones_like(tokens[:, :8]), eos_token_id=None,
                              pad_token_id=1)[:, 8:]
    np.savez_compressed(directory / 'goldens.npz', tokens=tokens.numpy().astype(np.int32),
                        logits=logits.numpy(), greedy=greedy.numpy().astype(np.int32))
    print(name, sorted(p.name for p in directory.iterdir()))


if __name__ == '__main__':
  main(sys.argv[1:])
