"""Probe one varlen kernel case in isolation (a sticky CUDA error cannot poison others):

    python benchmarks/varlen_probe.py fwd|bwd|bwd-det D [causal] [lens_q] [lens_k]

Prints the max error of out/lse (and dq/dk/dv) against the float32 reference."""
import sys

import torch

from flashtile import reference
from flashtile.kernels import varlen_backward, varlen_forward

what, d = sys.argv[1], int(sys.argv[2])
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
lq = [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "5,300,0,129,1000,1").split(",")]
lk = [int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "17,300,7,0,1000,64").split(",")]
h, hkv, dt = 8, 2, torch.bfloat16
cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
q = torch.randn(sum(lq), h, d, device="cuda", dtype=dt)
k = torch.randn(sum(lk), hkv, d, device="cuda", dtype=dt)
v = torch.randn(sum(lk), hkv, d, device="cuda", dtype=dt)
window = (-1, 0) if causal else (-1, -1)
scale = d ** -0.5
out, lse = varlen_forward(q, k, v, cu_q, cu_k, None, None, max(lq), max(lk), None, scale, window, 0.0)
torch.cuda.synchronize()
ro, rl = reference.varlen_attention_forward(q.cpu().float(), k.cpu().float(), v.cpu().float(), cu_q.cpu(), cu_k.cpu(), scale, window, None, 0.0, None, None)
fin = torch.isfinite(rl)
print(what, d, "causal" if causal else "full", "fwd out err", (out.cpu().float() - ro).abs().max().item(), "lse err", (lse.cpu()[fin] - rl[fin]).abs().max().item(), "lse -inf match", bool((torch.isinf(lse.cpu()) == ~fin).all()), flush=True)
if what.startswith("bwd"):
    dout = torch.randn_like(out)
    dq, dk, dv, _ = varlen_backward(dout, None, q, k, v, out, lse, cu_q, cu_k, None, None, max(lq), max(lk), None, scale, window, 0.0, what == "bwd-det")
    torch.cuda.synchronize()
    r = reference.varlen_attention_backward(dout.cpu().float(), q.cpu().float(), k.cpu().float(), v.cpu().float(), ro, rl, cu_q.cpu(), cu_k.cpu(), scale, window, None, 0.0, None, None, None)
    print(what, d, "bwd errs", [round((a.cpu().float() - b).abs().max().item(), 4) for a, b in zip((dq, dk, dv), r[:3])], flush=True)
