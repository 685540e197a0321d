"""Makes tests/data/hf-peft-lora, hf-peft-lora-qwen3 and hf-peft-lora-gemma3: a LoRA adapter made
and saved by PEFT on the tiny Llama of hf-llama-untied, the tiny Qwen3 of hf-qwen3 and the tiny
Gemma 3 of hf-gemma3 (r=4, lora_alpha=8, every
projection; B drawn at random, so that it changes the model), and that adapted model's logits on
the base's golden tokens. tests/test_lora.py checks
meshlm's reading and writing of PEFT adapters, and its adapted model, against these without torch.

  python3.11 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers peft
  cd /tmp && /tmp/hf/bin/python REPO/tests/data/make_peft_goldens.py [OUT ...]  # all of ADAPTERS
"""

import pathlib
import shutil
import sys

import numpy as np
import peft
import torch
import transformers

HERE = pathlib.Path(__file__).parent
ADAPTERS = {'hf-peft-lora': 'hf-llama-untied', 'hf-peft-lora-qwen3': 'hf-qwen3',  # out: base
            'hf-peft-lora-gemma3': 'hf-gemma3'}


def main(names):
  for name in names or ADAPTERS:
    make(HERE / ADAPTERS[name], HERE / name)


def make(base, out):
  shutil.rmtree(out, ignore_errors=True)
  model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
  config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type='CAUSAL_LM',
                           target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj',
                                           'up_proj', 'down_proj'])
  torch.manual_seed(0)
  model = peft.get_peft_model(model, config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'lora_B' in name:
        p.normal_(0, 0.05)
  model.save_pretrained(out)
  (out / 'README.md').unlink()  # PEFT's model card template
  tokens = torch.from_numpy(np.load(base / 'goldens.npz')['tokens']).long()
  with torch.no_grad():
    logits = model(tokens).logits.numpy()
  np.savez_compressed(out / 'goldens.npz', logits=logits)
  print(sorted(p.name for p in out.iterdir()), peft.__version__)


if __name__ == '__main__':
  main(sys.argv[1:])
