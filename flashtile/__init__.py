"""flashtile: exact fused attention (FlashAttention-style) for PyTorch, kernels in TileLang."""

from .interface import flash_attn_func
from .kvcache import flash_attn_with_kvcache
from .qkvpacked import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)
from .sdpa import scaled_dot_product_attention
from .varlen import flash_attn_varlen_func
from . import fa3  # flash-attn 3's signatures: flashtile.fa3.flash_attn_func, ...

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_with_kvcache", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "scaled_dot_product_attention", "__version__"]

# attn_implementation="tile_attention" in transformers, now or once transformers' model code
# loads; never imports transformers itself (flashtile/integrations/autoregister.py).
from .integrations import autoregister as _autoregister

_autoregister.install()
