"""flashtile: exact fused attention (FlashAttention-style) for PyTorch, kernels in TileLang."""

from .interface import flash_attn_func
from .sdpa import scaled_dot_product_attention

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "scaled_dot_product_attention", "__version__"]
