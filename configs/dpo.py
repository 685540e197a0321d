"""Preference tuning by DPO (Rafailov et al. 2023) on pairs of a chosen and a rejected answer
(docs/fine-tuning.md: DPO): the policy learns to raise the chosen answer's likelihood over the
rejected one's, measured against a reference model, the run's starting one.

Run, on the standard library's docstrings (the chosen answer) against the same words reversed
(the rejected one), full fine-tuning of a tiny model:
  python -m data.stdlib_chat --kind=preference --output=/tmp/stdlib-preference.jsonl
  python train.py --config=configs/dpo.py --config.workdir=/tmp/meshlm-dpo
Should reach: DPO's loss starts at ln 2 = 0.693 (the policy is its own reference:
tests/test_dpo.py holds it), is 0.39 at step 10 (reward accuracy 81%), and the held-out reward
accuracy (eval_reward_accuracy, over the 133 pairs of the validation split; chance is 50%) is 98%
at steps 50 and 100, eval loss 0.048, in about 30 seconds on a 2-core CPU. On a real model: point
init_from at it (hf:DIR or a meshlm run), paths at your pairs (`prompt`, `chosen`, `rejected`
fields; .jsonl or .parquet), and take a learning rate near 5e-7 (full) or 5e-6 (LoRA).

The same pairs as conversations (TRL's conversational form, rendered by the chat template):
  python -m data.stdlib_chat --kind=chat_preference --output=/tmp/stdlib-chat-preference.jsonl
  python train.py --config=configs/dpo.py --config.data.record=chat_preference \
      --config.data.paths=/tmp/stdlib-chat-preference.jsonl --config.workdir=/tmp/meshlm-dpo-chat
Should reach: held-out reward accuracy 97% at steps 50 and 100, eval loss 0.079.

The same with LoRA adapters (the reference is then the frozen base, no copy held):
  python train.py --config=configs/dpo.py --config.model.lora_rank=16 --config.init_from=random \
      --config.optimizer.learning_rate=1e-2 --config.workdir=/tmp/meshlm-dpo-lora
Should reach: held-out reward accuracy 98% at steps 50 and 100, eval loss 0.045.

The 8b (Meta-Llama-3-8B's shapes) on 8 H100s, LoRA rank 16, planned on any machine:
  python train.py --config=configs/dpo.py:8b --config.dry_run=True --config.plan.target=H100 \
      --config.plan.devices=8
Should reach: it fits, 17.90 GiB a GPU of the 59.74 JAX's allocator takes; predicted at 1.728 s a
step of 64 pairs × 2048 tokens (MFU 45.5%, counting the reference's forward), a prediction of the
time model, not a measurement.
"""

from configs import base
from configs import llama

PRESETS = ('tiny', '8b')


def get_config(preset: str = 'tiny'):
  if preset not in PRESETS:
    raise ValueError(f'configs/dpo.py: unknown preset {preset!r}; use one of {PRESETS}, '
                     'e.g. --config=configs/dpo.py:8b')
  c = base.get_config()
  c.workdir = f'/tmp/meshlm-dpo{"" if preset == "tiny" else "-" + preset}'
  c.data.paths = '/tmp/stdlib-preference.jsonl'  # python -m data.stdlib_chat --kind=preference
  c.data.record = 'preference'
  c.data.validation_fraction = 0.05
  c.dpo.beta, c.dpo.label_smoothing = 0.1, 0.0
  c.optimizer.weight_decay = 0.0
  if preset == 'tiny':
    c.train_steps, c.log_every, c.eval_every, c.checkpoint_every = 100, 10, 50, 50
    c.eval_batches = 0  # every held-out pair
    c.batch_size, c.seq_len = 16, 256
    c.model.compute_dtype = 'float32'
    c.optimizer.learning_rate, c.optimizer.warmup_steps = 3e-3, 10
    return c
  c.model.update(llama.PRESETS[preset])
  c.model.lora_rank, c.model.lora_alpha = 16, 32.0
  c.model.remat_policy = 'dots'
  c.train_steps, c.log_every, c.eval_every = 1000, 10, 200
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 5e-6, 50
  c.batch_size, c.seq_len, c.microbatches = 64, 2048, 4
  return c
