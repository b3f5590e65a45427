"""flashtile: exact fused attention (FlashAttention-style) for PyTorch, kernels in TileLang."""

from .interface import flash_attn_func

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "__version__"]
