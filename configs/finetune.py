"""Fine-tuning an imported Hugging Face model on chat records with LoRA, trained on the answers
only (docs/fine-tuning.md walks through it: records, the chat template, adapters, export).

Run, on the tiny Llama of tests/data given a chat template, and the standard library's
docstrings as answers:
  python -m data.stdlib_chat --output=/tmp/stdlib-chat.jsonl
  cp -r tests/data/hf-llama-untied /tmp/tiny-llama && cp tests/data/hf-chat/llama3/* /tmp/tiny-llama/
  python train.py --config=configs/finetune.py --config.init_from=hf:/tmp/tiny-llama \
      --config.data.paths=/tmp/stdlib-chat.jsonl --config.workdir=/tmp/meshlm-finetune
  python export.py --workdir=/tmp/meshlm-finetune --output=/tmp/tiny-llama-tuned
  python export.py --workdir=/tmp/meshlm-finetune --output=/tmp/tiny-llama-adapter --lora=peft
  python sample.py --workdir=/tmp/meshlm-finetune --chat --temperature=0 --max_new_tokens=20 \
      --prompt='What does `json.dumps(obj)` do?'
Should reach: the answers' loss falls from 5.53 at step 10 to 5.48 nats per token by step 150,
eval 5.48, in about a minute on a 2-core CPU (every step in tests/data/curves/finetune.json, from
scripts/loss_curves.py), the tokenizer's files and chat template kept in the workdir. Only the rank-16 adapters on the 7 projections train (32,768 parameters; the base's
115,008 are frozen), and the tiny model's weights are random: its frozen head, of small random
weights after a norm, caps how far any adapter moves the logits (full fine-tuning,
--config.model.lora_rank=0, reaches 2.6). The first export is the model with its adapters merged,
the second the adapters alone in PEFT's format; sample.py asks the run a question in its chat
template. A real model: point init_from at its directory
(its own tokenizer and template come with it), paths at your .jsonl or .parquet, and take a
learning rate near 2e-4.

The 1b (Llama-3.2-1B's shapes, LoRA rank 16 on one H100), planned on any machine:
  python train.py --config=configs/finetune.py:1b --config.dry_run=True --config.plan.target=H100
Should reach: it fits one H100, 28.74 GiB of the 59.74 JAX's allocator takes (the bf16 base and
the adapters 2.34 GiB, Adam's moments of the adapters 86 MiB), predicted at 514.2 ms a step
(MFU 37.5%). On a GPU, with the real model and your records:
  python train.py --config=configs/finetune.py:1b --config.init_from=hf:/path/to/Llama-3.2-1B \
      --config.data.paths=/path/to/chats.jsonl

The 8b (Meta-Llama-3-8B's shapes, LoRA rank 16 on one H100), planned on any machine:
  python train.py --config=configs/finetune.py:8b --config.dry_run=True --config.plan.target=H100
Should reach: it fits one H100, 39.71 GiB of the 59.74 JAX's allocator takes (the bf16 base
and the adapters 15.11 GiB, Adam's moments of the adapters 0.31 GiB), predicted at 2.51 s a
step (MFU 44.3%, counting no weight gradient for the base). Full fine-tuning
(--config.model.lora_rank=0) needs 146.8 GiB a GPU, its Adam moments alone 59.83 GiB.

qwen3-8b (Qwen3-8B's shapes, q/k norms included, LoRA rank 16 on one H100), planned on any
machine, then on a GPU from the real checkpoint:
  python train.py --config=configs/finetune.py:qwen3-8b --config.dry_run=True \
      --config.plan.target=H100
  python train.py --config=configs/finetune.py:qwen3-8b --config.init_from=hf:/path/to/Qwen3-8B \
      --config.data.paths=/path/to/chats.jsonl
Should reach: it fits one H100 (docs/recipes.md has its plan: python -m benchmarks.plans
--only=qwen3).

gemma3-4b (Gemma 3 4B's text model: local and global layers, its 262k-token tied head), the same
way:
  python train.py --config=configs/finetune.py:gemma3-4b --config.dry_run=True \
      --config.plan.target=H100
Should reach: it fits one H100 (its plan too: python -m benchmarks.plans --only=gemma3).
"""

from configs import base
from configs import llama
from configs import gemma3
from configs import qwen3

PRESETS = ('tiny', '1b', '8b', 'qwen3-8b', 'gemma3-4b')
FAMILIES = {'qwen3': qwen3, 'gemma3': gemma3}  # a preset 'family-size': that file's shapes


def get_config(preset: str = 'tiny'):
  if preset not in PRESETS:
    raise ValueError(f'configs/finetune.py: unknown preset {preset!r}; use one of {PRESETS}, '
                     'e.g. --config=configs/finetune.py:8b')
  c = base.get_config()
  c.workdir = f'/tmp/meshlm-finetune{"" if preset == "tiny" else "-" + preset}'
  c.data.paths = '/tmp/stdlib-chat.jsonl'  # python -m data.stdlib_chat --output=...
  c.data.record = 'messages'
  c.data.validation_fraction = 0.05
  c.model.lora_rank, c.model.lora_alpha = 16, 32.0
  c.optimizer.weight_decay = 0.0
  c.optimizer.warmup_steps = 10
  if preset == 'tiny':
    c.train_steps, c.log_every, c.eval_every, c.checkpoint_every = 150, 10, 75, 75
    c.eval_batches = 0  # all of the held-out records
    c.batch_size, c.seq_len = 16, 256
    c.model.compute_dtype = 'float32'  # the tiny model; a real one trains in bfloat16
    c.optimizer.learning_rate = 1e-2  # random tiny weights; a real model wants about 2e-4
    return c
  c.train_steps, c.log_every, c.eval_every = 1000, 10, 200
  c.optimizer.learning_rate = 2e-4
  if '-' in preset:
    family, size = preset.split('-')
    c.model.update(FAMILIES[family].PRESETS[size], **FAMILIES[family].COMMON)
  else:
    c.model.update(llama.PRESETS[preset])
  c.model.remat_policy = 'dots'
  c.batch_size, c.seq_len, c.microbatches = 8, 4096, 1 if preset == '1b' else 4
  return c
