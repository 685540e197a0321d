"""Text from a trained model: the KV-cached sampler (generate), speculative decoding with the
model's draft heads (speculate), and a run's checkpoint and tokenizer loaded for them (sampling),
which sample.py and export.py enter. The model's own decode path (its cache layouts, its draft
heads) stays in model/."""
