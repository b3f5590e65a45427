"""Tile configurations: the one table that says which tiles each kernel runs with.

Keyed by (pass, head dim bucket, dense or packed batch; arch, dtype and mask kind where a
measurement asked for it: today one architecture, sm_90a, and no dtype or mask kind has
measured a different best tile).  Everything about tile choice lives here; the builders take
the numbers as arguments and the launcher (``launch.py``) asks ``fwd_config`` /
``bwd_config`` / ``bwd_dq_config``.  Each config names the builder it runs with
(``Config.builder``, resolved by ``builder``).  Numbers come from measurements on the device
(``benchmarks/NOTES.md``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

ARCH = "sm_90a"
# Head dims the kernels are built for (other dims are zero-padded up, ``kernel_headdim``): the
# QK^T GEMM's K and the PV GEMM's N must be multiples of 16 for WGMMA, and the backward's K and
# dO tiles at an odd multiple of 16 (48, 80, 112, ...) get two conflicting shared-memory layouts
# in TileLang 0.1.15 ("Get different layout for k_s"), so the backward takes multiples of 32.
# Larger than 256 does not fit the register file.  FP8 ("fwd8"): an FP8 WGMMA's K slice is 32
# elements, so q/k head dims are multiples of 32 (v's stays 16: it is the P V GEMM's N).
HEADDIM_STEP = {"fwd": 16, "bwd": 32, "fwd8": 32}
MAX_HEADDIM = 256
DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn  # forward only (``operands``)
MASK_KINDS = ("full", "local")  # local = causal and/or sliding window


def _builder_kwargs(config, skip: tuple, added_flags: tuple) -> dict:
    """A config's fields as its builder's keyword arguments, without those in ``skip`` (not the
    builder's).  A flag in ``added_flags`` is left out while off, so the kernels built before it
    existed keep their structure ids' arguments (and their disk-cache entries)."""
    return {k: v for k, v in asdict(config).items() if k not in skip and (v or k not in added_flags)}


@dataclass(frozen=True)
class FwdConfig:
    block_m: int  # query rows per CTA (64 per consumer warpgroup)
    block_n: int  # keys per main-loop step
    num_stages: int  # K/V shared-memory pipeline depth
    threads: int  # consumer threads (auto warp specialisation adds a producer warpgroup)
    manual_ws: bool = False  # hand-written warp specialisation (kernels/fwd_ws.py), not the builder's
    pingpong: bool = False  # hand-written only: consumer warpgroups take turns issuing GEMMs
    tiles_per_cta: int = 1  # hand-written only: 1 one tile, 2 a pair of tiles, 0 persistent pairs
    skip_rescale: bool = False  # hand-written only: O *= alpha only in warps where a row's max moved (fwd_ws.rescaler)
    defer_sum: bool = False  # hand-written only: per-thread partial row sums, one all-reduce per tile (softmax.online_softmax)
    # hand-written one-tile only: built without TileLang's sync pass, the epilogue's syncs written
    # out (the paired schedule's); the sync pass cannot lower FP8 key blocks of 160-256 keys
    explicit_syncs: bool = False
    # hand-written only: the producer holds the tile's coordinates (heads, batch entry, key
    # range) in registers instead of re-deriving them, integer divisions included, for every
    # K/V load (NOTES prediction 9: on in the rows it made faster, ``_fwd_row``)
    producer_regs: bool = False
    # hand-written with pingpong only (not measured yet, NOTES prediction 11): the turns guard each
    # key block's softmax (1) or only its exponentials and row sums (2, where cuDNN's forward puts
    # them) instead of the GEMM issues (``fwd_ws.gemm_turns``)
    softmax_turns: int = 0

    def as_kwargs(self) -> dict:
        hand_written_only = ("manual_ws",) if self.manual_ws else ("manual_ws", "pingpong", "tiles_per_cta", "skip_rescale",
                                                                  "defer_sum", "explicit_syncs", "producer_regs",
                                                                  "softmax_turns")
        return _builder_kwargs(self, hand_written_only, added_flags=("producer_regs", "softmax_turns"))

    @property
    def builder(self) -> str:
        if not self.manual_ws:
            return "fwd.attention_fwd_kernel"
        # Two compilations of one builder (see fwd_ws.py's end).
        one_tile_with_sync_pass = self.tiles_per_cta == 1 and not self.explicit_syncs
        return "fwd_ws.attention_fwd_ws_tile_kernel" if one_tile_with_sync_pass else "fwd_ws.attention_fwd_ws_kernel"


@dataclass(frozen=True)
class BwdConfig:
    block_n: int  # keys per CTA (dK/dV rows kept in registers)
    block_m: int  # query rows per main-loop step
    num_stages: int
    threads: int
    overlap: bool = False  # S^T and dP^T as async WGMMA, P computed while dP^T runs
    manual_ws: bool = False  # hand-written warp specialisation (kernels/bwd_ws.py), not the builder's
    dq_turns: bool = False  # hand-written only: the consumer warpgroups take turns computing dQ
    persistent: bool = False  # hand-written only: one CTA per SM walks the key tiles by ticket
    dq_regs: bool = False  # builder only: dQ reduce-added from registers, no shared-memory dQ tile
    # hand-written only (not measured yet, NOTES prediction 10): the loader and dQ writer warps
    # step each step's (query head, first row) in registers instead of re-deriving them, two
    # integer divisions by the tile's block count included, after every barrier wait
    producer_regs: bool = False
    # d = 256 only (kernels/bwd_wide.py, not in the table until measured: NOTES, forty-second
    # session): both consumer warpgroups compute the whole S^T / dP^T and each owns a column half
    # of dK, dV and dQ, instead of the builder's split of S^T's columns.
    replicate_scores: bool = False

    def as_kwargs(self) -> dict:
        if self.replicate_scores:
            return _builder_kwargs(self, ("manual_ws", "dq_turns", "persistent", "dq_regs", "producer_regs",
                                          "replicate_scores"), added_flags=())
        skip = ("manual_ws", "dq_regs") if self.manual_ws else ("manual_ws", "dq_turns", "persistent", "producer_regs")
        return _builder_kwargs(self, skip, added_flags=("dq_regs", "producer_regs", "replicate_scores"))

    @property
    def builder(self) -> str:
        if self.replicate_scores:
            return "bwd_wide.attention_bwd_dkdv_wide"
        if self.manual_ws:
            return "bwd_ws.attention_bwd_dkdv_ws"
        return "bwd.attention_bwd_dkdv_regs" if self.dq_regs else "bwd.attention_bwd_dkdv"


@dataclass(frozen=True)
class DqConfig:
    block_m: int  # query rows per CTA (dQ rows kept in registers)
    block_n: int  # keys per main-loop step
    num_stages: int
    threads: int
    manual_ws: bool = False  # hand-written warp specialisation (kernels/bwd_ws.py), not the builder's

    def as_kwargs(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "manual_ws"}

    @property
    def builder(self) -> str:
        return "bwd_ws.attention_bwd_dq_ws" if self.manual_ws else "bwd.attention_bwd_dq"


def builder(config):
    """The ``@tilelang.jit`` builder a config names (``"module.function"`` in this package), as a
    ``cache.BuilderRef``: its module is imported only when the kernel must be built."""
    from .cache import BuilderRef

    return BuilderRef(config.builder)


# Tuning hook (benchmarks/tune.py): pass name -> config that replaces the table's answer;
# "fwd_flags" / "bwd_flags": {field: value} set on the table's hand-written configs of the pass.
overrides: dict[str, object] = {}

# Developer switches that run the GPU suite, precompile and benchmarks with a candidate flag on
# every hand-written row of a pass (worker processes inherit them): variable -> (overrides key,
# boolean fields, count fields with their values).  While one is set the launcher does not
# memoise its kernel choice (``launch._memoised``: overrides may change).
ENV_FLAGS = {
    "FLASHTILE_FWD_FLAGS": ("fwd_flags", {"pingpong", "skip_rescale", "defer_sum", "producer_regs"},
                            {"tiles_per_cta": ("0", "1", "2"),  # 0 persistent, 1 one tile a CTA, 2 a pair
                             "softmax_turns": ("0", "1", "2")}),  # 1 the softmax, 2 its exponentials
    "FLASHTILE_BWD_FLAGS": ("bwd_flags", {"producer_regs", "replicate_scores"}, {}),
}


def _env_flags(var: str, text: str) -> dict:
    """``FLASHTILE_FWD_FLAGS="pingpong=0,skip_rescale=1"`` -> {"pingpong": False, ...}
    (``ENV_FLAGS`` names each variable's fields)."""
    _, fields, counts = ENV_FLAGS[var]
    flags = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name in counts and value in counts[name]:
            flags[name] = int(value)
            continue
        if name not in fields or value not in ("0", "1"):
            also = "".join(f", or {n}={'|'.join(v)}" for n, v in counts.items())
            raise ValueError(f"{var}: {item!r} is not <flag>=0|1 with a flag in {sorted(fields)}{also}")
        flags[name] = value == "1"
    return flags


for _var, (_key, *_) in ENV_FLAGS.items():
    if os.environ.get(_var):
        overrides[_key] = _env_flags(_var, os.environ[_var])


def kernel_headdim(dim: int, pass_: str) -> int:
    """The kernel head dim that serves a user head dim in ``pass_`` ("fwd" or "bwd"): the next
    multiple of ``HEADDIM_STEP[pass_]``.

    Zero columns change no score (q . k sums over them) and add output columns that are cut
    off, so e.g. d=40 (Stable Diffusion) runs the d=48 forward and the d=64 backward on
    zero-padded copies; the softmax scale stays the caller's (1/sqrt(40) by default)."""
    step = HEADDIM_STEP[pass_]
    return -(-dim // step) * step


def kernel_headdims(dim: int, dim_v: int, pass_: str) -> tuple[int, int]:
    """``kernel_headdim`` of both head dims (q/k's and v's; FP8's v follows the forward's step)."""
    return kernel_headdim(dim, pass_), kernel_headdim(dim_v, "fwd" if pass_ == "fwd8" else pass_)


def mask_kind(window: tuple[int, int]) -> str:
    return "full" if window == (-1, -1) else "local"


# Dense forwards whose query and key lengths are both at most this (per head dim) take
# ``short_forward``'s tiles.
SHORT_SEQLEN = {64: 1024, 256: 512}
# FP8 forwards take the short row when either length (head dims in ``FP8_SHORT_EITHER``) or
# both lengths (the others: d = 64's pairs were timed on square shapes only) are at most this.
FP8_SHORT_SEQLEN = {128: 4095, 64: 1024}
FP8_SHORT_EITHER = frozenset({128})


def short_forward(dim: int, dim_v: int, seqlen_q: int, seqlen_k: int, fp8: bool = False) -> bool:
    """Whether a dense forward takes the short-sequence row of ``fwd_config`` (a runtime choice
    between two compiled kernels): d = 64 or d = 256 with both lengths <= ``SHORT_SEQLEN[d]``;
    FP8 (``fp8``) d = 128 with either length and d = 64 with both lengths <= ``FP8_SHORT_SEQLEN[d]``.

    d = 64: such tiles see at most 8 key blocks, too few to amortise a one-tile CTA's launch, Q
    load and epilogue (29% of the warp samples at 1k causal: NOTES, eleventh session), so they
    run the d=128 row's persistent pairs of 128-row tiles instead of one 192-row tile per CTA.
    H100 (``h100-2026-11-27b/c1``: ``tune.py fwd --headdim 64``, bf16, 16k tokens x 32 heads; ms,
    192-row tile / 128-row persistent, two rounds): 512 full 0.252 / 0.224-0.229, causal
    0.248 / 0.185; 1k full 0.404 / 0.394-0.396, causal 0.309 / 0.262-0.264; 2k full 0.660 /
    0.724 (worse), causal 0.422 / 0.426 (equal): hence the bound.

    d = 256: 64-key blocks instead of 80.  H100 (``h100-2026-11-27c/tune_final.txt``, ratio to
    cuDNN, three rounds, 128x80 / 128x64): 512 full 0.841-0.858 / 0.866-0.870, causal
    0.854-0.858 / 0.874-0.878; 1k full 0.897-0.918 / 0.885-0.904 (worse), causal 0.836-0.858 /
    0.853-0.862 (better); 2k full 0.913-0.971 / 0.886-0.908: hence 512.

    Head dims below 64 (zero-padded to 16, 32 or 48) and 192/128 keep their one kernel: the
    short rows are not measured there.

    FP8 (``fp8``), d = 128: the persistent pairs of 128 x 128 tiles unless both lengths are at
    least 4096, where one 192 x 96 tile per CTA on three consumer warpgroups is the long row.
    H200 (``h200-2026-11-28g/a``, ``b``, ``c``: ``tune.py fwd --fp8``, 16k tokens x 16 heads, ms,
    pairs / 192 x 96, interleaved rounds of three device calls): 1k full 0.260 / 0.290, causal
    0.198 / 0.229; 2k full 0.424 / 0.427, causal 0.276 / 0.297; 4k full 0.748-0.755 /
    0.735-0.753, causal 0.439-0.440 / 0.440-0.444; 16k full 2.684-2.770 / 2.620-2.702, causal
    1.417-1.437 / 1.336-1.385; GQA 4:1 4k full 0.726 / 0.714, 16k causal 1.419 / 1.337.  Both
    lengths: the 192-row tiles lose where a tile's key loop is short (the pairs overlap a
    tile's end with the next tile's start) and where the last tile of a row is mostly empty.

    FP8 d = 64: the same 128 x 128 pairs (with ``producer_regs``) when both lengths are at most
    1024, one 192 x 128 tile per CTA otherwise.  H100 (``tune.py fwd --fp8 --headdim 64``, 16k
    tokens x 32 heads, ms, 192 x 128 / pairs, two interleaved rounds in each of two sessions;
    ``h100-2026-12-07c/t`` and ``h100-2026-12-07e/w``, the second with the FP8 GPU tests passing
    under both rows): 1k full 0.407-0.416 / 0.396-0.408, causal 0.339-0.341 / 0.298-0.300; 2k
    full 0.605-0.617 / 0.659-0.660, causal 0.428 / 0.432; 4k full 1.048-1.049 / 1.189-1.191,
    causal 0.631-0.641 / 0.703-0.706; 16k 12-21% slower: hence 1024."""
    if fp8:
        bound = FP8_SHORT_SEQLEN.get(dim, 0) if dim == dim_v else 0
        length = min(seqlen_q, seqlen_k) if dim in FP8_SHORT_EITHER else max(seqlen_q, seqlen_k)
        return bound > 0 and length <= bound
    bound = SHORT_SEQLEN.get(dim, 0) if dim == dim_v else 0
    return seqlen_q <= bound and seqlen_k <= bound


def has_short_row(dim: int, dim_v: int, varlen: bool, fp8: bool = False) -> bool:
    """Whether a forward structure has a second kernel for short sequences (``short_forward``
    says short for some lengths): what precompile and the sanitizer build beside the long one.
    Packed batches have one kernel."""
    return not varlen and short_forward(dim, dim_v, 1, 1, fp8)


def fwd_config(dim: int, dim_v: int, dtype: torch.dtype, kind: str, varlen: bool = False,
               short: bool = False) -> FwdConfig:
    """Forward tiles.  128 query rows = two consumer warpgroups of 64 rows each; the key
    block shrinks with the head dim so K/V stages plus the output tile fit in 228 KB of
    shared memory and S/P plus O fit in the register file.  Packed (``varlen``) batches run
    one tile per CTA: the persistent walk pairs mirror blocks of a row and needs every row's
    block count, which a packed batch only has on the device.  ``short``: a dense batch that
    ``short_forward`` says is short."""
    if "fwd" in overrides:
        return overrides["fwd"]
    config = _fwd_row(dim, dim_v, dtype, kind, varlen, short)
    if overrides.get("fwd_flags") and config.manual_ws:  # the tuning hook's flags over the table's rows
        return replace(config, **overrides["fwd_flags"])
    return config


def _fwd_row(dim: int, dim_v: int, dtype: torch.dtype, kind: str, varlen: bool, short: bool) -> FwdConfig:
    """``fwd_config``'s table (rows derived from other rows read the table itself, so the tuning
    hook's flags are set once, by ``fwd_config``)."""
    if dtype in (FP8_DTYPE, "float8_e4m3fn"):
        return fp8_fwd_config(dim, dim_v, varlen, short)
    if varlen:
        return replace(_fwd_row(dim, dim_v, dtype, kind, False, False), tiles_per_cta=1)
    # ``producer_regs`` in every bf16/fp16 row: H100 same-run A/B, two rounds (h100-2026-12-07c/r,
    # NOTES prediction 9), d = 64 short row (full without turns, causal with) 1k -5%, 4k -2 to
    # -5%; d = 64 long row 4k/16k -0 to -5%; d = 128 4k -1 to -2%, 16k -2 to -5% causal (full
    # mixed, 3.52/3.70 -> 3.67/3.64 ms); one-tile rows: d = 128 1k -9 to -13%, 4k -5 to -7%,
    # d = 256 1k -4%, 4k -1 to -6%, 16k causal -4 to -6% (full mixed).
    widest = max(dim, dim_v)
    if short and widest <= 64:
        # The persistent 128-row pairs (``short_forward``) with partial row sums; without
        # pingpong turns for full attention.  H200 (h200-2026-11-28i/c, 1k, ms, two rounds,
        # turns / none): full 0.384-0.386 / 0.371, causal 0.258-0.259 / 0.271-0.272.
        return replace(_fwd_row(128, 128, dtype, kind, False, False), defer_sum=True, pingpong=kind != "full")
    if short:  # d = 256 (``short_forward``): the long row's schedule (its rescale skip too) with 64-key blocks
        return FwdConfig(block_m=128, block_n=64, num_stages=2, threads=256, manual_ws=True, pingpong=True, skip_rescale=True,
                         producer_regs=True)
    if widest <= 64:
        # Three consumer warpgroups (192 rows amortise each K/V tile over more of the short
        # d=64 GEMMs), hand-written with pingpong turns.  H100 (h100-2026-11-22/fwd-pingpong):
        # 4k 1.24 ms against 1.31 for the auto-pipelined 192x128 and 1.28 without pingpong,
        # 16k -4%, GQA 4:1 4k -5% (causal -4%); 128 rows is 7-15% slower except at 1k causal.
        # One tile per CTA: the persistent walk spills here (160 registers a thread), 6-10% slower.
        # Per-thread partial row sums (``defer_sum``: no row all-reduce per block), H200
        # (h200-2026-11-28i/c, ms, two rounds): 4k full 1.259-1.270 -> 1.213-1.240, causal
        # 0.698-0.709 -> 0.683-0.699; the short row's 128-row pairs at 1k full 0.395 -> 0.384-0.386,
        # causal 0.262-0.263 -> 0.258-0.259.  At d = 128 (1k +1 to +3%) and in the FP8 d = 128
        # rows (+1 to +3%) they were slower, so only here.
        return FwdConfig(block_m=192, block_n=128, num_stages=2, threads=384, manual_ws=True, pingpong=True,
                         defer_sum=True, producer_regs=True)
    if widest <= 128:
        # Hand-written (softmax overlapped with the GEMMs), pingpong turns, persistent: one CTA
        # per SM walks pairs of query tiles, each tile's last P V and epilogue under the next
        # tile's first S GEMM.  H100 d=128 (h100-2026-11-22/fwd-persistent), against one tile
        # per CTA: 1k -5/-8% (full/causal), 4k -1/-4%, GQA 4:1 4k -2/-6%, 8k -1 to -3%, 16k
        # within noise.  Pingpong alone: causal 4k -2%.  128x176 within noise of 128x128;
        # 128x64x3 and 192x128 slower (192 rows spill at d > 64).
        return FwdConfig(block_m=128, block_n=128, num_stages=2, threads=256, manual_ws=True, pingpong=True, tiles_per_cta=0,
                         producer_regs=True)
    # d=192/256: 80 keys per step, two stages (FA3's tile): H200 d=256 4k 0.94/0.92x cuDNN,
    # against 0.84/0.85x with 64 keys.  Hand-written with pingpong turns, one tile per CTA (Q,
    # two K/V stages and the output fill shared memory, so no second Q buffer for the persistent
    # walk).  H100 d=256 (h100-2026-11-22/fwd-d256): 1-4% faster than the auto-pipelined kernel
    # at every seqlen 1k-16k, causal or not (before pingpong it measured -5% at 16k).  O *= alpha
    # skipped in warps whose max did not move (``fwd_ws.rescaler``; 128 accumulator values a
    # thread against 40 scores): H100 (h100-2026-11-28c/c3) -1 to -4% at 4k/16k, where d=64's
    # and the FP8 rows' timings were mixed or slower, so they multiply every block.
    return FwdConfig(block_m=128, block_n=80, num_stages=2, threads=256, manual_ws=True, pingpong=True, skip_rescale=True,
                     producer_regs=True)


def fp8_fwd_config(dim: int, dim_v: int, varlen: bool = False, short: bool = False) -> FwdConfig:
    """FP8 forward tiles: the hand-written kernel with the bf16 rows' schedules (persistent pairs
    at d <= 128 for dense batches, except d = 128's long sequences).  Key blocks are multiples
    of 32 (P is the P V GEMM's A operand, K-sliced by 32 in FP8).  FP8 halves Q/K/V's shared memory, so d=256 takes 128 keys where bf16
    takes 80.  ``short`` (``short_forward``): d = 64's and d = 128's dense row for short
    sequences, the 128 x 128 pairs; d = 128's long one is 192 x 96 on three consumer warpgroups (192 x 128 spills their 160 registers a
    thread; the persistent pairs spill at 192 x 96).  128 x 160 persistent pairs: 3-10% slower
    than either d = 128 row (H100, h100-2026-12-07/c).  P's row sums on the tensor cores (a
    WGMMA of P with a tile of ones beside P V, no FADD per weight) were 1-5% faster at d = 128
    but sum P after its e4m3 rounding: the lse came out 1-2% off (NOTES, thirty-second and
    thirty-third sessions); removed.  ``producer_regs`` (H100 A/B, h100-2026-12-07c/r): on in the
    d = 128 rows (192 x 96: 0 to -3%; 128 x 128 pairs: -2 to -4% at 1k-16k); off at d = 256, where
    it was 1-3.5% slower at 4k/16k in both rounds, and in d = 64's long 192 x 128 row, where it
    was level (h100-2026-12-07c/t, two rounds: 1k/4k +-1%, 16k -0.3%)."""
    widest = max(dim, dim_v)
    if widest <= 64 and not short:  # short (once FP8_SHORT_SEQLEN holds d = 64): d = 128's pairs below
        return FwdConfig(block_m=192, block_n=128, num_stages=2, threads=384, manual_ws=True, pingpong=True)
    if (dim, dim_v) == (128, 128) and not varlen and not short:
        return FwdConfig(block_m=192, block_n=96, num_stages=2, threads=384, manual_ws=True, pingpong=True,
                         producer_regs=True)
    if widest <= 128:
        return FwdConfig(block_m=128, block_n=128, num_stages=2, threads=256, manual_ws=True, pingpong=True,
                         tiles_per_cta=1 if varlen else 0, producer_regs=True)
    return FwdConfig(block_m=128, block_n=128, num_stages=2, threads=256, manual_ws=True, pingpong=True)


def bwd_config(dim: int, dim_v: int, dtype: torch.dtype, kind: str, has_softcap: bool = False,
               varlen: bool = False) -> BwdConfig:
    """Backward tiles.  dK and dV accumulators (2 x block_n x dim fp32) live in registers, so
    the key block shrinks as the head dim grows."""
    if "bwd" in overrides:
        return overrides["bwd"]
    config = _bwd_row(dim, dim_v, has_softcap)
    flags = dict(overrides.get("bwd_flags") or {})  # the developer switch's flags over the table's rows
    # replicate_scores: the d = 256 kernel of bwd_wide.py, on the rows it serves (d = d_v = 256,
    # no softcap: the builder's 64 x 64 one-stage row); the other flags: hand-written rows.
    if flags.pop("replicate_scores", False) and (dim, dim_v) == (256, 256) and not has_softcap:
        return replace(config, replicate_scores=True)
    if flags and config.manual_ws:
        return replace(config, **flags)
    return config


def _bwd_row(dim: int, dim_v: int, has_softcap: bool) -> BwdConfig:
    """``bwd_config``'s table."""
    widest = max(dim, dim_v)
    if widest <= 128:
        # Hand-written warp specialisation (bwd_ws.py, every GEMM async): H200 d=128 4k 2.80-2.85
        # ms against 3.23-3.31 for the auto-pipelined kernel with S^T/dP^T async (0.95-0.99x
        # cuDNN), d=64 -21%.  Earlier sweeps of the auto kernel: 64x64/128 threads 0.45x,
        # 128x32 0.53x (dQ GEMM M=32 cannot use WGMMA), 64x128 does not fit shared memory, 1 or
        # 3 stages slower.  Softcap keeps the synchronous auto kernel: its tanh tile spills 272
        # bytes in the hand-written one (80 in the synchronous one, 124 with async S^T/dP^T).
        if has_softcap:
            return BwdConfig(block_n=128, block_m=64, num_stages=2, threads=256)
        # d <= 96: each step's dQ tile by one warpgroup in turn (``dq_turns``).  H100
        # (h100-2026-11-24b/c1, c4): d=64 +7-12% dense (4k full 3.80 -> 3.41 ms), packed +4-10%;
        # d=96 +2-7%; d=128 17% slower (one warpgroup's 64 x 128 dQ turn is twice as long as the
        # split's, and the two-stage ring cannot let the other warpgroup run that far ahead).
        # d <= 96 (where two K/V buffers fit beside the rings): a persistent CTA per SM takes
        # key tiles by ticket and loads the next tile's K/V under this one's steps, instead of
        # a CTA per tile paying its launch, (packed) sequence search and K/V load up front.
        # H100 (h100-2026-11-24c/c1), packed d=64: 64 x 64..1024 causal +8.7%, full +5%, long
        # batches +1-4%; d=96 +2-5%.
        return BwdConfig(block_n=128, block_m=64, num_stages=2, threads=256, overlap=True, manual_ws=True,
                         dq_turns=widest <= 96, persistent=widest <= 96)
    # d=256: 64 keys, two warpgroups splitting columns: 0.85x cuDNN at 4k (one warpgroup
    # holding all of dK and dV spilled 2 KB and ran at 0.32-0.38x).  One stage: two stages of
    # Q / dO do not fit beside the 64 KB fp32 dQ tile, and making room (dQ reduce-added in four
    # column chunks) or taking 32-query steps (N = 16 WGMMAs reading K / V from shared memory)
    # measured 13-31% / 24-33% slower (H100, h100-2026-12-07/c).  S^T and dP^T async
    # (``overlap``) was 1-3% faster there in both rounds of 4k / 16k, full and causal, and
    # passed the whole GPU suite (h100-2026-12-07/w: d = 192 and the softcap / GQA /
    # deterministic variants included).  dQ reduce-added from registers (``dq_regs``, which
    # frees the 64 KB dQ tile for a second Q / dO stage) measured 15-25% slower with one or
    # two stages in all eight timings (H100, h100-2026-12-07b/c, NOTES prediction 8): the
    # second stage changed nothing, the per-lane reductions cost it.
    return BwdConfig(block_n=64, block_m=64, num_stages=1, threads=256, overlap=True)


def sharing_sms(config):
    """``config`` for a call that runs beside other kernels (ring attention: the next K/V
    block's NCCL transfer): no persistent schedule.  A persistent CTA holds its SM for the whole
    call, so a kernel launched beside it gets no SM until the call ends; one tile (forward) or
    key block (backward) per CTA frees SMs as CTAs retire.  4x H200, ring attention 128k causal
    d=128 (h200x4-2026-11-28/c): forward 78-86 ms persistent, 69 one tile per CTA (without the
    transfers 62-63); leaving 4/8/16 SMs to a persistent grid: 80/82/72 ms."""
    if isinstance(config, FwdConfig) and config.manual_ws and config.tiles_per_cta != 1:
        return replace(config, tiles_per_cta=1)
    if isinstance(config, BwdConfig) and config.persistent:
        return replace(config, persistent=False)
    return config


def dkdv_rows_per_group(kind: str, groups: int, rows: int, key_blocks: int, sm_count: int) -> int:
    """Launch order of the dK/dV kernel's CTAs (``schedule.grouped_tile``): how many (batch,
    kv head) rows are walked key-block-major at a time.  A runtime choice (no recompilation).

    Under a causal or window mask with GQA, a row's CTAs differ in length by up to the row's
    key-block count and each is ``groups`` query heads long, so row by row the last rows' long
    CTAs start late and the grid ends on their tail.  Walking one wave's worth of rows
    longest-first fixes that without spreading concurrent CTAs over more rows' Q/dO than L2
    holds.  H100, d=128, GQA 4:1 causal (``h100-2026-11-22/bwd-row-groups``): 4k 1.83 -> 1.62-1.66
    ms with 4 rows, 8k 3.21-3.38 -> 3.04-3.23 ms with 2-4; 16k (128 blocks, a wave per row)
    is best row by row.  MHA: 4 rows equal at 4k and 12% slower at 16k, so row by row."""
    if "dkdv_rows" in overrides:
        return min(overrides["dkdv_rows"], rows)
    if kind == "full" or groups == 1:
        return 1
    return max(1, min(rows, sm_count // max(key_blocks, 1)))


def head_group(dim: int, kind: str) -> int:
    """Launch order of the one-tile forward grids and of the packed dK/dV grid
    (``seqinfo.Sequences.tile``): how many heads of a batch entry are walked block-major at a
    time.  A runtime choice (no recompilation).

    CTAs start in launch order as SMs free up; head by head, every head starts on its longest
    (last) causal tile and ends on its shortest, so the last waves mix long and short tiles.
    A group of heads walked block-major starts all its longest tiles first.  A list-scheduling
    model put the packed bench batches at 0.963 -> 0.986-0.997 of the ideal balance under a
    causal mask with 4-8 heads per group, dense d=64 causal 4k/16k 0.93/0.96 -> 0.97/0.99 at 8.
    Measured on an H100 (``benchmarks/h100-2026-11-24/c4``, dense, groups of 512 // d heads for
    every mask): d=64 causal 4k/16k +2.3/+2.5%, 1k/2k within noise; full attention 1-5% slower
    (d=256 full -3 to -5%: a group's K/V spread over more than L2 keeps), d=256 causal mixed.
    So: causal and windowed masks only, 512 // d heads (the group's K/V for a 4k sequence is
    then 8 MB), none past d=128."""
    if "head_group" in overrides:
        return overrides["head_group"]
    if kind == "full" or dim > 128:
        return 1
    return 512 // dim


def bwd_dq_config(dim: int, dim_v: int, dtype: torch.dtype, has_softcap: bool = False) -> DqConfig:
    """Tiles of the deterministic dQ kernel (query-block major, like the forward)."""
    if "bwd_dq" in overrides:
        return overrides["bwd_dq"]
    widest = max(dim, dim_v)
    if widest <= 128:
        # Hand-written (bwd_ws.attention_bwd_dq_ws), 128 keys per step: H200 4k d=64 4.21-4.34
        # vs 4.81-4.84 ms with 64 keys, d=128 3.24-3.30 vs 3.40-3.42 ms (deterministic backward
        # 1.15-1.18x the default mode's time); the auto-pipelined kernel was 4-5% slower still.
        # Softcap's tanh tile does not fit beside 128 keys: 64.
        return DqConfig(block_m=128, block_n=64 if has_softcap else 128, num_stages=2, threads=256, manual_ws=True)
    return DqConfig(block_m=64, block_n=64, num_stages=1, threads=128)


def all_structures():
    """Every (dim, dim_v, dtype, kind) the test suite builds on CPU: one per table row, per
    dtype and mask kind, plus the d != d_v case."""
    dims = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
    for dim, dim_v in dims:
        for dtype in DTYPES:
            for kind in MASK_KINDS:
                yield dim, dim_v, dtype, kind
