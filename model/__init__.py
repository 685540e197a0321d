"""A Llama-style decoder in Flax NNX whose parameters and activations carry logical axis names."""

from model.config import ModelConfig
from model.transformer import Transformer, logical_axes

__all__ = ['ModelConfig', 'Transformer', 'logical_axes']
