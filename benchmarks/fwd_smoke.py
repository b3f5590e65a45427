"""Forward-only smoke check of the d=128 hand-written kernel on awkward shapes (developer tool,
run on the device before the full GPU suite): out and lse against an fp32 reference.

    python3 benchmarks/fwd_smoke.py [persistent 0|1]
"""

import sys

import torch

import flashtile
from flashtile.kernels import configs, debug
from flashtile.reference import attention_forward


def main():
    if len(sys.argv) > 1:
        configs.overrides["fwd"] = configs.FwdConfig(128, 128, 2, 256, True, bool(int(sys.argv[1])))
    torch.manual_seed(0)
    cases = [  # b, sq, sk, h, hkv, causal, window
        (1, 1, 1, 1, 1, False, (-1, -1)), (2, 17, 113, 4, 1, True, (-1, -1)), (3, 239, 1, 8, 2, False, (-1, -1)),
        (2, 1023, 1024, 4, 4, True, (-1, -1)), (2, 1024, 1023, 8, 2, False, (127, 0)), (1, 4224, 4224, 4, 1, True, (-1, -1)),
        (2, 700, 3, 4, 4, False, (0, 0)), (4, 2048, 2048, 16, 4, False, (-1, -1)), (1, 3000, 3000, 8, 8, False, (64, 64)),
    ]
    for b, sq, sk, h, hkv, causal, window in cases:
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        with debug.poison():
            out, lse = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
        torch.cuda.synchronize()
        win = flashtile.interface.normalize_window(causal, window)
        ref, ref_lse = attention_forward(q.float(), k.float(), v.float(), 128**-0.5, win)
        err = (out.float() - ref).abs().nan_to_num(1e9).max().item()
        lerr = torch.where(torch.isinf(ref_lse), (lse != ref_lse) * 1e9, (lse - ref_lse).abs()).nan_to_num(1e9).max().item()
        print(f"{'PASS' if err < 2e-2 and lerr < 1e-3 else 'FAIL'} b{b} sq{sq} sk{sk} h{h}/{hkv} c{int(causal)} w{window} out {err:.2e} lse {lerr:.2e}", flush=True)


if __name__ == "__main__":
    main()
