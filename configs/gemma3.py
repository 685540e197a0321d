"""Gemma 3 text presets with real sizes: 1b (1.0B, google/gemma-3-1b-pt's config), 4b (3.9B, the
text model of google/gemma-3-4b-pt) and 27b (27.0B, gemma-3-27b-pt's). A Gemma 3 is a decoder
whose RMS norms scale by (1 + w), one before and one after both attention and the MLP; its MLP is
GeGLU (tanh GELU), its embeddings enter × √d_model, its queries and keys are RMS-normed per head,
its scores scaled by 1/√query_pre_attn_scalar, and its 262k-token head is the embedding table.
Five layers of six attend within a sliding window (512 keys for the 1b, 1024 above; RoPE base
10,000), every sixth to everything before it (base 1e6, positions ÷ 8 on the 4b and 27b).

Run (pick the preset after the colon):
  python train.py --config=configs/gemma3.py:1b --config.workdir=/tmp/meshlm-gemma3-1b
Start from the weights they mirror (docs/huggingface.md), which brings the checkpoint's tokenizer,
chat template and settings; the 4b's and 27b's are multimodal, and their text model is imported:
  python train.py --config=configs/gemma3.py:1b --config.init_from=hf:/path/to/gemma-3-1b-pt
  python train.py --config=configs/gemma3.py:4b --config.init_from=hf:/path/to/gemma-3-4b-pt
Plan on any machine, compiled for the H100s each preset is meant for (GPUS below):
  python train.py --config=configs/gemma3.py:1b --config.dry_run=True --config.plan.target=H100
  python train.py --config=configs/gemma3.py:4b --config.dry_run=True --config.plan.target=H100 \
      --config.plan.devices=8
  python train.py --config=configs/gemma3.py:27b --config.dry_run=True --config.plan.target=H100 \
      --config.plan.devices=8
Should reach: without init_from they train byte-level on the default corpus, the loss falling as
the default run's does. The plans fit their H100s; what each needs and its predicted step (the
time model's, not a measurement) are in docs/recipes.md, made by
`python -m benchmarks.plans --only=gemma3`. On GPUs attention='auto' takes our kernel: cuDNN's
takes head dims up to 128 (the 1b and 4b have 256) and a window fixed when compiled, where each
scanned layer here takes its own at run time. The 27b's Adam moments wait in host memory between steps
(config.optimizer.mu_tier, nu_tier).
"""

from configs import families

PRESETS = {
    # name: config.model's fields, as the Hugging Face config.json of its namesake
    '1b': dict(d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, d_ff=6912,
               vocab_size=262144, query_scale=256.0, sliding_window=512, rope_type='default',
               max_position_embeddings=32768),
    '4b': dict(d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, d_ff=10240,
               vocab_size=262208, query_scale=256.0, sliding_window=1024, rope_type='linear',
               rope_factor=8.0, max_position_embeddings=131072),
    '27b': dict(d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128, d_ff=21504,
                vocab_size=262208, query_scale=168.0, sliding_window=1024, rope_type='linear',
                rope_factor=8.0, max_position_embeddings=131072),
}
COMMON = dict(tie_embeddings=True, qk_norm=True, norm_plus_one=True, post_norms=True,
              embed_scale=True, mlp_activation='gelu_tanh', global_every=6, rope_theta=1e6,
              rope_local_theta=1e4, norm_eps=1e-6)
RUNS = {  # name: global batch (sequences), seq_len, remat policy, microbatches
    '1b': (8, 4096, 'dots_attention', 1),
    '4b': (32, 8192, 'dots_attention', 4),
    '27b': (32, 4096, 'full', 4),
}
HOST_MOMENTS = {'27b'}  # Adam's moments in pinned host memory between steps
GPUS = {'1b': 1, '4b': 8, '27b': 8}  # H100s each run is meant for


def get_config(preset: str = '1b'):
  return families.preset_config('gemma3', preset, PRESETS, COMMON, RUNS,
                                host_moments=HOST_MOMENTS)
