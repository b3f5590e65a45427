"""What a forward kernel's operands are stored in: 16-bit, or FP8 (float8_e4m3fn) with descales.

One object, ``Operands``, answers every question a forward builder asks about element types,
so FP8 is a parameter of the forward kernels, not a fork of them:

* 16-bit (fp16/bf16): q, k, v and out share one dtype; P is cast to that dtype in registers
  and ``O += P V`` reads V tiles ``[block_n, dim_v]`` as they sit in memory.
* FP8 (FlashAttention-3's convention, ``flashtile.fp8``): q, k, v are float8_e4m3fn with float32
  descales per (batch entry, kv head); out is bf16 or fp16.  Hopper's FP8 WGMMA reads both
  operands K-major, which for ``O += P V`` means V^T: the host pre-pass ``transpose_v`` writes V
  as (batch, kv head, dim_v, keys) and the kernel reads ``[dim_v, block_n]`` tiles.  P is
  quantized in registers, scaled by ``2**P_OFFSET`` so the largest weight of a row is 256, not 1
  (e4m3 then keeps weights down to 2**-17 of the row maximum instead of flushing those below
  2**-9; FlashAttention-3 does the same).

Why the pre-pass also permutes keys: the FP8 WGMMA's register layout of its A operand (P) is
not the layout in which the previous WGMMA left S.  Within each group of 16 key columns a
thread holds S columns {2q, 2q+1, 2q+8, 2q+9} but must supply P columns {4q .. 4q+3}
(q = lane % 4).  Instead of moving data between threads, the kernel names its own S registers
as P columns (``cast_p``: P column j = S column ``KEY_OF_COLUMN(j)``), and the pre-pass stores
V^T's column j as key ``KEY_OF_COLUMN(j)`` of the same 16-key group, so P V sums the same
products.  Groups start at multiples of 16 keys of each sequence (packed batches: ``v_offsets``).

The descales travel in the kernels' float32 ``Sinks`` argument after the sinks (``params``), so
an FP8 kernel has the 16-bit kernel's argument list; only V's shape differs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..lazy import LazyAttributes

T = LazyAttributes("tilelang.language")  # imported by the first kernel build, not by the launcher (``lazy``)

FP8 = "float8_e4m3fn"
P_OFFSET = 8.0  # FP8: P = exp2(score - row max + 8), at most 256 (e4m3 max 448)
GROUP = 16  # keys per permutation group (one FP8 WGMMA K-slice of P's register layout)


def key_of_column(j):
    """The key (within its 16-key group) that P / V^T column ``j`` holds (FP8); works on ints
    and TileLang expressions: columns (q, a, c) = 4q + 2a + c hold keys 8a + 2q + c."""
    return j // GROUP * GROUP + (j % 4 // 2) * 8 + (j % GROUP // 4) * 2 + j % 2


class Operands:
    """Element types of one forward kernel: ``dtype`` of q/k/v, ``out_dtype`` of O (None: dtype)."""

    def __init__(self, dtype: str, out_dtype: Optional[str] = None):
        self.fp8 = dtype == FP8
        self.dtype = dtype
        self.out_dtype = out_dtype or ("bfloat16" if self.fp8 else dtype)
        self.p_offset = P_OFFSET if self.fp8 else 0.0

    # --- shapes -------------------------------------------------------------------------------
    def v_tile(self, block_n: int, dim_v: int) -> list:
        """Shape of one V tile in shared memory."""
        return [dim_v, block_n] if self.fp8 else [block_n, dim_v]

    def v_tensor(self, batch, keys, nheads_kv, dim_v) -> list:
        """Shape of the kernel's V argument (``keys``: the key extent of that tensor)."""
        return [batch, nheads_kv, dim_v, keys] if self.fp8 else [batch, keys, nheads_kv, dim_v]

    # --- tile regions and in-kernel steps -----------------------------------------------------
    def v_rows(self, seq, V, n0, block_n: int, hk):
        """Keys [n0, n0 + block_n) of kv head ``hk``: a V tile (FP8: a V^T tile)."""
        return seq.v_cols(V, n0, block_n, hk) if self.fp8 else seq.k_rows(V, n0, block_n, hk)

    def p_caster(self, block_m: int, block_n: int):
        """Macro ``cast_p(s, p)``: weights ``s`` (fp32) -> P fragment ``p``.  FP8: column j
        takes key ``key_of_column(j)``, an S register the same thread holds (no data moves
        between threads; TileLang proves the two fragment layouts agree on the thread)."""
        fp8, p_dtype = self.fp8, self.dtype

        @T.macro
        def cast_p(s, p):
            if fp8:
                for i, j in T.Parallel(block_m, block_n):
                    p[i, j] = T.cast(s[i, key_of_column(j)], p_dtype)
            else:
                T.copy(s, p)

        return cast_p


def tile_scales(ops: Operands, Params, H, Hkv, batch, b, hk, score_scale, cap_in, has_softcap: bool):
    """(score_scale, cap_in, out_scale) of a tile of batch entry ``b``, kv head ``hk``.

    ``Params``: the kernel's float32 parameter vector, the sinks (H,) followed for FP8 by
    q_descale * k_descale and then v_descale, each (batch, Hkv) row-major (``params``).  FP8
    folds the q/k descale product into the score scale (into ``cap_in`` with softcap, where the
    tanh comes first) and returns v_descale as the output's scale; 16-bit returns the scalars as
    they are and None."""
    if not ops.fp8:
        return score_scale, cap_in, None
    qk = Params[H + b * Hkv + hk]
    vd = Params[H + (batch + b) * Hkv + hk]
    if has_softcap:
        return score_scale, cap_in * qk, vd
    return score_scale * qk, cap_in, vd


# --- host side ---------------------------------------------------------------------------------


def padded_keys(keys: int) -> int:
    """Key extent of a dense V^T: a multiple of 16 (whole permutation groups; 16-byte rows for TMA)."""
    return -(-keys // GROUP) * GROUP


def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """Dense FP8 V (B, Sk, Hkv, Dv) -> V^T (B, Hkv, Dv, ceil16(Sk)) with each 16-key group's keys
    in ``key_of_column`` order, zero keys past Sk: the reference of ``transpose_v.py``'s kernel.
    The group permutation is a view (key = 8a + 2q + c goes to column 4q + 2a + c), so it is one
    copy of the zero-padded keys."""
    b, sk, hkv, dv = v.shape
    skp = padded_keys(sk)
    # int8 views: PyTorch's pad and copy kernels do not all take float8 (same bytes either way).
    src = torch.nn.functional.pad(v.view(torch.int8), (0, 0, 0, 0, 0, skp - sk))
    grouped = src.view(b, skp // GROUP, 2, 4, 2, hkv, dv).permute(0, 5, 6, 1, 3, 2, 4)
    return grouped.reshape(b, hkv, dv, skp).view(v.dtype)


def params(sinks32: torch.Tensor, q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor) -> torch.Tensor:
    """FP8 kernels' float32 parameter vector: sinks (H,), q_descale * k_descale, v_descale
    (each (batch, Hkv) row-major); ``tile_scales`` reads it."""
    return torch.cat([sinks32, (q_descale * k_descale).reshape(-1), v_descale.reshape(-1)]).float().contiguous()


def v_offsets(cu_k: torch.Tensor) -> torch.Tensor:
    """Packed batches: (batch + 1,) int32 column where each sequence starts in V^T, a multiple of
    16 (whole groups) and at least its predecessor's start plus its length (no overlap).  The
    kernel computes the same from cu_k with the same function (``seqinfo.v_column_start``)."""
    from .seqinfo import v_column_start

    b = torch.arange(cu_k.numel(), device=cu_k.device, dtype=torch.int32)
    return v_column_start(cu_k, b, GROUP).to(torch.int32).contiguous()


def packed_v_columns(total_k: int, batch: int) -> int:
    """Columns of a packed V^T: enough for ``v_offsets``' last start plus its whole groups."""
    return padded_keys(total_k) + GROUP * (batch + 2)


def transpose_v_packed(v: torch.Tensor, cu_k: torch.Tensor, lens_k: torch.Tensor) -> torch.Tensor:
    """Packed FP8 V (total_k, Hkv, Dv) -> V^T (1, Hkv, Dv, columns) with sequence b's keys from
    column ``v_offsets(cu_k)[b]`` on, in ``key_of_column`` order per 16-key group; zeros elsewhere.  Keys
    past ``lens_k[b]`` (seqused) are left out.  No host sync."""
    total_k, hkv, dv = v.shape
    batch = lens_k.numel()
    cols = packed_v_columns(total_k, batch)
    cu_v = v_offsets(cu_k)
    col = torch.arange(cols, device=v.device, dtype=torch.int32)
    seq = (torch.searchsorted(cu_v[1:].contiguous(), col, right=True)).clamp_(max=max(batch - 1, 0))
    local = col - cu_v[seq]
    key = key_of_column(local)
    valid = (local >= 0) & (key < lens_k[seq]) if batch else torch.zeros_like(col, dtype=torch.bool)
    src = torch.where(valid, cu_k[seq] + key, total_k).long()  # row total_k: the zero row
    rows = torch.cat([v.view(torch.int8), v.new_zeros(1, hkv, dv).view(torch.int8)])
    return rows[src].permute(1, 2, 0).contiguous()[None].view(v.dtype)
