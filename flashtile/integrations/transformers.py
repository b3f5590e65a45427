"""Hugging Face ``transformers`` backend: ``attn_implementation="tile_attention"``.

    import flashtile
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tile_attention")

``import flashtile`` calls ``register()`` itself, at once if transformers' model code is
loaded and otherwise when it loads (``flashtile/integrations/autoregister.py``; off with
``FLASHTILE_HF_AUTOREGISTER=0``).  Call ``register()`` directly for another name.
``register()`` adds two functions to transformers' global registries:

- ``attention_forward`` to ``AttentionInterface``: the attention itself, through
  ``flashtile.flash_attn_func``, and unmasked decode steps through ``flash_attn_with_kvcache``'s
  decode kernel (``_decode_over_cache``; ``FLASHTILE_HF_DECODE_KERNEL=0`` turns that off);
- ``attention_mask`` to ``AttentionMaskInterface``: the mask builder.  Like flash-attn's, it
  returns ``None``, because flashtile builds causal / sliding-window masks from the model's
  arguments; before doing so it checks that the mask the model asked for is one flashtile
  computes exactly, and raises otherwise.

Why not the name "flashtile": transformers (5.x) treats every implementation name containing
"flash" as a flash-attn package or Hub kernel and tries to import it when the model is built
(``is_flash_attention_requested`` / ``lazy_import_flash_attention``), which fails for any
other library.  ``register`` refuses such names for that reason.

Argument mapping (transformers -> ``flash_attn_func``):

- query/key/value (batch, heads, seq, dim) -> transposed views (batch, seq, heads, dim); GQA
  is passed through without repeating kv heads (same head grouping as ``repeat_kv``);
- ``scaling`` -> ``softmax_scale``; ``softcap`` (Gemma 2) -> ``softcap``; ``s_aux`` (gpt-oss
  sinks) -> ``sinks``;
- ``is_causal`` kwarg, else ``module.is_causal`` (default True) -> ``causal``;
- ``sliding_window=w`` -> ``window_size=(w - 1, w - 1)``, exactly transformers' flash-attention
  convention (``_process_flash_attention_kwargs``); with causal the right side is 0, so a
  query sees itself and the ``w - 1`` keys before it, as the eager mask
  ``kv_idx > q_idx - w`` does.  Models adapt the value they pass to that convention (e.g.
  ModernBERT passes ``config.sliding_window + 1`` for its symmetric window);
- ``deterministic`` kwarg, else ``torch.are_deterministic_algorithms_enabled()``.

Padded and packed batches run through ``flashtile.flash_attn_varlen_func``, as transformers'
own flash-attention path does (``modeling_flash_attention_utils._flash_attention_forward``):

- padding: the mask function returns the 2D padding mask (as transformers' flash mask does)
  when it holds a 0; the attention function drops the pad tokens (left, right or both),
  runs the real tokens as packed sequences and scatters the result back (pad rows output 0);
- padding-free packing (``DataCollatorWithFlattening``): with ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` kwargs those are used directly; otherwise ``position_ids`` restarting
  inside a row (any batch size; rows never attend to each other) split the tokens into
  documents, each attended to on its own with its own causal / sliding-window mask.  Models
  whose attention modules do not receive ``position_ids`` (Llama 4) get the documents from
  the mask function (``MaskInfo.documents``).

Chunked attention (Llama 4's ``chunked_attention`` layers, ``attention_chunk_size``), eager and
under ``torch.compile`` (where padding is refused anyway): the mask function hands ``attention_forward`` the chunk size and the cache position of the
first key (``MaskInfo``); the keys start at the first query's chunk (a sliding cache keeps
only the last ``chunk - 1``) and the call passes ``attention_chunk``.  In a left-padded batch
each row's chunks count from its first real token, so the padding mask also hides each row's
keys before its first query's chunk, and the unpadded sequences are chunked from there.

Refused with an error instead of being ignored:

- under ``torch.compile`` / ``torch.export``: padding, and packing given only by
  ``position_ids`` (both need data-dependent shapes; pass ``cu_seq_lens_*`` kwargs for packing);
- a padding mask with holes (zeros between real tokens) together with a sliding window (the
  window would be measured over the compacted tokens);
- any 4D mask that is not exactly the causal / sliding-window pattern computed here;
- block-wise patterns, packed sequences with a chunk after the cache dropped keys, custom ``or_mask_function`` /
  ``and_mask_function`` overlays, and mask functions this module does not recognise
  (NotImplementedError);
- KV caches whose keys include unfilled slots (static caches), paged caches, a partial set of
  the ``cu_seq_lens_q/k``, ``max_length_q/k`` kwargs and the older ``cu_seqlens`` /
  ``max_seqlen`` ones (NotImplementedError);
- attention dropout > 0 while the module is training (NotImplementedError);
- ``output_attentions=True`` (ValueError): flashtile never materialises the probabilities.

Under ``torch.compile`` / ``torch.export`` the value checks (padding and ``position_ids``
packing, non-None masks) become ``torch._assert_async`` nodes, so they do not break the graph and still fail
loudly at run time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

import transformers
from transformers import masking_utils

from ..bert_padding import cu_seqlens_of
from ..interface import flash_attn_func
from ..kvcache import flash_attn_with_kvcache
from ..varlen import flash_attn_varlen_func
from ..reference import visible_mask

__all__ = ["ATTN_IMPLEMENTATION", "register", "attention_forward", "attention_mask"]

ATTN_IMPLEMENTATION = "tile_attention"

_HINT = "use attn_implementation='sdpa' or 'eager' for this input"


def _tracing(t: Optional[torch.Tensor] = None) -> bool:
    try:
        from transformers.utils.import_utils import is_tracing

        return bool(is_tracing(t))
    except ImportError:  # older transformers
        return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _require_all(cond: torch.Tensor, make_error) -> None:
    """Raise ``make_error()`` unless the boolean tensor ``cond`` is all True.

    Eager: a Python check (one sync).  Traced: ``torch._assert_async`` (no graph break, still
    fails at run time, with a device-side assert on CUDA).
    """
    if _tracing(cond):
        torch._assert_async(cond.all(), str(make_error()))
    elif not bool(cond.all()):
        raise make_error()


# --- mask function: which transformers mask patterns flashtile reproduces ----------------------


def _code_of(factory, *args):
    try:
        return factory(*args).__code__
    except Exception:  # noqa: BLE001 - a helper missing or changed in this transformers version
        return None


def _known_codes() -> tuple:
    """((kind, code object), ...) of transformers' mask-function building blocks."""
    mu = masking_utils
    dummy = torch.zeros(1, 1, dtype=torch.long)
    codes = {
        "causal": getattr(getattr(mu, "causal_mask_function", None), "__code__", None),
        "bidirectional": getattr(getattr(mu, "bidirectional_mask_function", None), "__code__", None),
        "and": _code_of(getattr(mu, "and_masks", None), lambda *a: True),
        "or": _code_of(getattr(mu, "or_masks", None), lambda *a: True),
        "sliding": _code_of(getattr(mu, "sliding_window_overlay", None), 1),
        "sliding_bidirectional": _code_of(getattr(mu, "sliding_window_bidirectional_overlay", None), 1),
        "chunked": _code_of(getattr(mu, "chunked_overlay", None), 1, dummy[0]),
        "packed": _code_of(getattr(mu, "packed_sequence_mask_function", None), dummy),
        "packed_remap": _code_of(getattr(mu, "remap_positions_for_packed_sequence", None), lambda *a: True, dummy),
        "blockwise": _code_of(getattr(mu, "blockwise_overlay", None), dummy),
        "padding": _code_of(getattr(mu, "padding_mask_function", None), dummy),
    }
    return tuple((kind, code) for kind, code in codes.items() if code is not None)


_KNOWN = _known_codes()  # built at import, outside any tracing


def _kind(fn) -> str:
    code = getattr(fn, "__code__", None)
    for kind, known in _KNOWN:
        if code is known:
            return kind
    return "unknown"


def _cell_values(fn) -> list:
    """The values ``fn``'s closure holds (empty cells left out)."""
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # empty cell
            continue
    return values


def _walk(fn, seen=None):
    """Yield (kind, function) for ``fn`` and every mask function captured in its closure."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return
    seen.add(id(fn))
    yield _kind(fn), fn
    for value in _cell_values(fn):
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if callable(item) and hasattr(item, "__code__"):
                yield from _walk(item, seen)


def _unsupported(kind: str, fn) -> NotImplementedError:
    what = {
        "blockwise": "block-wise masks (bidirectional blocks, e.g. over image tokens)",
        "or": "block-wise or custom (or_mask_function) mask overlays",
        "padding": "padding masks inside the mask function",
        "packed": "packed sequences given only by position_ids under torch.compile / torch.export (pass "
        "cu_seq_lens_q/k and max_length_q/k kwargs, e.g. DataCollatorWithFlattening(return_flash_attn_kwargs=True))",
    }.get(kind, f"the mask function {getattr(fn, '__qualname__', fn)!r}")
    return NotImplementedError(
        f"flashtile: {what} are not supported; flashtile computes causal / sliding-window masks only; {_HINT}"
    )


def _check_chunk(config, kv_end: int) -> None:
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None or kv_end > chunk:
        raise NotImplementedError(
            f"flashtile: chunked attention (attention_chunk_size={chunk}) over {kv_end} tokens is not "
            f"supported here: under torch.compile / torch.export only sequences within one chunk (plain causal) "
            f"run, and eager runs need the config's attention_chunk_size; run it eagerly, or {_HINT}"
        )


@dataclass(frozen=True)
class MaskInfo:
    """``attention_mask``'s answer when the attention function needs more than the 2D padding
    mask, which is what transformers hands it:

    - ``chunk``: a chunked-attention layer (Llama 4's ``chunked_attention``) whose keys reach
      past one chunk; ``kv_offset`` is the cache position of the first key the attention
      function gets (a sliding cache keeps only the last ``chunk - 1``).  ``attention_forward``
      starts the keys at the first query's chunk and passes ``attention_chunk``, so chunks start
      at cache positions that are multiples of ``chunk``, as transformers' ``chunked_overlay``
      has them;
    - ``documents``: the packed batch's document index per token (transformers'
      ``packed_sequence_mask``), for models whose attention modules do not receive
      ``position_ids`` (Llama 4), where ``attention_forward`` could not see the packing;
    - ``padding``: the 2D padding mask or None."""

    chunk: Optional[int] = None
    kv_offset: int = 0
    documents: Optional[torch.Tensor] = None
    padding: Optional[torch.Tensor] = None


def _check_pattern(mask_function, kv_length, kv_offset, config, local_size, tracing: bool):
    """Refuse mask patterns other than causal, bidirectional, (causal or symmetric) sliding window,
    chunked and packed; return (chunk size, documents): the chunk size when the pattern is
    chunked over more than one chunk (eager only: traced, that is refused) and the packed
    batch's document indices (eager only), each else None.

    Eager: walk the mask function's closure tree (transformers composes patterns from small
    closures) and refuse every building block flashtile does not reproduce.  Traced: dynamo
    cannot read closures built inside the graph, so only the outermost function is checked
    (``or_masks`` means a block-wise / custom overlay); packing is then checked on
    ``position_ids`` by ``attention_forward`` and chunking through the config.
    """
    if tracing:
        kind = _kind(mask_function)
        if kind in ("causal", "bidirectional"):
            return None, None
        if kind == "and":  # a chunked layer's pattern (chunk overlay and causal) when local_size is the chunk
            chunk = getattr(config, "attention_chunk_size", None)
            if chunk is not None and local_size == chunk and kv_length + kv_offset > chunk:
                return chunk, None
            return None, None
        raise _unsupported(kind, mask_function)
    chunked = documents = None
    for kind, fn in _walk(mask_function):
        if kind in ("causal", "bidirectional", "and", "or", "sliding", "sliding_bidirectional", "packed_remap"):
            continue  # "or" alone is harmless; what it combines is checked on its own
        if kind == "packed":  # varlen, by document: the indices are the closure's tensor
            documents = next((v for v in _cell_values(fn) if isinstance(v, torch.Tensor)), None)
            continue
        if kind == "chunked":
            chunk = getattr(config, "attention_chunk_size", None)
            if chunk is None:
                _check_chunk(config, kv_length + kv_offset)
            if kv_length + kv_offset > chunk:
                chunked = chunk
            continue
        raise _unsupported(kind, fn)
    return chunked, documents


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    use_vmap: bool = False,
    config=None,
    **kwargs,
) -> None:
    """transformers mask function for flashtile: validate, then return None, or the 2D padding
    mask when the batch is padded (as transformers' ``flash_attention_mask`` does).

    flashtile derives the mask from ``is_causal`` / ``sliding_window`` in the attention call,
    so this only checks that the requested pattern is one of those and raises otherwise.
    Padded batches run unpadded through ``flash_attn_varlen_func`` (``_attention_unpadded``).
    """
    if use_vmap:
        raise NotImplementedError(
            "flashtile: custom mask overlays (or_mask_function / and_mask_function, e.g. bidirectional "
            f"attention over image tokens) are not supported; {_HINT}"
        )
    tracing = _tracing(attention_mask)
    chunk = documents = None
    if mask_function is not None:
        chunk, documents = _check_pattern(mask_function, kv_length, kv_offset, config, kwargs.get("local_size"), tracing)
    if isinstance(q_offset, torch.Tensor):
        raise NotImplementedError(
            "flashtile: static KV caches are not supported (their keys include unfilled slots that only "
            f"a mask hides); use the default DynamicCache or {_HINT}"
        )
    if q_offset + q_length != kv_offset + kv_length:
        raise NotImplementedError(
            f"flashtile: the keys (positions {kv_offset}..{kv_offset + kv_length - 1}) do not end at the last "
            f"query (position {q_offset + q_length - 1}), as with the unfilled slots of a static KV cache; "
            f"flashtile needs them to end together (e.g. DynamicCache), or {_HINT}"
        )
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"flashtile: expected a 2D padding mask (batch, seq), got shape {tuple(attention_mask.shape)}"
            )
        full, attention_mask = attention_mask, attention_mask[:, -kv_length:].bool()  # as transformers' flash_attention_mask
        if tracing:  # unpadding has data-dependent shapes: refused in a graph (a runtime assert)
            _require_all(
                attention_mask,
                lambda: ValueError(
                    "flashtile: attention_mask contains padding (zeros), which flashtile runs unpadded (varlen) "
                    "in eager mode only, not under torch.compile / torch.export. Run the padded batch eagerly, "
                    f"without padding (padding-free packing with cu_seq_lens_* kwargs), or {_HINT}"
                ),
            )
        elif chunk is None:
            if not bool(attention_mask.all()):
                return attention_mask  # padding: attention_forward runs the batch unpadded (varlen)
        elif not bool(full.all()):  # padding anywhere (even in dropped keys): rows' chunks start apart
            return MaskInfo(chunk, int(kv_offset), documents, _hide_before_chunk(full, attention_mask, q_offset, kv_offset, chunk))
    if chunk is None and documents is None:
        return None
    return MaskInfo(chunk, int(kv_offset), documents)


def _hide_before_chunk(full: torch.Tensor, padding: torch.Tensor, q_offset: int, kv_offset: int, chunk: int):
    """The padding mask (batch, kv_length) of a chunked layer with the keys before each row's
    first-query chunk hidden too.  transformers counts a row's chunks from its first real token
    (``chunked_overlay``: positions minus the row's left padding, from the full 2D mask), so
    rows start their chunks at different keys; with those keys gone, the packed call's chunks,
    counted from each sequence's first kept key, start where transformers' do."""
    left = (full.cumsum(-1) == 0).sum(-1)  # each row's left padding
    first = torch.div(q_offset - left, chunk, rounding_mode="floor") * chunk + left - kv_offset
    keys = torch.arange(padding.shape[-1], device=padding.device)[None, :]
    return padding & (keys >= first[:, None])


# --- attention function -----------------------------------------------------------------------


def _check_dense_mask(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, window, device) -> None:
    """A mask passed to the attention function is accepted only if it equals flashtile's own."""
    if mask.dim() != 4 or mask.shape[-2:] != (seqlen_q, seqlen_k):
        raise ValueError(
            "flashtile: got an attention mask of shape "
            f"{tuple(mask.shape)}; only None or a 4D mask equal to the causal / sliding-window pattern "
            f"(batch, 1, {seqlen_q}, {seqlen_k}) is supported; {_HINT}"
        )
    vis = visible_mask(torch.arange(seqlen_q, device=device), seqlen_k, seqlen_q, window)
    if vis is None:
        vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if mask.dtype == torch.bool:
        keep = mask
        ok = keep == vis
    else:  # additive: 0 where kept, a huge negative value (or -inf) where dropped
        threshold = torch.finfo(mask.dtype).min / 2
        ok = torch.where(vis, mask == 0, mask <= threshold)
    _require_all(
        ok,
        lambda: ValueError(
            "flashtile: the attention mask is not the plain causal / sliding-window pattern (padding or a "
            f"custom mask); flashtile computes its masks itself and cannot apply this one; {_HINT}"
        ),
    )


# --- padded and packed batches: flash_attn_varlen_func ------------------------------------------

_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # all four, or none
_OLD_VARLEN_KWARGS = ("cu_seqlens", "max_seqlen")


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(batch, seq, heads, dim) -> (batch * seq, heads, dim)."""
    return x.reshape(-1, *x.shape[2:])


def _attention_unpadded(q, k, v, mask: torch.Tensor, sliding: bool, opts: dict) -> torch.Tensor:
    """A padded batch (b, s, h, d) with its 2D padding mask (b, seqlen_k), True = real token.

    The real tokens of each row become one packed sequence (queries: the last seqlen_q mask
    columns, since the keys end at the last query); the output of pad query rows is 0.
    """
    b, sq = q.shape[:2]
    sk = k.shape[1]
    if mask.shape != (b, sk):
        raise ValueError(f"flashtile: the 2D padding mask has shape {tuple(mask.shape)}, expected (batch, seqlen_k) = ({b}, {sk})")
    mask = mask.bool()
    if sliding:  # a window over compacted tokens is the model's only if the real tokens are contiguous
        first = mask.int().argmax(-1, keepdim=True)
        cols = torch.arange(sk, device=mask.device)
        contiguous = (cols >= first) & (cols < first + mask.sum(-1, keepdim=True))
        if not torch.equal(contiguous, mask):
            raise NotImplementedError(
                "flashtile: a padding mask with zeros between real tokens and a sliding window is not supported "
                f"(only left / right padding); {_HINT}"
            )
    mask_q = mask[:, sk - sq :]
    idx_q = mask_q.flatten().nonzero().flatten()
    idx_k = mask.flatten().nonzero().flatten()
    len_q, len_k = mask_q.sum(-1, dtype=torch.int32), mask.sum(-1, dtype=torch.int32)
    out = flash_attn_varlen_func(
        _tokens(q)[idx_q], _tokens(k)[idx_k], _tokens(v)[idx_k], cu_seqlens_of(len_q), cu_seqlens_of(len_k),
        int(len_q.max()), int(len_k.max()), **opts,
    )
    full = out.new_zeros(b * sq, *out.shape[1:]).index_copy(0, idx_q, out)
    return full.view(b, sq, *out.shape[1:])


def _packed_documents(position_ids: Optional[torch.Tensor], documents: Optional[torch.Tensor], b: int,
                      s: int) -> Optional[tuple[torch.Tensor, int]]:
    """(cu_seqlens over the b * s flattened tokens, longest document), or None when no row restarts.

    A document starts at every row start and wherever ``position_ids`` do not go on by +1,
    transformers' rule (``masking_utils.find_packed_sequence_indices``), or, without them, where
    the document index (``MaskInfo.documents``) changes.  Reads the ids (a sync).
    """
    if position_ids is not None:
        pos = position_ids.expand(b, s)
        restarts = pos[:, 1:] != pos[:, :-1] + 1
    else:
        doc = documents.expand(b, s)
        restarts = doc[:, 1:] != doc[:, :-1]
    if not bool(restarts.any()):
        return None
    starts = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=restarts.device), restarts], dim=1)
    idx = starts.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([idx, idx.new_full((1,), b * s)])
    return cu, int((cu[1:] - cu[:-1]).max())


# Decode steps through the KV-cache decode kernel: on by default since the route passed its GPU
# tests (tests/test_gpu_integration.py, H100, 2026-11-23); "0" sends them to the dense kernel.
DECODE_KERNEL_ENV = "FLASHTILE_HF_DECODE_KERNEL"
_DECODE_MAX_Q = 16  # new tokens per step (speculative decoding proposes a few)


def _decode_over_cache(query, key, value, opts: dict, start: int = 0) -> Optional[torch.Tensor]:
    """A decode step -- a few new queries over the model's whole key cache, no mask -- through
    ``flash_attn_with_kvcache``'s split-KV decode kernel instead of the dense kernel, or None
    when the step does not qualify (the caller then runs ``flash_attn_func``).

    query (b, h, sq, d) and key/value (b, hkv, sk, d) as transformers passes them (contiguous
    after its cache update).  Each (batch entry, kv head) becomes one cache entry with one kv
    head: ``key.reshape(b * hkv, sk, 1, d)`` is a view, so no cache bytes are copied; the
    queries of that kv head's group (heads ``hk * g .. hk * g + g - 1``, the grouping of
    ``repeat_kv``) become its query heads.  Bottom-right causal / window alignment over the
    ``sk`` keys is the same rule as ``flash_attn_func``'s.  ``start``: keys before it are
    invisible (a chunked layer's keys before the queries' chunk), the cache's left pad.  Not
    with sinks (their per-head values would need the folded head index).
    """
    if os.environ.get(DECODE_KERNEL_ENV, "1") in ("", "0") or opts["sinks"] is not None or torch.is_grad_enabled():
        return None
    b, h, sq, d = query.shape
    hkv, sk, dv = key.shape[1], key.shape[2], value.shape[-1]
    if not (0 < sq <= _DECODE_MAX_Q and sq < sk and h % hkv == 0 and key.is_contiguous() and value.is_contiguous()):
        return None
    g = h // hkv
    kc, vc = key.reshape(b * hkv, sk, 1, d), value.reshape(b * hkv, sk, 1, dv)
    q = query.reshape(b, hkv, g, sq, d).permute(0, 1, 3, 2, 4).reshape(b * hkv, sq, g, d)
    if q.is_cuda:
        from ..kernels.decode import unsupported_reason

        if unsupported_reason(q, kc, vc) is not None:
            return None
    leftpad = torch.full((b * hkv,), start, dtype=torch.int32, device=q.device) if start else None
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sk, cache_leftpad=leftpad, softmax_scale=opts["softmax_scale"],
                                  causal=opts["causal"], window_size=opts["window_size"], softcap=opts["softcap"])
    return out.reshape(b, hkv, sq, g, dv).permute(0, 2, 1, 3, 4).reshape(b, sq, h, dv)


def _first_chunk_key(mask: MaskInfo, query, key, packed: bool) -> int:
    """The index of the first key of the first query's chunk in ``key`` (batch, kv heads, seq,
    dim): transformers' chunks start at cache positions that are multiples of the size,
    ``flash_attn_func``'s at its first key, and no query sees a key before its own chunk, so the
    keys are used from there.  0 for padded and packed batches: their chunks count from each
    sequence's first token (``flash_attn_varlen_func``; the padding mask hides each row's keys
    before its chunk)."""
    if mask.padding is not None:
        return 0
    if packed:
        if mask.kv_offset:
            raise NotImplementedError(f"flashtile: chunked attention over packed sequences after the cache dropped "
                                      f"keys (from position {mask.kv_offset}) is not supported; {_HINT}")
        return 0
    first = mask.kv_offset + key.shape[2] - query.shape[2]  # cache position of the first query
    start = first // mask.chunk * mask.chunk - mask.kv_offset
    if start < 0:
        raise NotImplementedError(f"flashtile: the keys (from cache position {mask.kv_offset}) start after the first "
                                  f"query's chunk (from {start + mask.kv_offset}): that chunk's keys are gone; {_HINT}")
    return start


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (batch, heads, seq, dim) in, (batch, seq, heads, dim_v) out."""
    if kwargs.get("output_attentions", False):
        raise ValueError("flashtile: output_attentions=True is not supported (probabilities are never materialised); use attn_implementation='eager'")
    for name in _OLD_VARLEN_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"flashtile: the {name} kwarg is not supported; pass cu_seq_lens_q/k and max_length_q/k (as "
                f"transformers' DataCollatorWithFlattening does), or {_HINT}"
            )
    varlen_kwargs = [kwargs.get(name) for name in _VARLEN_KWARGS]
    if any(x is not None for x in varlen_kwargs) and not all(x is not None for x in varlen_kwargs):
        given = [n for n, x in zip(_VARLEN_KWARGS, varlen_kwargs) if x is not None]
        raise NotImplementedError(f"flashtile: padding-free kwargs need all of {', '.join(_VARLEN_KWARGS)}; got only {', '.join(given)}")
    if kwargs.get("cache") is not None:
        raise NotImplementedError(f"flashtile: paged KV caches (continuous batching) are not supported; {_HINT}")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"flashtile: additive position_bias is not supported; {_HINT}")
    if dropout and dropout > 0 and getattr(module, "training", True):
        raise NotImplementedError(
            f"flashtile: attention dropout ({dropout}) is not supported; set the config's attention_dropout to 0 "
            "or call model.eval()"
        )

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    window = (-1, -1)
    if sliding_window is not None:
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"flashtile: sliding_window must be a positive int, got {sliding_window!r}")
        window = (sliding_window - 1, sliding_window - 1)  # transformers' flash-attention convention
    softcap = 0.0 if softcap is None else float(softcap)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()

    opts = dict(
        softmax_scale=scaling, causal=bool(is_causal), window_size=window, sinks=s_aux, softcap=softcap,
        deterministic=bool(deterministic),
    )
    chunked, documents, start = False, None, 0
    if isinstance(attention_mask, MaskInfo):
        info, attention_mask, documents = attention_mask, attention_mask.padding, attention_mask.documents
        chunked = info.chunk is not None  # a chunked layer whose keys reach past one chunk
        if chunked:
            start = _first_chunk_key(info, query, key, packed=varlen_kwargs[0] is not None or documents is not None)
            opts["attention_chunk"] = info.chunk
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]

    # The same order as transformers' _flash_attention_forward: padding, varlen kwargs, packing.
    if attention_mask is not None and attention_mask.dim() == 2:  # from ``attention_mask`` above
        return _attention_unpadded(q, k, v, attention_mask, sliding_window is not None or chunked, opts), None
    if varlen_kwargs[0] is not None:  # padding-free with cu_seq_lens_*: the tokens of all rows, in order
        cu_q, cu_k, max_q, max_k = varlen_kwargs
        out = flash_attn_varlen_func(
            _tokens(q), _tokens(k), _tokens(v), cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), **opts
        )
        return out.view(b, sq, *out.shape[1:]), None

    position_ids = kwargs.get("position_ids")
    if not (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[-1] == sq):
        position_ids = None  # the mask function's document indices, if any, stand in for them
    if (position_ids is not None or documents is not None) and sq == sk > 1:
        if _tracing(query):
            # Traced, packing would need data-dependent shapes (and transformers cannot tell packed
            # rows from plain ones, see _check_pattern): refused at run time.
            _require_all(position_ids[:, 1:] - position_ids[:, :-1] == 1, lambda: _unsupported("packed", None))
        else:
            packed = _packed_documents(position_ids, documents, b, sq)
            if packed is not None:
                cu, longest = packed
                out = flash_attn_varlen_func(_tokens(q), _tokens(k), _tokens(v), cu, cu, longest, longest, **opts)
                return out.view(b, sq, *out.shape[1:]), None

    if attention_mask is not None:
        folded = (window[0], 0) if is_causal else window
        _check_dense_mask(attention_mask, sq, sk, folded, q.device)
    elif not _tracing(query) and (not chunked or sk - start <= opts["attention_chunk"]):  # one chunk: a left pad
        out = _decode_over_cache(query, key, value, opts, start)
        if out is not None:
            return out, None
    return flash_attn_func(q, k[:, start:], v[:, start:], **opts), None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register flashtile with transformers' attention and mask registries under ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)``, ``from_config(...)`` and
    ``model.set_attn_implementation(name)`` use it.  Idempotent.  Returns ``name``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _refuse_flash_like(name)
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def _refuse_flash_like(name: str) -> None:
    try:
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:  # older transformers: no such routing
        return
    if is_flash_attention_requested(requested_attention_implementation=name) or "/" in name:
        raise ValueError(
            f"flashtile: cannot register under {name!r}: transformers {transformers.__version__} treats names "
            "containing 'flash' (or 'org/repo') as flash-attn packages / Hub kernels and tries to import them. "
            f"Use the default {ATTN_IMPLEMENTATION!r} or another name."
        )
