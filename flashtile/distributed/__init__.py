"""Context parallelism: ring attention over ``torch.distributed`` (see ``ring_attention.py``)."""

from .ring_attention import plan, ring_flash_attn_func
from .zigzag import positions, segments, shard, unshard, unshard_gather

__all__ = ["ring_flash_attn_func", "shard", "unshard", "unshard_gather", "positions", "segments", "plan"]
