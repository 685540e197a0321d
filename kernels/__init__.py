"""Attention implementations behind one dispatch point (`kernels.attention.attention`)."""

from kernels.attention import (DENSE_FALLBACK, OURS, attention, cached_attention, fused_for,
                               positioned_attention, xla_attention)
from kernels.flash_attention import flash_attention
from kernels.context_parallel import gathered_attention, ring_attention, zigzag_order

__all__ = ['DENSE_FALLBACK', 'OURS', 'attention', 'cached_attention', 'flash_attention', 'fused_for', 'gathered_attention',
           'positioned_attention',
           'ring_attention', 'xla_attention', 'zigzag_order']
