"""Context parallelism: ring attention over ``torch.distributed`` (see ``ring_attention.py``)."""

from .ring_attention import plan, ring_flash_attn_func, ring_flash_attn_varlen_func
from .zigzag import positions, segments, shard, shard_varlen, unshard, unshard_gather, unshard_varlen

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "shard",
    "unshard",
    "unshard_gather",
    "shard_varlen",
    "unshard_varlen",
    "positions",
    "segments",
    "plan",
]
