"""Attention implementations behind one dispatch point (`kernels.attention.attention`)."""

from kernels.attention import attention, cached_attention, xla_attention
from kernels.flash_attention import flash_attention

__all__ = ['attention', 'cached_attention', 'flash_attention', 'xla_attention']
