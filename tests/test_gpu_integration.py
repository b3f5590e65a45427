"""PyTorch / Hugging Face integration on CUDA (marker ``gpu``; skipped without CUDA).

Few kernel structures on purpose (each one is a TileLang compile): bf16, head dims 64 and 128.

- ``torch.library.opcheck`` of ``flashtile::fwd`` (through its backward) and ``flashtile::bwd``;
- ``torch.compile(fullgraph=True)`` forward + backward equals eager;
- tiny transformers models in bf16 with flashtile against eager attention in fp32, with
  flash-attn's rule: ``err(flashtile_bf16, eager_fp32) <= 2 * err(eager_bf16, eager_fp32) +
  atol`` for logits and ``3 *`` for parameter gradients (max abs error, atol relative to the
  values' scale);
- per-call dispatch overhead (``dispatch_overhead_us``, printed; run with ``-s`` to see it).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import flashtile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (marker 'gpu')"),
]

CUDA = "cuda"
BF16 = torch.bfloat16


def _qkv(b=2, sq=200, sk=200, h=4, hkv=2, d=64, dv=None, dtype=BF16, grad=True, device=CUDA):
    dv = d if dv is None else dv
    q = torch.randn(b, sq, h, d, device=device, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device=device, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, device=device, dtype=dtype)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v


# --- opcheck --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_opcheck_cuda(sinks):
    q, k, v = _qkv(d=64)
    s = torch.randn(4, device=CUDA, dtype=torch.float32, requires_grad=True) if sinks else None
    args = (0.125, -1, 0, 0.0)
    # deterministic=True: opcheck compares runs bit-for-bit-ish (bf16 tolerances), which
    # unordered float atomics in the backward would not honour.
    torch.library.opcheck(torch.ops.flashtile.fwd.default, (q, k, v, s, *args, True))
    # The backward op has no CUDA double backward, so its opcheck runs without grad inputs.
    with torch.no_grad():
        out, lse = torch.ops.flashtile.fwd(q, k, v, s, *args, True)
    plain = [t.detach() if t is not None else None for t in (q, k, v, s)]
    dout = torch.randn_like(out)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(
            torch.ops.flashtile.bwd.default, (dout, dlse, plain[0], plain[1], plain[2], out, lse, plain[3], *args, True)
        )


# --- torch.compile --------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128])
def test_compile_fullgraph_matches_eager_cuda(d):
    q, k, v = _qkv(d=d, sq=300, sk=300)
    s = torch.randn(4, device=CUDA, dtype=torch.float32, requires_grad=True)

    def fn(q, k, v, s):
        out, lse = flashtile.flash_attn_func(q, k, v, causal=True, sinks=s, return_lse=True, deterministic=True)
        return out, lse

    compiled = torch.compile(fn, fullgraph=True)  # inductor around the opaque op
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), device=CUDA, dtype=BF16)
    want = fn(q, k, v, s)
    g_want = torch.autograd.grad((want[0] * dout).sum() + want[1].sum(), (q, k, v, s))
    got = compiled(q, k, v, s)
    g_got = torch.autograd.grad((got[0] * dout).sum() + got[1].sum(), (q, k, v, s))
    # Same kernels, same inputs, deterministic backward: identical up to inductor's fusions
    # around the op (the loss), hence a small tolerance rather than equality.
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_fa3_call_site_runs_the_same_kernels_cuda():
    """``flashtile.fa3``'s flash-attn 3 order reaches the kernels ``flash_attn_func`` runs:
    out, lse and the deterministic backward's gradients bitwise equal (the shapes and kernels of
    ``test_compile_fullgraph_matches_eager_cuda``'s d = 64 case)."""
    from flashtile import fa3

    q, k, v = _qkv(d=64, sq=300, sk=300)
    got = fa3.flash_attn_func(q, k, v, 0.11, True, None, None, None, None, (-1, -1), 0, 0.0, 1, None, True, 0, True)
    want = flashtile.flash_attn_func(q, k, v, softmax_scale=0.11, causal=True, deterministic=True, return_lse=True)
    dout = torch.randn_like(want[0])
    for name, a, b in zip(("out", "lse"), got, want):
        assert torch.equal(a, b), f"{name} of fa3.flash_attn_func differs from flashtile.flash_attn_func's"
    g_got = torch.autograd.grad((got[0] * dout).sum(), (q, k, v))
    g_want = torch.autograd.grad((want[0] * dout).sum(), (q, k, v))
    for name, a, b in zip("qkv", g_got, g_want):
        assert torch.equal(a, b), f"d{name} of fa3.flash_attn_func differs from flashtile.flash_attn_func's"


def test_qkvpacked_strided_views_run_the_same_kernels_cuda():
    """flash-attn 2's stacked ``qkv`` (strided views, copied contiguous on the way): out and the
    deterministic backward's dqkv bitwise equal to the split call's (the d = 64 structures of
    ``test_compile_fullgraph_matches_eager_cuda``)."""
    qkv = torch.randn(2, 300, 3, 4, 64, device=CUDA, dtype=BF16, requires_grad=True)
    got = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    q, k, v = (x.detach().contiguous().requires_grad_() for x in qkv.unbind(2))
    want = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
    assert torch.equal(got, want), "qkvpacked out differs from the split call's"
    dout = torch.randn_like(got)
    (dqkv,) = torch.autograd.grad((got * dout).sum(), qkv)
    parts = torch.autograd.grad((want * dout).sum(), (q, k, v))
    assert torch.equal(dqkv, torch.stack(parts, dim=2)), "dqkv differs from the split call's gradients"


# --- transformers ---------------------------------------------------------------------------------


def _hf_configs():
    transformers = pytest.importorskip("transformers")
    return {
        "llama_d64": transformers.LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        ),
        "gpt_oss_d64_sinks_sliding": transformers.GptOssConfig(
            vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
        ),
        "gemma2_d128_softcap_sliding": transformers.Gemma2Config(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=128, sliding_window=128,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=128,
            max_position_embeddings=1024,
        ),
        # A chunked layer (chunks of 128 < 333 tokens: packed chunk sequences, the d = 64 packed
        # kernels) beside a full one; one expert, so no router tie flips an expert.
        "llama4_d64_chunked": transformers.Llama4TextConfig(
            vocab_size=256, hidden_size=256, intermediate_size=256, intermediate_size_mlp=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_chunk_size=128,
            num_local_experts=1, num_experts_per_tok=1, no_rope_layers=[1, 0], attn_temperature_tuning=False,
            use_qk_norm=False, max_position_embeddings=1024,
        ),
    }


def _run(model, ids):
    """Logits (fp32) and the gradients of every attention parameter (q/k/v/o projections,
    sinks), whose values go through the attention backward; the rest of the model is the same
    computation in every variant and would only hide attention errors."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, use_cache=False).logits
    w = torch.linspace(-1, 1, logits.numel(), device=logits.device).reshape(logits.shape)
    ((logits.float() * w).sum() / logits.shape[1]).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None}
    return logits.float().detach(), grads


@pytest.mark.parametrize("case", ["llama_d64", "gpt_oss_d64_sinks_sliding", "gemma2_d128_softcap_sliding",
                                  "llama4_d64_chunked"])
def test_transformers_bf16_matches_eager_fp32(case):
    from transformers import AutoModelForCausalLM

    import flashtile.integrations.transformers as ft_hf

    name = ft_hf.register()
    cfg = _hf_configs()[case]
    torch.manual_seed(0)
    ref32 = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").to(CUDA)
    for n, p in ref32.named_parameters():
        if n.endswith("sinks"):
            with torch.no_grad():
                p.normal_(0.0, 1.0)
    state = ref32.state_dict()
    ref_lp = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").to(CUDA, BF16)
    ref_lp.load_state_dict(state)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name).to(CUDA, BF16)
    ours.load_state_dict(state)

    ids = torch.randint(0, cfg.vocab_size, (2, 333), device=CUDA)  # > sliding windows, not a tile multiple
    l32, g32 = _run(ref32, ids)
    l_lp, g_lp = _run(ref_lp, ids)
    l_ft, g_ft = _run(ours, ids)

    def err(a, b):
        return (a - b).abs().max().item()

    atol = 1e-5 * max(1.0, l32.abs().max().item())
    print(f"\n{case}: logits err {err(l_ft, l32):.3e} (eager bf16 {err(l_lp, l32):.3e})")
    assert err(l_ft, l32) <= 2 * err(l_lp, l32) + atol
    assert len(g32) >= 4 * cfg.num_hidden_layers
    for n, g in g32.items():
        atol = 1e-5 * max(1.0, g.abs().max().item())
        e_ft, e_lp = err(g_ft[n], g), err(g_lp[n], g)
        print(f"  {n}: grad err {e_ft:.3e} (eager bf16 {e_lp:.3e}, scale {g.abs().max().item():.3e})")
        assert e_ft <= 3 * e_lp + atol, n


# --- Hugging Face decode steps through the KV-cache decode kernel (opt-in route) ---------------------


@pytest.mark.parametrize("sq,window,softcap", [(1, None, None), (4, None, None), (1, 100, None), (2, None, 20.0)])
def test_hf_decode_route_on_cuda(monkeypatch, sq, window, softcap):
    """FLASHTILE_HF_DECODE_KERNEL=1 on the GPU: a decode step over transformers' (b, hkv, sk, d)
    cache runs the split-KV decode kernel and meets flash-attn's rule against the fp32 reference
    (the route's CPU tests check it equals the dense path exactly in float64)."""
    from flashtile.integrations import transformers as tb

    g = torch.Generator().manual_seed(sq)
    q = torch.randn(2, 8, sq, 64, generator=g)
    k, v = (torch.randn(2, 2, 517, 64, generator=g) for _ in range(2))
    module = torch.nn.Module()
    args = dict(scaling=0.125, sliding_window=window, softcap=softcap, is_causal=True)
    called = []
    real = tb._decode_over_cache
    monkeypatch.setattr(tb, "_decode_over_cache", lambda *a: (lambda r: called.append(r is not None) or r)(real(*a)))
    with torch.no_grad():
        monkeypatch.setenv(tb.DECODE_KERNEL_ENV, "1")
        routed, _ = tb.attention_forward(module, *(x.to(CUDA, BF16) for x in (q, k, v)), None, **args)
        was_routed = list(called)
        monkeypatch.setenv(tb.DECODE_KERNEL_ENV, "0")
        ref32, _ = tb.attention_forward(module, q, k, v, None, **args)  # CPU reference path
        ref_lp, _ = tb.attention_forward(module, *(x.to(BF16) for x in (q, k, v)), None, **args)
    assert was_routed == [True], "the step was not routed to the decode kernel"
    e_ft = (routed.float().cpu() - ref32).abs().max().item()
    e_lp = (ref_lp.float() - ref32).abs().max().item()
    assert e_ft <= 2 * e_lp + 1e-5 * max(1.0, ref32.abs().max().item()), f"routed {e_ft:.3g} vs bf16 reference {e_lp:.3g}"


def test_hf_generate_with_decode_route_on_cuda(monkeypatch):
    """model.generate on the GPU with decode steps routed: it runs, routes every decode step, and
    its greedy tokens equal those of the dense route (same bf16 model)."""
    transformers = pytest.importorskip("transformers")
    from flashtile.integrations import transformers as tb

    name = tb.register()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=name).to(CUDA, BF16).eval()
    prompt = torch.randint(0, 256, (2, 37), device=CUDA)
    kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    routed = []
    real = tb._decode_over_cache
    monkeypatch.setattr(tb, "_decode_over_cache", lambda *a: (lambda r: routed.append(r is not None) or r)(real(*a)))
    monkeypatch.setenv(tb.DECODE_KERNEL_ENV, "0")
    dense = model.generate(prompt, **kwargs)
    monkeypatch.setenv(tb.DECODE_KERNEL_ENV, "1")
    ours = model.generate(prompt, **kwargs)
    assert sum(routed) >= 11 * cfg.num_hidden_layers, f"decode steps routed: {sum(routed)} of {len(routed)}"
    assert torch.equal(ours, dense), "greedy tokens differ between the decode-kernel and dense routes"


# --- dispatch overhead ----------------------------------------------------------------------------


def dispatch_overhead_us(device: str = CUDA, iters: int = 500, requires_grad: bool = False) -> dict:
    """Host time per call (us) of each layer of a forward call, on a tiny input.

    The input is so small that the GPU work is a few microseconds, so a loop of calls is bound
    by the host and ``time / iters`` is the per-call host cost:

    - ``launcher``: ``flashtile.kernels.forward`` (kernel launch only, what every path pays);
    - ``op``: ``torch.ops.flashtile.fwd`` (the dispatcher, as under torch.compile);
    - ``flash_attn_func``: the public function (validation + eager fast path).

    ``overhead_us`` is flash_attn_func minus launcher; ``op_overhead_us`` is op minus launcher.
    """
    from flashtile import kernels

    q, k, v = _qkv(b=1, sq=64, sk=64, h=2, hkv=2, d=64, grad=requires_grad, device=device)
    scale = 0.125
    calls = {
        "launcher": lambda: kernels.forward(q, k, v, None, scale, (-1, 0), 0.0),
        "op": lambda: torch.ops.flashtile.fwd(q, k, v, None, scale, -1, 0, 0.0, False),
        "flash_attn_func": lambda: flashtile.flash_attn_func(q, k, v, softmax_scale=scale, causal=True),
    }
    best = {name: float("inf") for name in calls}
    for fn in calls.values():  # compile + warm up
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for _ in range(5):  # interleaved rounds, best of each
        for name, fn in calls.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / iters * 1e6)
    best["overhead_us"] = best["flash_attn_func"] - best["launcher"]
    best["op_overhead_us"] = best["op"] - best["launcher"]
    return best


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_dispatch_overhead(requires_grad):
    res = dispatch_overhead_us(CUDA, requires_grad=requires_grad)
    print(
        f"\ndispatch ({'requires_grad' if requires_grad else 'no grad'}, {torch.cuda.get_device_name()}): "
        + ", ".join(f"{k} {v:.1f} us" for k, v in res.items())
    )
    assert res["overhead_us"] < 200
