"""FP8 forward kernels (float8_e4m3fn q, k, v with descales) against a float64 oracle (marker
``gpu``; skipped without CUDA).

The oracle ``ref64`` is exact attention in float64 on the dequantized inputs (stored value x
descale, ``flashtile.fp8.dequantize``): what the FP8 call stands for.  The baseline ``base``
does in PyTorch what the kernel does on purpose: float32 arithmetic on the same dequantized
values, P rounded to e4m3 at the kernel's scale (the largest weight of a row is 256 before
rounding), the normaliser unrounded, the output rounded to ``out_dtype``.  Issue 17's rule:

    err(kernel, ref64) <= 2 * err(base, ref64) + 1e-5 * max(1, max|ref64|)     (out)
    err(kernel, ref64) <= 1e-3 * max(1, max|lse|)                           (lse, finite entries)

lse has no P rounding in it (the kernel sums the unrounded weights), so its bound is float32
noise; it must be -inf exactly where ref64's is.  Kernel outputs are NaN-poisoned before the
launch (``debug.poison``); inputs are fresh ``torch.randn`` draws, quantized per (batch, kv head).

One command: ``python -m pytest -q -m gpu tests/test_gpu_fp8.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flashtile import flash_attn_func, flash_attn_varlen_func, fp8, reference
from flashtile.kernels import debug
from test_gpu_kernels import rising_qk

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class C:
    b: int = 2
    sq: int = 113
    sk: int = 203
    h: int = 4
    hkv: int = 4
    d: int = 128
    dv: int = 128
    causal: bool = False
    window: tuple = (-1, -1)
    sinks: bool = False
    softcap: float = 0.0
    out_dtype: torch.dtype = torch.bfloat16
    rise: float = 0.0  # > 0: scores rising along each row by about this many nats (``rising_qk``)

    @property
    def id(self) -> str:
        parts = [f"b{self.b}", f"{self.sq}x{self.sk}", f"h{self.h}/{self.hkv}", f"d{self.d}/{self.dv}"]
        parts += ["causal"] * self.causal + ([f"win{self.window}"] if self.window != (-1, -1) else [])
        parts += ["sinks"] * self.sinks + ([f"cap{self.softcap}"] if self.softcap else [])
        parts += ["fp16"] if self.out_dtype == torch.float16 else []
        parts += [f"rise{self.rise:g}"] if self.rise else []
        return "-".join(parts)


DENSE = [
    C(sq=1, sk=1),
    C(),
    C(sq=239, sk=1, causal=True),
    C(b=1, sq=1023, sk=1024, causal=True),
    C(b=1, sq=1024, sk=1023, h=8, hkv=2),
    C(b=1, sq=4224, sk=4224, causal=True, h=4, hkv=1),
    C(d=64, dv=64, sq=517, sk=517),
    C(d=64, dv=64, sq=300, sk=700, causal=True, h=8, hkv=2),
    # Both lengths > 1024: d = 64's long row (192 x 128 tiles, configs.short_forward).
    C(b=1, d=64, dv=64, sq=1100, sk=1301, causal=True, h=8, hkv=2),
    C(b=1, d=64, dv=64, sq=2049, sk=1500, h=4, hkv=1),
    C(d=256, dv=256, sq=333, sk=333, causal=True),
    C(d=256, dv=256, sq=129, sk=1000),
    # d = 256: one key, a partial last key block, many blocks through both ring stages, GQA,
    # every mask feature, fp16 output.
    C(d=256, dv=256, sq=1, sk=1),
    C(b=1, d=256, dv=256, sq=4096, sk=4096, causal=True, h=2, hkv=2),
    C(b=2, d=256, dv=256, sq=300, sk=777, h=8, hkv=2, causal=True, window=(200, -1), sinks=True, softcap=25.0),
    C(b=1, d=256, dv=256, sq=1500, sk=4321, h=4, hkv=1, out_dtype=torch.float16),
    C(d=192, dv=128, sq=250, sk=250, h=8, hkv=2),
    C(d=40, dv=40, sq=77, sk=150),  # zero-padded to the d=64 kernel
    C(d=80, dv=72, sq=90, sk=91, causal=True),  # q/k padded to 96, v to 80
    C(sq=500, sk=500, window=(127, 0)),
    C(sq=300, sk=300, causal=True, window=(64, -1), sinks=True),
    C(sq=257, sk=257, sinks=True, h=8, hkv=2),
    C(sq=200, sk=333, softcap=30.0),
    C(sq=333, sk=333, causal=True, sinks=True, softcap=20.0, out_dtype=torch.float16),
    C(sq=100, sk=100, out_dtype=torch.float16),
    # Both lengths >= 4096: d=128's long row (192 x 96 tiles, configs.short_forward), with features.
    C(b=1, sq=4097, sk=4100, h=4, hkv=2, sinks=True, softcap=20.0, out_dtype=torch.float16),
    C(b=1, sq=4096, sk=5000, h=2, hkv=2, causal=True, window=(1000, -1)),
    # The row max moves block after block (``rising_qk``): the O rescale taken and skipped.
    C(b=1, sq=300, sk=2000, rise=40.0),
    C(b=1, sq=700, sk=1500, rise=3.0, causal=True, h=8, hkv=2),
    C(b=1, sq=200, sk=1200, d=256, dv=256, rise=10.0),
    C(b=1, sq=400, sk=1000, d=64, dv=64, rise=20.0),
]


def _dense_inputs(c: C, gen):
    if c.rise:
        q, k = rising_qk(c.b, c.sq, c.sk, c.h, c.hkv, c.d, c.rise, torch.float32, device="cpu", gen=gen)
    else:
        q = torch.randn(c.b, c.sq, c.h, c.d, generator=gen)
        k = torch.randn(c.b, c.sk, c.hkv, c.d, generator=gen)
    v = torch.randn(c.b, c.sk, c.hkv, c.dv, generator=gen)
    return q, k, v


def _round_p(e: torch.Tensor) -> torch.Tensor:
    """The kernel's P rounding on weights in (0, 1]: to e4m3 at scale 256 (operands.P_OFFSET)."""
    return fp8.saturate(e.float() * 256.0).float() / 256.0


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def _check(what: str, out, lse, ref_out, ref_lse, base_out) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in out (a row the kernel never wrote?)"
    scale = max(1.0, ref_out.abs().max().item() if ref_out.numel() else 0.0)
    e_kernel, e_base = _err(out, ref_out), _err(base_out, ref_out)
    assert e_kernel <= 2 * e_base + 1e-5 * scale, f"{what}: out error {e_kernel:.3g} > 2 x baseline {e_base:.3g}"
    inf_ref = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf_ref), f"{what}: lse -inf pattern differs"
    fin = ~inf_ref
    if fin.any():
        e_lse = _err(lse[fin], ref_lse[fin])
        assert e_lse <= 1e-3 * max(1.0, ref_lse[fin].abs().max().item()), f"{what}: lse error {e_lse:.3g}"


@pytest.mark.parametrize("c", DENSE, ids=lambda c: c.id)
def test_fp8_forward(c: C, gen):
    q, k, v = _dense_inputs(c, gen)
    sinks = torch.randn(c.h, generator=gen) if c.sinks else None
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v)
    scale = c.d ** -0.5
    window = (c.window[0], 0) if c.causal else c.window
    qr, kr, vr = fp8.dequantize(q8, qd), fp8.dequantize(k8, kd), fp8.dequantize(v8, vd)
    ref_out, ref_lse = reference.attention_forward(qr.double(), kr.double(), vr.double(), scale, window,
                                                   None if sinks is None else sinks.double(), c.softcap)
    base_out, _ = reference.attention_forward(qr, kr, vr, scale, window, sinks, c.softcap, round_p=_round_p)
    dev = [x.cuda() for x in (q8, k8, v8, qd, kd, vd)]
    with debug.poison():
        out, lse = flash_attn_func(*dev[:3], causal=c.causal, window_size=c.window, sinks=None if sinks is None else sinks.cuda(),
                                   softcap=c.softcap, q_descale=dev[3], k_descale=dev[4], v_descale=dev[5],
                                   out_dtype=c.out_dtype, return_lse=True)
    assert out.dtype == c.out_dtype and out.shape == (c.b, c.sq, c.h, c.dv)
    _check(c.id, out.cpu(), lse.cpu(), ref_out, ref_lse, base_out.to(c.out_dtype))


VARLEN = [
    # (lens_q, lens_k, h, hkv, d, causal, window, sinks, softcap, seqused)
    ([1, 17, 0, 64, 129], [1, 33, 5, 64, 200], 4, 2, 128, False, (-1, -1), False, 0.0, False),
    ([300, 7, 128, 1], [300, 90, 128, 513], 4, 1, 128, True, (-1, -1), True, 15.0, False),
    ([33, 250, 4], [40, 250, 0], 8, 2, 64, True, (31, -1), False, 0.0, True),
    ([200, 111], [517, 111], 4, 4, 256, False, (-1, -1), False, 0.0, False),
]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"q{c[0]}-k{c[1]}-d{c[4]}")
def test_fp8_varlen_forward(case, gen):
    lens_q, lens_k, h, hkv, d, causal, window, with_sinks, softcap, seqused = case
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, generator=gen)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=gen)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=gen)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    used_q = torch.tensor([max(n - 1, 0) for n in lens_q], dtype=torch.int32) if seqused else None
    used_k = torch.tensor([n // 2 for n in lens_k], dtype=torch.int32) if seqused else None
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    scale = d ** -0.5
    win = (window[0], 0) if causal else window
    qr, kr, vr = fp8.dequantize(q8, qd, cu_q), fp8.dequantize(k8, kd, cu_k), fp8.dequantize(v8, vd, cu_k)
    ref_out, ref_lse = reference.varlen_attention_forward(
        qr.double(), kr.double(), vr.double(), cu_q, cu_k, scale, win, None if sinks is None else sinks.double(), softcap,
        used_q, used_k)
    base_out, _ = reference.varlen_attention_forward(qr, kr, vr, cu_q, cu_k, scale, win, sinks, softcap, used_q, used_k,
                                                     round_p=_round_p)
    cuda = (lambda x: None if x is None else x.cuda())
    with debug.poison():
        out, lse = flash_attn_varlen_func(
            q8.cuda(), k8.cuda(), v8.cuda(), cu_q.cuda(), cu_k.cuda(), max(lens_q), max(lens_k), causal=causal,
            window_size=window, sinks=cuda(sinks), softcap=softcap, q_descale=qd.cuda(), k_descale=kd.cuda(),
            v_descale=vd.cuda(), return_lse=True, seqused_q=cuda(used_q), seqused_k=cuda(used_k))
    _check(f"varlen {case}", out.cpu(), lse.cpu(), ref_out, ref_lse, base_out.to(torch.bfloat16))


def test_fp8_kernel_roundings_add_little_to_input_quantization(gen):
    """What the kernel rounds on its own (P to e4m3, fp32 accumulation in the FP8 WGMMAs) against
    what quantizing q, k, v costs anyway: on unit-variance inputs at 4k (causal and full), the
    kernel's RMS error vs the float64 oracle of the *unquantized* inputs is at most 1.5x that of
    exact attention on the dequantized inputs."""
    q, k, v = (torch.randn(1, 4096, 4, 128, generator=gen) for _ in range(3))
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v)
    qr, kr, vr = (fp8.dequantize(x, d).double() for x, d in ((q8, qd), (k8, kd), (v8, vd)))
    for window in ((-1, 0), (-1, -1)):
        out = flash_attn_func(q8.cuda(), k8.cuda(), v8.cuda(), window_size=window, q_descale=qd.cuda(), k_descale=kd.cuda(),
                              v_descale=vd.cuda()).cpu().double()
        ref, _ = reference.attention_forward(q.double(), k.double(), v.double(), 128 ** -0.5, window)
        dequantized, _ = reference.attention_forward(qr, kr, vr, 128 ** -0.5, window)
        rms = (out - ref).pow(2).mean().sqrt().item()
        rms_inputs = (dequantized - ref).pow(2).mean().sqrt().item()
        assert rms <= 1.5 * rms_inputs, f"window {window}: kernel RMS error {rms:.3g} > 1.5 x input quantization's {rms_inputs:.3g}"


@pytest.mark.parametrize("sk,dv", [(1, 128), (17, 64), (64, 128), (100, 80), (33, 48), (4097, 256)])
def test_transpose_v_kernel_matches_reference(sk, dv, gen):
    """The V^T pre-pass kernel equals the torch reference ``operands.transpose_v`` bit for bit
    (output NaN-poisoned first: every column is written)."""
    from flashtile.kernels.operands import padded_keys, transpose_v
    from flashtile.kernels.transpose_v import launch_transpose_v

    v = (torch.randn(2, sk, 3, dv, generator=gen) * 4).to(E4M3)
    with debug.poison():
        got = launch_transpose_v(v.cuda()).cpu()
    assert got.shape == (2, 3, dv, padded_keys(sk))
    assert torch.equal(got.view(torch.int8), transpose_v(v).view(torch.int8))


def test_transpose_v_packed_kernel_matches_reference(gen):
    from flashtile.kernels.launch import Packed
    from flashtile.kernels.operands import transpose_v_packed
    from flashtile.kernels.transpose_v import launch_transpose_v

    lens = [5, 0, 17, 64, 130, 1]
    used = [5, 0, 12, 64, 129, 1]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    v = (torch.randn(int(cu[-1]), 2, 128, generator=gen) * 4).to(E4M3)
    lens_k = torch.tensor(used, dtype=torch.int32)
    packed = Packed(cu.cuda(), cu.cuda(), lens_k.cuda(), lens_k.cuda(), max(lens), max(lens))
    got = launch_transpose_v(v.cuda(), packed).cpu()
    assert torch.equal(got.view(torch.int8), transpose_v_packed(v, cu, lens_k).view(torch.int8))
