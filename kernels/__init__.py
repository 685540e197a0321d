"""Attention implementations behind one dispatch point (`kernels.attention.attention`)."""

from kernels.attention import IMPLEMENTATIONS, attention, xla_attention

__all__ = ['IMPLEMENTATIONS', 'attention', 'xla_attention']
