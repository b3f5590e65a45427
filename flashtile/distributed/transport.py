"""How ring attention's blocks travel: NCCL point-to-point, or the GPUs' copy engines.

A ring step sends this rank's block (K/V, or the float32 dK/dV accumulators) to rank r + 1 and
receives rank r - 1's, while the step's kernels run on the current stream.  ``ring(group, rank,
world, slot)`` picks the transport (``FLASHTILE_RING_TRANSPORT``: ``nccl``, the default, or
``copy_engine``, experimental):

- ``NcclRing``: ``dist.batch_isend_irecv`` on a side stream.  Any backend (gloo on CPU), any
  topology.  On GPUs NCCL moves the bytes with kernels: they need SMs beside the step's kernel
  (4x H200, 128k causal d=128: ~7 ms of a 70 ms forward and ~17 ms of a 190 ms backward went to
  the transfers although they overlap the compute; NOTES, twenty-sixth session).
- ``PeerRing`` (CUDA, every rank of the group on this host, PyTorch's symmetric memory working
  there): every rank keeps two buffers per block in symmetric memory and *pulls* the previous
  rank's current buffer into its other one with a device-to-device copy, which the copy engines
  carry over NVLink without any SM.  A GPU-side barrier (the symmetric memory's signal pads)
  orders each pull after every rank has finished the step before: the pulled buffer holds the
  block, and the buffer written is no longer read by this rank's kernels or by the next rank's
  pull.  4x H200, 64k causal d=128 (``h200x4-2026-11-28/f``): fwd+bwd 66.6 ms against NCCL's
  69.0, forward 16.2-16.7 against 18.3; the numerics matrix passes on it, bitwise
  deterministic.  Not the default: at 128k its fwd+bwd hung (call f), at its first 2 GiB
  symmetric allocation.  PyTorch 2.11's symmetric memory has no size limit there (its sizes
  are size_t); the likelier cause is that the pools were made in the middle of a ring, with
  another pool's barrier spinning on the GPU, while allocation and rendezvous wait for the
  device (or rendezvous only on the ranks whose memory pool handed out a fresh segment).  So
  a pool is now made with every rank's GPU idle (``_new_pool``: synchronize, group barrier,
  allocate, barrier), the barrier kernel has a timeout (an error instead of a hang), and a
  buffer of 2 GiB or more still takes NCCL (``MAX_PEER_BYTES``, a precaution until measured).

Both keep the interface ``start(tensors, tags) -> received tensors`` (issued before the step's
compute) and ``wait()`` (the current stream waits for the transfer).  Received ``PeerRing``
tensors are the pool's buffers: the next ``start`` may send them as they are (the forward's
K/V), and overwrites them if given other tensors (the backward's dK/dV sums, which have read
them by then); the second ``start`` after always does.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

TRANSPORTS = ("nccl", "copy_engine")
# Symmetric allocations stay below 2 GiB: call f's hang came with the first one of 2 GiB
# (128k dK/dV pool) while every smaller one (up to 1 GiB) worked (a precaution: see above).
MAX_PEER_BYTES = (1 << 31) - 1
# A barrier that waits this long for a peer traps (a CUDA error naming the wait) instead of
# spinning forever; a ring step at 1M tokens on 4 H200s takes about 4 s.
BARRIER_TIMEOUT_MS = 300_000

_STREAMS: dict = {}
_CHECKED: dict = {}  # group key -> whether the copy-engine ring works there
_USED: dict = {}  # group key -> the transports its rings used
_POOLS: dict = {}  # (group key, slot, specs) -> _Pool


def _side_stream(device: torch.device, slot: int):
    key = (device.index if device.index is not None else torch.cuda.current_device(), slot)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=device)
    return _STREAMS[key]


def requested() -> str:
    """``FLASHTILE_RING_TRANSPORT`` (default ``nccl``), checked."""
    name = os.environ.get("FLASHTILE_RING_TRANSPORT", "nccl")
    if name not in TRANSPORTS:
        raise ValueError(f"FLASHTILE_RING_TRANSPORT must be one of {TRANSPORTS}, got {name!r}")
    return name


def _group_key(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


class NcclRing:
    """Send tensors to the next rank and receive same-shaped ones from the previous rank.

    CUDA: ``dist.batch_isend_irecv`` issued on a side stream (after it has waited for the
    producer stream), so the transfer overlaps the compute queued on the current stream;
    ``wait`` makes the current stream wait for it.  CPU: plain ``isend``/``irecv``.
    """

    name = "nccl"

    def __init__(self, group, rank: int, world: int, slot: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
        self.slot = slot
        self._reqs = None
        self._keep = None
        self._stream = None

    def start(self, tensors: list[Tensor], tags: tuple[int, ...]) -> list[Tensor]:
        tensors = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in tensors]
        if tensors[0].device.type == "cuda":
            ops = []
            for t, r, tag in zip(tensors, recvs, tags):
                ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag))
                ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag))
            stream = _side_stream(tensors[0].device, self.slot)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._reqs = dist.batch_isend_irecv(ops)
            self._stream = stream
        else:
            reqs = []
            for t, r, tag in zip(tensors, recvs, tags):
                reqs.append(dist.isend(t, self.next, group=self.group, tag=tag))
                reqs.append(dist.irecv(r, self.prev, group=self.group, tag=tag))
            self._reqs = reqs
            self._stream = None
        self._keep = (tensors, recvs)
        return recvs

    def wait(self) -> None:
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for r in self._reqs:
                    r.wait()
            torch.cuda.current_stream().wait_stream(self._stream)
        else:
            for r in self._reqs:
                r.wait()
        self._reqs = self._keep = None


def _nbytes(shape, dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class _Pool:
    """Two symmetric-memory buffers per block (``specs``: (shape, dtype) per tensor), each its
    own allocation, on every rank of the group; this rank's views, the previous rank's, the
    handle whose signal pad the barrier uses, and whose turn it is."""

    def __init__(self, group, rank: int, world: int, device: torch.device, specs):
        import torch.distributed._symmetric_memory as symm_mem

        prev = (rank - 1) % world
        self.local, self.peer, self.handles = [[], []], [[], []], []
        for parity in (0, 1):
            for shape, dt in specs:
                buf = symm_mem.empty(*shape, dtype=dt, device=device)
                handle = symm_mem.rendezvous(buf, _group_key(group))
                self.local[parity].append(buf)
                self.peer[parity].append(handle.get_buffer(prev, tuple(shape), dt, 0))
                self.handles.append(handle)
        self.handle = self.handles[0]
        self.parity = 0


class PeerRing:
    """The copy-engine ring (see the module docstring)."""

    name = "copy_engine"

    def __init__(self, group, rank: int, world: int, slot: int):
        self.group, self.rank, self.world, self.slot = group, rank, world, slot
        self._stream = None
        self._nccl = None  # blocks of MAX_PEER_BYTES or more: this ring's transfers by NCCL

    def start(self, tensors: list[Tensor], tags: tuple[int, ...]) -> list[Tensor]:
        dev = tensors[0].device
        specs = tuple((tuple(t.shape), t.dtype) for t in tensors)
        if self._nccl is not None or any(_nbytes(*s) > MAX_PEER_BYTES for s in specs):
            # every rank holds the same shapes, so every rank decides the same
            self._nccl = self._nccl or NcclRing(self.group, self.rank, self.world, self.slot)
            _USED.setdefault(_group_key(self.group), set()).add("nccl")
            return self._nccl.start(tensors, tags)
        _USED.setdefault(_group_key(self.group), set()).add("copy_engine")
        key = (_group_key(self.group), self.slot, specs)
        if key not in _POOLS:
            _POOLS[key] = _new_pool(self.group, self.rank, self.world, dev, specs)
        pool = _POOLS[key]
        cur, nxt = pool.parity, 1 - pool.parity
        stream = _side_stream(dev, self.slot)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t, buf in zip(tensors, pool.local[cur]):
                if t.data_ptr() != buf.data_ptr():  # the previous step's received block is already there
                    buf.copy_(t)
            # Every rank: its block for this step in place, and the step before done (its kernels
            # no longer read buffer `nxt`, the next rank's pull out of it has landed).
            pool.handle.barrier(channel=self.slot, timeout_ms=BARRIER_TIMEOUT_MS)
            for dst, src in zip(pool.local[nxt], pool.peer[cur]):
                dst.copy_(src)
        pool.parity = nxt
        self._stream = stream
        return list(pool.local[nxt])

    def wait(self) -> None:
        if self._nccl is not None:
            return self._nccl.wait()
        torch.cuda.current_stream().wait_stream(self._stream)


def _new_pool(group, rank: int, world: int, device: torch.device, specs) -> _Pool:
    """A ``_Pool`` made with every rank's GPU idle.  Symmetric allocation and rendezvous wait for
    the device (a memset, a copy, the memory pool's own frees); made mid-ring, a rank's host could
    wait for its GPU while the GPU's barrier waits for a rank whose host waits in the rendezvous.
    Every rank reaches this at the same point of the same call, so the group barriers match."""
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    pool = _Pool(group, rank, world, device, specs)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return pool


def _copy_engine_works(group, rank: int, world: int, device: torch.device) -> tuple[bool, str]:
    """Whether every rank can use ``PeerRing`` (same host, symmetric memory sets up); collective."""
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    reason = "" if len(set(hosts)) == 1 else "ranks on several hosts"
    if not reason:
        try:
            # kept, never freed: a freed symmetric segment that one rank's pool hands out again
            # skips the rendezvous there while the other ranks wait in theirs
            _POOLS[(_group_key(group), "probe")] = _new_pool(group, rank, world, device, (((1,), torch.float32),))
        except Exception as exc:  # noqa: BLE001 - any failure: ring() names it
            reason = f"symmetric memory unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    flag = torch.tensor([0 if not reason else 1], device=device)
    dist.all_reduce(flag, group=group)
    if int(flag.item()) and not reason:
        reason = "symmetric memory failed on another rank"
    return not reason, reason


def ring(group, rank: int, world: int, slot: int, device: Optional[torch.device] = None):
    """The transport for one ring of ``group`` (``slot``: 0 for K/V, 1 for dK/dV):
    ``PeerRing`` on CUDA when ``FLASHTILE_RING_TRANSPORT=copy_engine`` (checked once per
    group; a named error if it cannot work there), else ``NcclRing``."""
    want = requested()
    if device is None or device.type != "cuda":
        return NcclRing(group, rank, world, slot)
    key = _group_key(group)
    if want == "nccl":
        _USED.setdefault(key, set()).add("nccl")
        return NcclRing(group, rank, world, slot)
    if key not in _CHECKED:
        ok, reason = _copy_engine_works(group, rank, world, device)
        if not ok:
            raise RuntimeError(f"FLASHTILE_RING_TRANSPORT=copy_engine: {reason}")
        _CHECKED[key] = ok
    return PeerRing(group, rank, world, slot)


def chosen(group=None) -> Optional[str]:
    """The transports ``group``'s CUDA rings used ("nccl", "copy_engine" or both joined by
    "+"), None before the first."""
    if not dist.is_initialized():
        return None
    used = _USED.get(_group_key(group))
    return "+".join(sorted(used)) if used else None
