"""Formats other libraries read and write, in and out of a run: Hugging Face Llama checkpoints
and tokenizers (huggingface), PEFT's LoRA adapters (peft). Their golden tests were made once with
transformers and peft (tests/data/make_*_goldens.py)."""
