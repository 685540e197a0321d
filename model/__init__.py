"""A Llama-style decoder in Flax NNX whose parameters and activations carry logical axis names."""

from configs.base import ModelConfig
from model.transformer import Transformer

__all__ = ['ModelConfig', 'Transformer']
