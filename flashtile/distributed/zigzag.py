"""Sequence sharding for context parallelism: zigzag (load-balanced for causal) and contiguous.

Zigzag: the sequence is cut into ``2 * world_size`` equal chunks and rank ``r`` holds chunks
``r`` and ``2 * world_size - 1 - r`` (in that order), so every rank gets the same amount of
causal work::

    world_size = 4, chunks 0..7 of the global sequence
    rank 0: [c0 | c7]   rank 1: [c1 | c6]   rank 2: [c2 | c5]   rank 3: [c3 | c4]

Contiguous: rank ``r`` holds the ``r``-th of ``world_size`` equal slices.
"""

from __future__ import annotations

from typing import Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def segments(seqlen_local: int, world_size: int, rank: int, layout: str = "zigzag") -> tuple[tuple[int, int, int], ...]:
    """Where rank ``rank``'s local rows sit in the global sequence.

    Returns ``((local_start, global_start, length), ...)``: one segment for ``contiguous``,
    two (the zigzag chunks) for ``zigzag``.
    """
    _check_layout(layout)
    if layout == "contiguous":
        return ((0, rank * seqlen_local, seqlen_local),)
    if seqlen_local % 2:
        raise ValueError(f"zigzag layout needs an even local sequence length, got {seqlen_local}")
    c = seqlen_local // 2
    return ((0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c))


def positions(seqlen_local: int, world_size: int, rank: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global position of every local row (e.g. for rotary embeddings), int64 (seqlen_local,)."""
    parts = [torch.arange(g, g + n, device=device) for _, g, n in segments(seqlen_local, world_size, rank, layout)]
    return torch.cat(parts)


def shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the full-sequence tensor ``x`` (sequence along ``dim``); a copy."""
    _check_layout(layout)
    n = x.shape[dim]
    parts = 2 * world_size if layout == "zigzag" else world_size
    if n % parts:
        raise ValueError(f"{layout} sharding needs seqlen % {parts} == 0 (world_size {world_size}), got seqlen {n}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    chunks = x.chunk(parts, dim=dim)
    if layout == "contiguous":
        return chunks[rank].contiguous()
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from the shards of ranks ``0..world_size-1``."""
    _check_layout(layout)
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    w = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [halves[r][0] for r in range(w)] + [halves[r][1] for r in reversed(range(w))]
    return torch.cat(ordered, dim=dim)


def unshard_gather(x: torch.Tensor, group=None, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The full tensor on every rank from each rank's shard ``x`` (an all-gather; not differentiable)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    bufs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(bufs, x.contiguous(), group=group)
    return unshard(bufs, dim=dim, layout=layout)


def shard_varlen(x: torch.Tensor, cu_seqlens, world_size: int, rank: int, dim: int = 0, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of every packed sequence of ``x`` (``cu_seqlens``: the global
    cumulative lengths), back to back; the local cu_seqlens are ``cu_seqlens // world_size``."""
    bounds = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    parts = [shard(x.narrow(dim, a, b - a), world_size, rank, dim=dim, layout=layout) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=dim)


def unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens, dim: int = 0, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_varlen`, from the shards of ranks ``0..world_size-1``."""
    w = len(shards)
    bounds = [int(c) // w for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    seqs = [unshard([s.narrow(dim, a, b - a) for s in shards], dim=dim, layout=layout) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(seqs, dim=dim)
