"""Accuracy of FP8 (float8_e4m3fn) attention inputs, with and without the random rotation.

For each input kind, the output RMSE of ``flashtile.flash_attn_func`` against float64 exact
attention on the original (unquantized) inputs:

- ``bf16``: q, k, v rounded to bfloat16 (for scale: what a bf16 run starts from);
- ``fp8``: ``fp8.quantize_qkv(q, k, v)`` (per (batch, kv head) amax scaling);
- ``fp8 rotated``: ``fp8.quantize_qkv(q, k, v, rotate=True)`` (randomized Hadamard on q and k).

Input kinds: ``gaussian`` (N(0, 1)); ``outlier entries`` (0.1% of the entries of q, k and v
multiplied by 30); ``outlier channels`` (2 of the head-dim channels of q and k multiplied by 30,
the same channels in both, as in LLM activations; v has 0.1% outlier entries).

The FP8 rows run flashtile's CPU path: the FP8 values are dequantized and attention is exact,
so the numbers measure the input quantization alone.  A GPU FP8 kernel adds its own rounding
(FlashAttention-3 also rounds P to FP8 before P @ V), so expect its errors to be at least these.

    python benchmarks/fp8_accuracy.py                    # b=1 s=1024 h=8 hkv=2 d=128, 3 seeds
    python benchmarks/fp8_accuracy.py --seqlen 512 --seeds 1 --causal
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


def run_method(method: str, q, k, v, causal: bool, seed: int) -> torch.Tensor:
    if method == "bf16":
        return flashtile.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal)
    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(q, k, v, rotate=method == "fp8 rotated", seed=seed)
    return flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)


def measure(b=1, s=1024, h=8, hkv=2, d=128, seeds=3, causal=False) -> dict:
    results = {}
    for kind in KINDS:
        rmse = {m: [] for m in METHODS}
        rel = {m: [] for m in METHODS}
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            q, k, v = make_inputs(kind, b, s, h, hkv, d, gen)
            want = exact(q, k, v, causal)
            scale = want.pow(2).mean().sqrt().item()
            for m in METHODS:
                err = (run_method(m, q, k, v, causal, seed).double() - want).pow(2).mean().sqrt().item()
                rmse[m].append(err)
                rel[m].append(err / scale)
        results[kind] = {m: {"rmse": sum(rmse[m]) / seeds, "rel_rmse": sum(rel[m]) / seeds,
                             "rmse_per_seed": rmse[m]} for m in METHODS}
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
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    res = measure(a.batch, a.seqlen, a.nheads, a.nheads_kv, a.headdim, a.seeds, a.causal)
    print(f"# FP8 accuracy: b={a.batch} s={a.seqlen} h={a.nheads} hkv={a.nheads_kv} d={a.headdim} "
          f"{'causal' if a.causal else 'full'}, mean of {a.seeds} seeds; CPU exact path; torch {torch.__version__}, "
          f"{platform.machine()}")
    print("| inputs | bf16 RMSE | FP8 RMSE | FP8 rotated RMSE | rotated / plain |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind, r in res.items():
        ratio = r["fp8 rotated"]["rmse"] / r["fp8"]["rmse"]
        print(f"| {kind} | {r['bf16']['rmse']:.2e} | {r['fp8']['rmse']:.2e} | {r['fp8 rotated']['rmse']:.2e} | {ratio:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
