"""flash-attn 2's padding helpers (``flashtile.bert_padding``): the packed layout round trip,
and a padded batch through ``flash_attn_varlen_func`` equal to each row attended alone."""

from __future__ import annotations

import inspect

import torch

import flashtile
from flashtile import bert_padding as bp

F64 = torch.float64


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_signatures_are_flash_attn_2s():
    names = {"unpad_input": ["hidden_states", "attention_mask", "unused_mask"],
             "pad_input": ["hidden_states", "indices", "batch", "seqlen"],
             "unpad_input_for_concatenated_sequences": ["hidden_states", "attention_mask_in_length"]}
    for name, params in names.items():
        assert list(inspect.signature(getattr(bp, name)).parameters) == params, name


def test_unpad_then_pad_round_trips_and_pads_with_zeros():
    x = rand(3, 6, 4, seed=1).requires_grad_()
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    tokens, indices, cu, max_len, used = bp.unpad_input(x, mask)
    assert tokens.shape == (12, 4) and cu.tolist() == [0, 4, 10, 12] and max_len == 6 and used.tolist() == [4, 6, 2]
    assert cu.dtype == torch.int32 and used.dtype == torch.int32
    back = bp.pad_input(tokens, indices, 3, 6)
    assert torch.equal(back[mask.bool()], x[mask.bool()]) and (back[~mask.bool()] == 0).all()
    (g,) = torch.autograd.grad(back.sum(), x)
    assert torch.equal(g, mask[..., None].to(F64).expand_as(g)), "gradient flows to the kept tokens only"


def test_unused_tokens_stay_in_the_layout_past_seqused():
    x = rand(2, 5, 3, seed=2)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 0, 1, 1]])
    tokens, _, cu, max_len, used = bp.unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 3, 8] and used.tolist() == [2, 3] and max_len == 5 and tokens.shape == (8, 3)


def test_concatenated_sequences_become_sequences_of_their_own():
    x = rand(3, 6, 2, seed=3)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    tokens, indices, cu, max_len = bp.unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and max_len == 6 and tokens.shape == (16, 2)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, *range(12, 18)]


def test_padded_batch_through_varlen_equals_each_row_alone():
    q, k, v = rand(3, 7, 4, 8, seed=4), rand(3, 7, 2, 8, seed=5), rand(3, 7, 2, 8, seed=6)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7, [1, 1, 1, 0, 0, 0, 0]])
    qu, idx, cu, m, _ = bp.unpad_input(q, mask)
    ku, vu = bp.unpad_input(k, mask)[0], bp.unpad_input(v, mask)[0]
    out = bp.pad_input(flashtile.flash_attn_varlen_func(qu, ku, vu, cu, cu, m, m, causal=True), idx, 3, 7)
    for b in range(3):
        keep = mask[b].bool()
        alone = flashtile.flash_attn_func(q[b : b + 1, keep], k[b : b + 1, keep], v[b : b + 1, keep], causal=True)
        torch.testing.assert_close(out[b, keep], alone[0], rtol=0, atol=1e-12)
        assert (out[b, ~keep] == 0).all()
