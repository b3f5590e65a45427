"""Hugging Face transformers integration on CPU: tiny random models built in code (no
downloads), flashtile against transformers' own eager attention, logits and gradients.

Sequences are longer than the sliding windows, so the window convention is exercised (an
off-by-one in ``sliding_window -> window_size`` makes these tests fail).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoModelForMaskedLM  # noqa: E402

import flashtile.integrations.transformers as ft_hf  # noqa: E402

NAME = ft_hf.register()
SEQ = 24  # > every sliding window below


def _llama():
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )


def _mistral():
    return transformers.MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, max_position_embeddings=64,
    )


def _gemma2():
    # Alternating sliding / full layers, logit softcapping, and a query scale that is not
    # 1/sqrt(head_dim) (query_pre_attn_scalar), so `scaling` is really passed through.
    return transformers.Gemma2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        attn_logit_softcapping=5.0, final_logit_softcapping=30.0, query_pre_attn_scalar=24,
        max_position_embeddings=64,
    )


def _gpt_oss():
    return transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )


def _llama4_chunked():
    # Chunked layers (attention_chunk_size 8 < SEQ) beside full ones; one expert, so that no
    # router tie flips an expert between implementations.
    return transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8, num_local_experts=1,
        num_experts_per_tok=1, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        no_rope_layers=[1, 0, 1, 0], attn_temperature_tuning=False, use_qk_norm=False,
    )


def _modernbert():
    # Encoder: is_causal=False, symmetric local attention (passes sliding_window + 1).
    return transformers.ModernBertConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, local_attention=8, global_attn_every_n_layers=3,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2,
    )


CONFIGS = {
    "llama_gqa": (_llama, AutoModelForCausalLM),
    "mistral_sliding": (_mistral, AutoModelForCausalLM),
    "gemma2_softcap_sliding": (_gemma2, AutoModelForCausalLM),
    "gpt_oss_sinks": (_gpt_oss, AutoModelForCausalLM),
    "llama4_chunked": (_llama4_chunked, AutoModelForCausalLM),
    "modernbert_bidirectional_local": (_modernbert, AutoModelForMaskedLM),
}


def _pair(make_config, auto, impl=NAME):
    """(eager model, flashtile model) with identical weights; each gets its own config copy."""
    cfg = make_config()
    torch.manual_seed(0)
    ref = auto.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    for name, p in ref.named_parameters():
        if name.endswith("sinks"):  # default init is ~0; make the sinks matter
            with torch.no_grad():
                p.normal_(0.0, 1.0)
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation=impl)
    ours.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == impl
    return ref, ours


def _ids(batch=2, seq=SEQ):
    return torch.randint(3, 96, (batch, seq))


def _close(got, want, rel=1e-5):
    scale = want.abs().max().item() + 1e-12
    torch.testing.assert_close(got, want, atol=rel * scale, rtol=0)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_logits_and_gradients_match_eager(case):
    ref, ours = _pair(*CONFIGS[case])
    ids = _ids()
    want, got = ref(ids).logits, ours(ids).logits
    _close(got, want)
    w = torch.randn_like(want)
    (want * w).sum().backward()
    (got * w).sum().backward()
    checked = 0
    for (name, p_ref), (_, p_ours) in zip(ref.named_parameters(), ours.named_parameters()):
        if p_ref.grad is None:
            assert p_ours.grad is None, name
            continue
        _close(p_ours.grad, p_ref.grad, rel=1e-4)
        checked += 1
    assert checked > 5


@pytest.mark.parametrize("case", ["mistral_sliding", "gpt_oss_sinks", "llama4_chunked"])
def test_greedy_generation_with_cache_matches_eager(case):
    """Decoding runs past the sliding window (Llama 4: past several chunks), so the sliding
    cache's key offsets are used."""
    ref, ours = _pair(*CONFIGS[case])
    ref.eval(), ours.eval()
    prompt = _ids(batch=1, seq=6)
    kwargs = dict(max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    torch.testing.assert_close(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs), atol=0, rtol=0)


@pytest.mark.parametrize("make_config", [_mistral, _llama4_chunked], ids=["mistral_sliding", "llama4_chunked"])
def test_compiled_training_step_fullgraph_matches_eager(make_config):
    """Llama 4: its chunked layers (chunks of 8 < SEQ) run with attention_chunk in the graph."""
    _, ours = _pair(make_config, AutoModelForCausalLM)
    ids = _ids()
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    got = compiled(ids, use_cache=False).logits
    got.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    want = ours(ids, use_cache=False).logits
    want.float().square().mean().backward()
    _close(got, want)
    for n, p in ours.named_parameters():
        _close(grads[n], p.grad, rel=1e-4)
    # Value checks survive compilation as runtime asserts (no graph break).
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(RuntimeError, match="padding"):
        compiled(ids, attention_mask=mask, use_cache=False)


# --- what is refused, and how ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    ref, ours = _pair(_llama, AutoModelForCausalLM)
    return ref.eval(), ours.eval()


def test_all_ones_padding_mask_and_causal_4d_mask_are_accepted(llama):
    ref, ours = llama
    ids = _ids(seq=8)
    want = ref(ids).logits
    _close(ours(ids, attention_mask=torch.ones_like(ids)).logits, want)
    causal = torch.tril(torch.ones(8, 8, dtype=torch.bool))[None, None].expand(2, 1, 8, 8)
    _close(ours(ids, attention_mask=causal).logits, want)
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min)
    _close(ours(ids, attention_mask=additive).logits, want)


# --- padded and packed batches (varlen) -----------------------------------------------------


def _sdpa_pair(make_config, auto=AutoModelForCausalLM):
    """(sdpa model, flashtile model); eager where the architecture has no sdpa (Gemma 2: softcap,
    gpt-oss: sinks).  Both reference paths apply transformers' own padding / packing masks."""
    ref, ours = _pair(make_config, auto)
    if ref._supports_sdpa:
        ref.set_attn_implementation("sdpa")
    return ref, ours


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_against_sdpa(ref, ours, keep, **inputs):
    """Logits on the real tokens (``keep``) and the parameter gradients of a loss over them."""
    want, got = ref(**inputs).logits, ours(**inputs).logits
    _close(got[keep], want[keep])
    w = torch.randn_like(want[keep])
    (want[keep] * w).sum().backward()
    (got[keep] * w).sum().backward()
    g_ref, g_ours = _grads(ref), _grads(ours)
    assert g_ref.keys() == g_ours.keys() and len(g_ref) > 5
    for name in g_ref:
        _close(g_ours[name], g_ref[name], rel=1e-4)


PADDED_CASES = ["llama_gqa", "mistral_sliding", "gemma2_softcap_sliding", "gpt_oss_sinks", "llama4_chunked"]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", PADDED_CASES)
def test_padded_batch_runs_unpadded_and_matches_sdpa(case, side):
    """A 2D padding mask: the real tokens run through flash_attn_varlen_func (one sequence per
    row), logits and gradients equal sdpa's on every non-pad token."""
    ref, ours = _sdpa_pair(CONFIGS[case][0])
    ids = _ids(batch=3, seq=SEQ)
    mask = torch.ones_like(ids)
    for row, pad in ((0, 7), (2, SEQ - 1)):  # row 1 unpadded, row 2 a single real token
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, SEQ - pad :] = 0
    _check_against_sdpa(ref, ours, mask.bool(), input_ids=ids, attention_mask=mask)


def test_padded_encoder_matches_sdpa():
    """ModernBERT (bidirectional, symmetric local window) with right padding."""
    ref, ours = _sdpa_pair(_modernbert, AutoModelForMaskedLM)
    ids = _ids(batch=3, seq=SEQ)
    mask = torch.ones_like(ids)
    mask[0, 17:] = 0
    mask[2, 1:] = 0
    _check_against_sdpa(ref, ours, mask.bool(), input_ids=ids, attention_mask=mask)


def _check_left_padded_generation(ref, ours, max_new_tokens: int):
    """Greedy generation of a batch whose first row has 4 pads: the same tokens as ``ref``."""
    ref.eval(), ours.eval()
    ids = _ids(batch=2, seq=9)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs), atol=0, rtol=0)


def test_padded_generation_matches_sdpa(llama):
    """Left-padded batched generation: prefill and decode steps run unpadded."""
    _check_left_padded_generation(*_sdpa_pair(_llama), max_new_tokens=6)


def test_llama4_chunked_padded_generation_and_continued_prefill_match_eager():
    """Llama 4's chunked layers past several chunks of 8, with the sliding cache dropping keys:
    a left-padded batch (each row's chunks count from its first real token) generates eager's
    tokens, and a prompt fed in two parts (the second part's queries straddle chunks, the
    cache holding only the last 7 keys) gives eager's logits."""
    ref, ours = _pair(_llama4_chunked, AutoModelForCausalLM)
    _check_left_padded_generation(ref, ours, max_new_tokens=14)
    ids = _ids(batch=2, seq=30)
    with torch.no_grad():
        for split in (5, 13):
            logits = []
            for model in (ref, ours):
                first = model(ids[:, :split], use_cache=True)
                second = model(ids[:, split:], past_key_values=first.past_key_values, use_cache=True)
                logits.append(torch.cat([first.logits, second.logits], dim=1))
            _close(logits[1], logits[0])


def test_llama4_chunked_decode_steps_take_the_decode_route_with_a_left_pad(monkeypatch):
    """A chunked layer's decode step runs the KV-cache decode route over the cache as it is,
    the keys before the query's chunk hidden as the left pad (no copy of a sliced cache)."""
    ref, ours = _pair(_llama4_chunked, AutoModelForCausalLM)
    ref.eval(), ours.eval()
    starts = []
    route = ft_hf._decode_over_cache

    def spy(query, key, value, opts, start=0):
        out = route(query, key, value, opts, start)
        if out is not None:
            starts.append(start)
        return out

    monkeypatch.setattr(ft_hf, "_decode_over_cache", spy)
    prompt = _ids(batch=1, seq=5)
    kwargs = dict(max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    torch.testing.assert_close(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs), atol=0, rtol=0)
    assert any(s > 0 for s in starts), f"no chunked decode step took the decode route with a left pad: {starts}"


def test_padding_with_holes_and_sliding_window_is_refused():
    _, ours = _pair(_mistral, AutoModelForCausalLM)
    ids = _ids(seq=8)
    mask = torch.ones_like(ids)
    mask[1, 3] = 0  # a hole between real tokens
    with pytest.raises(NotImplementedError, match="zeros between real tokens"):
        ours(ids, attention_mask=mask)


def test_custom_4d_mask_is_refused(llama):
    _, ours = llama
    ids = _ids(seq=8)
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))[None, None].expand(2, 1, 8, 8).clone()
    mask[0, 0, 5, 2] = False
    with pytest.raises(ValueError, match="not the plain causal"):
        ours(ids, attention_mask=mask)


PACKED_DOCS = [7, 1, 12, 4]  # document lengths packed into one row (sum SEQ = 24)


def _packed_position_ids(lengths=PACKED_DOCS):
    return torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("case", PADDED_CASES)
def test_packed_position_ids_run_varlen_and_match_sdpa(case):
    """Padding-free packing as DataCollatorWithFlattening produces it (batch 1, position_ids
    restarting at 0 per document): detected from position_ids like transformers' flash path.

    Ground truth: the reference model run on each document alone (logits, and gradients summed
    over the documents).  Also against the reference model on the packed row where
    transformers' own masks handle packing (not gpt-oss's eager path, whose packed logits
    differ from its own per-document runs, checked below)."""
    ref, ours = _sdpa_pair(CONFIGS[case][0])
    ids = _ids(batch=1, seq=sum(PACKED_DOCS))
    pos = _packed_position_ids()
    got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
    w = torch.randn_like(got)
    (got * w).sum().backward()
    start = 0
    for n in PACKED_DOCS:
        doc = slice(start, start + n)
        want = ref(input_ids=ids[:, doc], use_cache=False).logits
        _close(got[:, doc], want)
        (want * w[:, doc]).sum().backward()
        start += n
    g_ref, g_ours = _grads(ref), _grads(ours)
    assert g_ref.keys() == g_ours.keys() and len(g_ref) > 5
    for name in g_ref:
        _close(g_ours[name], g_ref[name], rel=1e-4)
    if case != "gpt_oss_sinks":
        ref.zero_grad(), ours.zero_grad()
        keep = torch.ones_like(ids, dtype=torch.bool)
        _check_against_sdpa(ref, ours, keep, input_ids=ids, position_ids=pos, use_cache=False)


def test_gpt_oss_eager_packing_differs_from_its_own_per_document_runs():
    """Why gpt-oss is checked against per-document runs only: transformers' eager gpt-oss
    (5.x) does not separate packed documents.  If this starts failing, transformers fixed it
    and the sdpa/eager comparison above can include gpt-oss."""
    ref, _ = _pair(_gpt_oss, AutoModelForCausalLM)
    ids = _ids(batch=1, seq=sum(PACKED_DOCS))
    packed = ref(input_ids=ids, position_ids=_packed_position_ids(), use_cache=False).logits
    alone = ref(input_ids=ids[:, 7:8], use_cache=False).logits
    assert not torch.allclose(packed[:, 7:8], alone, atol=1e-3)


def test_packed_documents_equal_separate_runs_and_cu_seq_lens_kwargs(llama):
    """Each packed document's logits equal running it alone; the cu_seq_lens_q/k,
    max_length_q/k kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) give the
    same result without reading position_ids; two packed rows never attend to each other."""
    _, ours = llama
    ids = _ids(batch=1, seq=sum(PACKED_DOCS))
    pos = _packed_position_ids()
    packed = ours(ids, position_ids=pos, use_cache=False).logits
    start = 0
    for n in PACKED_DOCS:
        alone = ours(ids[:, start : start + n], use_cache=False).logits
        _close(packed[:, start : start + n], alone)
        start += n
    cu = torch.tensor([0, *torch.tensor(PACKED_DOCS).cumsum(0).tolist()], dtype=torch.int32)
    m = max(PACKED_DOCS)
    with_kwargs = ours(ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m).logits
    _close(with_kwargs, packed)
    two_rows = ours(torch.cat([ids, ids.flip(1)]), position_ids=torch.cat([pos, pos.flip(1) * 0 + pos]), use_cache=False).logits
    _close(two_rows[:1], packed)


def test_packed_with_cu_seq_lens_kwargs_compiles_fullgraph(llama):
    _, ours = llama
    ids = _ids(batch=1, seq=sum(PACKED_DOCS))
    cu = torch.tensor([0, *torch.tensor(PACKED_DOCS).cumsum(0).tolist()], dtype=torch.int32)
    m = max(PACKED_DOCS)
    kw = dict(position_ids=_packed_position_ids(), use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    _close(compiled(ids, **kw).logits, ours(ids, **kw).logits)


def test_partial_varlen_kwargs_are_refused(llama):
    _, ours = llama
    ids = _ids(batch=1, seq=8)
    with pytest.raises(NotImplementedError, match="need all of"):
        ours(ids, cu_seq_lens_q=torch.tensor([0, 8], dtype=torch.int32), use_cache=False)


def test_static_cache_is_refused(llama):
    _, ours = llama
    prompt = _ids(batch=1, seq=6)
    with pytest.raises(NotImplementedError, match="static"):
        ours.generate(prompt, max_new_tokens=2, do_sample=False, cache_implementation="static", pad_token_id=0)


def test_output_attentions_is_refused(llama):
    _, ours = llama
    with pytest.raises(ValueError, match="output_attentions"):
        ours(_ids(seq=8), output_attentions=True)


def test_dropout_is_refused_in_training_only():
    cfg = _llama()
    cfg.attention_dropout = 0.1
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    model.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        model(_ids(seq=8))
    model.eval()  # eval: eager's dropout is a no-op too
    model(_ids(seq=8))


def test_register_refuses_names_transformers_routes_to_flash_attn():
    with pytest.raises(ValueError, match="flash"):
        ft_hf.register("flashtile")
    assert ft_hf.register() == NAME  # idempotent


# Registration on ``import flashtile`` (issue 23).  Fresh interpreters for the import orders
# (transformers' model code loads in each, ~4 s of CPU), so only the two orders that need one.
_AUTO_SCRIPT = """
import sys
order = sys.argv[1]
if order == "transformers-first":
    import transformers
    import flashtile
    assert "transformers.modeling_utils" not in sys.modules  # registration waits, imports nothing
elif order == "flashtile-first":
    import flashtile
    assert "transformers" not in sys.modules, "import flashtile imported transformers"
    import transformers
elif order == "disabled":
    import flashtile
    assert "transformers" not in sys.modules
    assert not any(type(f).__module__.startswith("flashtile") for f in sys.meta_path)
    print("ok")
    raise SystemExit
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
assert "tile_attention" in AttentionInterface._global_mapping
assert "tile_attention" in AttentionMaskInterface._global_mapping
assert not any(type(f).__module__.startswith("flashtile") for f in sys.meta_path)  # hook removed
if order == "flashtile-first":  # what the issue reported: a model built by name
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="tile_attention")
    assert model.config._attn_implementation == "tile_attention"
    assert torch.isfinite(model(torch.randint(0, 32, (1, 5))).logits).all()
print("ok")
"""


def test_import_flashtile_registers_the_backend():
    """transformers imported before flashtile and after it (side by side), and
    FLASHTILE_HF_AUTOREGISTER=0 installing nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    procs = {}
    for order in ("transformers-first", "flashtile-first", "disabled"):
        env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("FLASHTILE_HF_AUTOREGISTER", None)
        if order == "disabled":
            env["FLASHTILE_HF_AUTOREGISTER"] = "0"
        procs[order] = subprocess.Popen(
            [sys.executable, "-c", _AUTO_SCRIPT, order], cwd=root, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    for order, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip() == "ok", f"{order}: {out[-2000:]}{err[-3000:]}"


def test_install_registers_at_once_when_model_code_is_loaded(monkeypatch):
    """This process has transformers' model code loaded: install() registers immediately."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from flashtile.integrations import autoregister

    for registry in (AttentionInterface, AttentionMaskInterface):
        mapping = dict(registry._global_mapping)
        mapping.pop(NAME, None)
        monkeypatch.setattr(registry, "_global_mapping", mapping)
    monkeypatch.delenv("FLASHTILE_HF_AUTOREGISTER", raising=False)
    autoregister.install()
    assert AttentionInterface._global_mapping[NAME] is ft_hf.attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is ft_hf.attention_mask


def test_failed_registration_warns_and_does_not_raise(monkeypatch):
    from flashtile.integrations import autoregister

    def broken(name=NAME):
        raise RuntimeError("registry moved")

    monkeypatch.setattr(ft_hf, "register", broken)
    with pytest.warns(RuntimeWarning, match="registry moved"):
        autoregister._register()


# --- the attention function alone ---------------------------------------------------------------


class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def _bhsd(b=2, h=4, hkv=2, s=10, d=8, dtype=torch.float64):
    return (
        torch.randn(b, h, s, d, dtype=dtype),
        torch.randn(b, hkv, s, d, dtype=dtype),
        torch.randn(b, hkv, s, d, dtype=dtype),
    )


def _sdpa_masked(q, k, v, vis, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("module_causal,kwarg_causal,sliding", [
    (True, None, None), (False, None, None), (True, False, None), (False, True, None),
    (True, None, 4), (False, None, 4),
])
def test_attention_forward_mapping(module_causal, kwarg_causal, sliding):
    q, k, v = _bhsd()
    out, weights = ft_hf.attention_forward(
        _Module(module_causal), q, k, v, None, scaling=0.3, sliding_window=sliding, is_causal=kwarg_causal
    )
    assert weights is None and out.shape == (2, 10, 4, 8)  # (batch, seq, heads, dim)
    causal = module_causal if kwarg_causal is None else kwarg_causal
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    vis = torch.ones(10, 10, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if sliding is not None:  # transformers' flash convention: (sliding - 1) on each side
        vis &= (i - j).abs() <= sliding - 1
    torch.testing.assert_close(out, _sdpa_masked(q, k, v, vis, 0.3), atol=1e-12, rtol=0)


def test_attention_forward_keeps_kv_heads_and_layout(monkeypatch):
    """GQA goes to flash_attn_func unexpanded, as (batch, seq, heads, dim) views."""
    seen = {}
    real = ft_hf.flash_attn_func

    def spy(q, k, v, **kwargs):
        seen.update(q=q.shape, k=k.shape, v=v.shape, kwargs=kwargs)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(ft_hf, "flash_attn_func", spy)
    q, k, v = _bhsd(h=8, hkv=2)
    ft_hf.attention_forward(_Module(), q, k, v, None, scaling=0.3)
    assert seen["q"] == (2, 10, 8, 8) and seen["k"] == (2, 10, 2, 8) and seen["v"] == (2, 10, 2, 8)
    assert seen["kwargs"]["causal"] is True and seen["kwargs"]["softmax_scale"] == 0.3


def test_attention_forward_sinks_and_softcap_match_eager_formula():
    q, k, v = _bhsd()
    sinks = torch.randn(4, dtype=q.dtype)
    out, _ = ft_hf.attention_forward(_Module(), q, k, v, None, scaling=0.3, softcap=2.0, s_aux=sinks)
    # gpt-oss / Gemma 2 eager: capped scores, causal mask, sink column in the softmax, dropped.
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = 2.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.3 / 2.0)
    scores = scores.masked_fill(~torch.tril(torch.ones(10, 10, dtype=torch.bool)), float("-inf"))
    logits = torch.cat([scores, sinks.reshape(1, 4, 1, 1).expand(2, 4, 10, 1)], dim=-1)
    probs = logits.softmax(-1)[..., :-1]
    torch.testing.assert_close(out, (probs @ vv).transpose(1, 2), atol=1e-12, rtol=0)


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0)])
def test_decode_steps_through_the_kvcache_kernel_match_dense(monkeypatch, sq, window, softcap):
    """With FLASHTILE_HF_DECODE_KERNEL=1 a decode step (few queries over the whole cache, no
    mask) runs flash_attn_with_kvcache on the cache folded to (batch x kv heads) entries; it
    must equal the dense path on the same inputs (GQA grouping, bottom-right causal, window,
    softcap)."""
    from flashtile.integrations import transformers as tb

    g = torch.Generator().manual_seed(sq)
    q = torch.randn(2, 6, sq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 11, 16, generator=g, dtype=torch.float64) for _ in range(2))
    module = torch.nn.Module()
    args = dict(scaling=0.3, sliding_window=window, softcap=softcap, is_causal=True)
    with torch.no_grad():
        monkeypatch.setenv(tb.DECODE_KERNEL_ENV, "0")
        dense, _ = tb.attention_forward(module, q, k, v, None, **args)
        monkeypatch.setenv(tb.DECODE_KERNEL_ENV, "1")
        called = []
        real = tb._decode_over_cache
        monkeypatch.setattr(tb, "_decode_over_cache", lambda *a: called.append(1) or real(*a))
        routed, _ = tb.attention_forward(module, q, k, v, None, **args)
    assert called and tb._decode_over_cache is not real
    torch.testing.assert_close(routed, dense, atol=1e-12, rtol=1e-12)


def test_greedy_generation_with_decode_kernel_route_matches_eager(monkeypatch):
    """model.generate with decode steps routed through flash_attn_with_kvcache (opt-in)."""
    from flashtile.integrations import transformers as tb

    monkeypatch.setenv(tb.DECODE_KERNEL_ENV, "1")
    routed = []
    real = tb._decode_over_cache
    monkeypatch.setattr(tb, "_decode_over_cache", lambda *a: (lambda r: routed.append(r is not None) or r)(real(*a)))
    ref, ours = _pair(*CONFIGS["mistral_sliding"])
    ref.eval(), ours.eval()
    prompt = _ids(batch=1, seq=6)
    kwargs = dict(max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    torch.testing.assert_close(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs), atol=0, rtol=0)
    assert sum(routed) >= 9, f"decode steps routed: {sum(routed)} of {len(routed)}"  # 9 steps x layers
