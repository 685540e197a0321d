"""Qwen3 dense presets with real sizes: 0.6b (0.60B, Qwen/Qwen3-0.6B's config: tied head), 8b
(8.19B, Qwen/Qwen3-8B's) and 32b (32.8B, Qwen/Qwen3-32B's). A Qwen3 is Llama with per-head RMS
norms of the queries and keys before RoPE (config.model.qk_norm), RoPE's base 1e6 and a
151,936-token vocabulary; its 8b and 32b project queries wider than the residual stream
(32 × 128 = 4096 of 4096, 64 × 128 = 8192 of 5120).

Run (pick the preset after the colon):
  python train.py --config=configs/qwen3.py:0.6b --config.workdir=/tmp/meshlm-qwen3-0.6b
Start from the weights they mirror (docs/huggingface.md), which brings the checkpoint's
tokenizer, chat template and settings:
  python train.py --config=configs/qwen3.py:8b --config.init_from=hf:/path/to/Qwen3-8B
Plan on any machine, compiled for the H100s each preset is meant for (GPUS below):
  python train.py --config=configs/qwen3.py:0.6b --config.dry_run=True --config.plan.target=H100
  python train.py --config=configs/qwen3.py:8b --config.dry_run=True --config.plan.target=H100 \
      --config.plan.devices=8
  python train.py --config=configs/qwen3.py:32b --config.dry_run=True --config.plan.target=H100 \
      --config.plan.devices=8
Should reach: without init_from they train byte-level on the default corpus, the loss falling as
the default run's does. The plans fit their H100s; what each needs and its predicted step (the
time model's, not a measurement) are in docs/recipes.md, made by
`python -m benchmarks.plans --only=qwen3`. The 32b's Adam moments wait in host memory between
steps (config.optimizer.mu_tier, nu_tier): on 8 GPUs the fp32 state of 32.8B parameters is more
than their memory.
"""

from configs import families

PRESETS = {
    # name: config.model's fields, as the Hugging Face config.json of its namesake
    '0.6b': dict(d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=3072,
                 vocab_size=151936, tie_embeddings=True),
    '8b': dict(d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=12288,
               vocab_size=151936, tie_embeddings=False),
    '32b': dict(d_model=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, d_ff=25600,
                vocab_size=151936, tie_embeddings=False),
}
COMMON = dict(qk_norm=True, rope_theta=1e6, norm_eps=1e-6, max_position_embeddings=40960)
RUNS = {  # name: global batch (sequences), seq_len, remat policy, microbatches
    '0.6b': (8, 4096, 'dots_attention', 1),
    '8b': (32, 8192, 'dots_attention', 4),
    '32b': (32, 4096, 'full', 4),
}
UNROLLED = {'0.6b', '8b'}  # as the Llamas of their size (configs/llama.py)
HOST_MOMENTS = {'32b'}  # Adam's moments in pinned host memory between steps
GPUS = {'0.6b': 1, '8b': 8, '32b': 8}  # H100s each run is meant for


def get_config(preset: str = '0.6b'):
  return families.preset_config('qwen3', preset, PRESETS, COMMON, RUNS, unrolled=UNROLLED,
                                host_moments=HOST_MOMENTS)
