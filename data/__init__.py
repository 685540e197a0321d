"""Training data: TFDS corpora (corpus.py), tokenizers, packing and the grain pipeline.

Only `tokenizers` is light; `corpus` and `pipeline` import tensorflow_datasets and grain, so the
model, sharding and kernels packages never import this package's heavy modules.
"""
