"""Accuracy of FP8 (float8_e4m3fn) attention inputs, with and without the random rotation.

For each input kind, the output RMSE of ``flashtile.flash_attn_func`` against float64 exact
attention on the original (unquantized) inputs:

- ``bf16``: q, k, v rounded to bfloat16 (for scale: what a bf16 run starts from);
- ``fp8``: ``fp8.quantize_qkv(q, k, v)`` (per (batch, kv head) amax scaling);
- ``fp8 rotated``: ``fp8.quantize_qkv(q, k, v, rotate=True)`` (randomized Hadamard on q and k).

Input kinds: ``gaussian`` (N(0, 1)); ``outlier entries`` (0.1% of the entries of q, k and v
multiplied by 30); ``outlier channels`` (2 of the head-dim channels of q and k multiplied by 30,
the same channels in both, as in LLM activations; v has 0.1% outlier entries).

On the CPU (default) the FP8 rows run flashtile's exact path: the FP8 values are dequantized
and attention is exact, so the numbers measure the input quantization alone.  ``--device cuda``
runs the kernels: the FP8 kernel also rounds P to e4m3 before P @ V (as FlashAttention-3 does)
and the bf16 row is the bf16 kernel; the table then adds each FP8 method's RMSE against the bf16
kernel's output.

    python benchmarks/fp8_accuracy.py                    # b=1 s=1024 h=8 hkv=2 d=128, 3 seeds
    python benchmarks/fp8_accuracy.py --seqlen 512 --seeds 1 --causal
    python benchmarks/fp8_accuracy.py --device cuda --seqlen 4096
"""

from __future__ import annotations

import argparse
import json
import math
import platform

import torch

import flashtile
from flashtile import fp8

KINDS = ("gaussian", "outlier entries", "outlier channels")
METHODS = ("bf16", "fp8", "fp8 rotated")


def make_inputs(kind: str, b: int, s: int, h: int, hkv: int, d: int, gen: torch.Generator, mult: float = 30.0,
                frac: float = 1e-3, channels: int = 2):
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s, hkv, d, generator=gen)
    v = torch.randn(b, s, hkv, d, generator=gen)
    if kind == "outlier entries":
        for x in (q, k, v):
            x[torch.rand(x.shape, generator=gen) < frac] *= mult
    elif kind == "outlier channels":
        ch = torch.randperm(d, generator=gen)[:channels]
        q[..., ch] *= mult
        k[..., ch] *= mult
        v[torch.rand(v.shape, generator=gen) < frac] *= mult
    return q, k, v


def exact(q, k, v, causal: bool) -> torch.Tensor:
    """float64 attention, full matrix (GQA by repeat_interleave)."""
    g = q.shape[2] // k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def run_method(method: str, q, k, v, causal: bool, seed: int, device: str = "cpu") -> torch.Tensor:
    q, k, v = (x.to(device) for x in (q, k, v))
    if method == "bf16":
        return flashtile.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal).cpu()
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v, rotate=method == "fp8 rotated", seed=seed)
    return flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd).cpu()


def measure(b=1, s=1024, h=8, hkv=2, d=128, seeds=3, causal=False, device: str = "cpu") -> dict:
    results = {}
    for kind in KINDS:
        rmse = {m: [] for m in METHODS}
        rel = {m: [] for m in METHODS}
        vs_bf16 = {m: [] for m in METHODS}
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            q, k, v = make_inputs(kind, b, s, h, hkv, d, gen)
            want = exact(q, k, v, causal)
            scale = want.pow(2).mean().sqrt().item()
            outs = {m: run_method(m, q, k, v, causal, seed, device).double() for m in METHODS}
            for m in METHODS:
                err = (outs[m] - want).pow(2).mean().sqrt().item()
                rmse[m].append(err)
                rel[m].append(err / scale)
                vs_bf16[m].append((outs[m] - outs["bf16"]).pow(2).mean().sqrt().item())
        results[kind] = {m: {"rmse": sum(rmse[m]) / seeds, "rel_rmse": sum(rel[m]) / seeds,
                             "rmse_vs_bf16": sum(vs_bf16[m]) / seeds, "rmse_per_seed": rmse[m]} for m in METHODS}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--nheads", type=int, default=8)
    ap.add_argument("--nheads-kv", type=int, default=2)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the kernels (P rounded to FP8 too)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    res = measure(a.batch, a.seqlen, a.nheads, a.nheads_kv, a.headdim, a.seeds, a.causal, a.device)
    where = "CPU exact path" if a.device == "cpu" else f"CUDA kernels on {torch.cuda.get_device_name()}"
    print(f"# FP8 accuracy: b={a.batch} s={a.seqlen} h={a.nheads} hkv={a.nheads_kv} d={a.headdim} "
          f"{'causal' if a.causal else 'full'}, mean of {a.seeds} seeds; {where}; torch {torch.__version__}, "
          f"{platform.machine()}")
    print("| inputs | bf16 RMSE | FP8 RMSE | FP8 rotated RMSE | rotated / plain | FP8 vs bf16 | FP8 rotated vs bf16 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, r in res.items():
        ratio = r["fp8 rotated"]["rmse"] / r["fp8"]["rmse"]
        print(f"| {kind} | {r['bf16']['rmse']:.2e} | {r['fp8']['rmse']:.2e} | {r['fp8 rotated']['rmse']:.2e} | {ratio:.2f} "
              f"| {r['fp8']['rmse_vs_bf16']:.2e} | {r['fp8 rotated']['rmse_vs_bf16']:.2e} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
