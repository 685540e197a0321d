"""Makes tests/data/hf-peft-lora: a LoRA adapter made and saved by PEFT on the tiny Llama of
hf-llama-untied (r=4, lora_alpha=8, every projection; B drawn at random, so that it changes the
model), and that adapted model's logits on the base's golden tokens. tests/test_lora.py checks
meshlm's reading and writing of PEFT adapters, and its adapted model, against these without torch.

  python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers peft
  /tmp/hf/bin/python tests/data/make_peft_goldens.py
"""

import pathlib
import shutil

import numpy as np
import peft
import torch
import transformers

HERE = pathlib.Path(__file__).parent
BASE, OUT = HERE / 'hf-llama-untied', HERE / 'hf-peft-lora'


def main():
  shutil.rmtree(OUT, ignore_errors=True)
  model = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
  config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type='CAUSAL_LM',
                           target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj',
                                           'up_proj', 'down_proj'])
  torch.manual_seed(0)
  model = peft.get_peft_model(model, config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'lora_B' in name:
        p.normal_(0, 0.05)
  model.save_pretrained(OUT)
  (OUT / 'README.md').unlink()  # PEFT's model card template
  tokens = torch.from_numpy(np.load(BASE / 'goldens.npz')['tokens']).long()
  with torch.no_grad():
    logits = model(tokens).logits.numpy()
  np.savez_compressed(OUT / 'goldens.npz', logits=logits)
  print(sorted(p.name for p in OUT.iterdir()), peft.__version__)


if __name__ == '__main__':
  main()
