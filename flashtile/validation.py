"""Argument checks shared by every public entry point.

Each check refuses bad input before any work with a ``TypeError`` (wrong kind of thing) or a
``ValueError`` (right kind, bad value) whose message reads
``"<fn>: <arg> must be <expected>, got <given>"``; options flashtile does not implement raise
``NotImplementedError`` naming the argument.

The checks run inside ``torch.compile(fullgraph=True)`` traces too: they only use
``isinstance`` and comparisons on the hot path, and format messages only when they fail.
"""

from __future__ import annotations

import math
import numbers

import torch

_SYM_REAL = (torch.SymInt, torch.SymFloat)
_SYM_BOOL = (torch.SymBool,)
# isinstance tuples built once (a tuple concatenation per check is measurable per call).
_REAL_TYPES = (int, float) + _SYM_REAL
_INT_TYPES = (int, torch.SymInt)
_FLAG_TYPES = (bool,) + _SYM_BOOL


def fail(fn: str, kind: type[Exception], arg: str, expected: str, given) -> None:
    """Raise ``kind("<fn>: <arg> must be <expected>, got <given>")``."""
    raise kind(f"{fn}: {arg} must be {expected}, got {given}")


def describe(value) -> str:
    """A short, unambiguous rendering of a given value for an error message: its type, and
    its value when that is short (a tensor shows shape and dtype, never its data)."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    t = type(value)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__qualname__}"
    return f"{name} {text}"


def is_real(x) -> bool:
    """A real number (Python, numpy or symbolic under torch.compile), not a bool, not a tensor."""
    if isinstance(x, (bool, torch.Tensor)):
        return False
    if isinstance(x, _REAL_TYPES):
        return True
    # numpy scalars and other registered reals; numpy.bool_ is not a numbers.Real.
    return isinstance(x, numbers.Real)


def is_int(x) -> bool:
    """An integer (Python, numpy or symbolic), not a bool."""
    if isinstance(x, bool):
        return False
    if isinstance(x, _INT_TYPES):
        return True
    return isinstance(x, numbers.Integral) and not isinstance(x, torch.Tensor)


def is_finite(x) -> bool:
    # Comparisons instead of math.isfinite: they also work on SymFloat without a graph break.
    return x == x and -math.inf < x < math.inf


def check_flags(fn: str, **flags) -> None:
    """``check_flag`` on each keyword, in order; plain bools (the common case) pass at once."""
    for value in flags.values():
        if type(value) is not bool:
            for name, flag in flags.items():
                check_flag(fn, name, flag)
            return


def check_flag(fn: str, name: str, value) -> None:
    """A flag must be a Python ``bool``: ``'no'``, ``1`` or a tensor are refused, since
    truthiness would silently turn ``deterministic='no'`` into True."""
    if not isinstance(value, _FLAG_TYPES):
        fail(fn, TypeError, name, "a bool (True or False)", describe(value))


def check_scale(fn: str, name: str, value) -> None:
    """None, or a finite real number (a tensor is refused: pass ``float(t)``)."""
    if value is None:
        return
    if not is_real(value):
        fail(fn, TypeError, name, "None or a finite real number (float)", describe(value))
    if not is_finite(value):
        fail(fn, ValueError, name, "None or a finite real number (float)", value)


def check_softcap(fn: str, value, name: str = "softcap") -> None:
    """A finite real number >= 0 (0 = off)."""
    if type(value) is float and 0.0 <= value < math.inf:  # the common case, checked first
        return
    if not is_real(value):
        fail(fn, TypeError, name, "a real number (float)", describe(value))
    if not is_finite(value) or value < 0:
        fail(fn, ValueError, name, "a finite float >= 0 (0 = off)", value)


def check_window(fn: str, window_size, name: str = "window_size") -> None:
    """A pair of ints ``(left, right)``, each >= -1 (-1 = unbounded)."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, checked first
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return
    if not (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(is_int(w) for w in window_size)
    ):
        fail(fn, TypeError, name, "a pair of ints (left, right)", describe(window_size))
    for side, w in zip(("left", "right"), window_size):
        if w < -1:
            fail(fn, ValueError, f"{name} {side}", ">= -1 (-1 = unbounded)", w)


def check_chunk(fn: str, value, name: str = "attention_chunk") -> None:
    """A chunk size: an int >= 0 (0 = no chunking)."""
    if not is_int(value):
        fail(fn, TypeError, name, "an int >= 0 (0 = off)", describe(value))
    if value < 0:
        fail(fn, ValueError, name, ">= 0 (0 = off)", value)


def check_tensor(fn: str, name: str, x, rank: int, layout: str, dtypes) -> None:
    """A ``rank``-D torch.Tensor (``layout`` names its dims in messages) of one of ``dtypes``."""
    if not isinstance(x, torch.Tensor):
        fail(fn, TypeError, name, "a torch.Tensor", describe(x))
    if x.dim() != rank:
        fail(fn, ValueError, name, f"a {rank}-D tensor {layout}", f"shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        fail(fn, TypeError, f"{name}.dtype", f"one of {names}", x.dtype)


def check_sinks(fn: str, sinks, nheads: int, device, name: str = "sinks") -> None:
    """None, or a floating ``(nheads,)`` tensor on ``device``."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        fail(fn, TypeError, name, "None or a torch.Tensor", describe(sinks))
    if sinks.shape != (nheads,):
        fail(fn, ValueError, name, f"shape (nheads,) = ({nheads},)", f"shape {tuple(sinks.shape)}")
    if not sinks.is_floating_point():
        fail(fn, TypeError, f"{name}.dtype", "a floating dtype", sinks.dtype)
    if sinks.device != device:
        fail(fn, ValueError, f"{name}.device", f"q's device {device}", sinks.device)


def reject_unsupported(fn: str, dropout_p=0.0, alibi_slopes=None) -> None:
    """flash-attn options flashtile does not implement: refused, never ignored.

    ``dropout_p`` may be 0 or None.  A nonzero value may also be a softmax scale passed
    fourth in flash-attn 3's order; the message says so.
    """
    if alibi_slopes is None and (dropout_p is None or (type(dropout_p) is float and dropout_p == 0.0)):
        return  # the common case, checked first
    if dropout_p is not None:
        if not is_real(dropout_p):
            fail(fn, TypeError, "dropout_p", "0.0 or None (flashtile has no attention dropout)", describe(dropout_p))
        if dropout_p != 0:
            raise NotImplementedError(
                f"{fn}: dropout_p={dropout_p} is not supported: flashtile has no attention dropout, "
                "pass dropout_p=0.0. The 4th positional argument is dropout_p, as in flash-attn 2; "
                "if this value is a softmax scale (flash-attn 3 puts softmax_scale 4th), pass it "
                "by keyword: softmax_scale=..."
            )
    if alibi_slopes is not None:
        raise NotImplementedError(
            f"{fn}: alibi_slopes is not supported (got {describe(alibi_slopes)}); pass alibi_slopes=None"
        )


# --- FP8 inputs (float8_e4m3fn with descales) -------------------------------------------------

FP8_DTYPE = torch.float8_e4m3fn
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
_OTHER_FP8 = {
    name: getattr(torch, name)
    for name in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
}


def check_fp8_dtype(fn: str, name: str, x) -> None:
    """Refuse FP8 formats other than float8_e4m3fn with the reason (before the generic dtype check)."""
    if isinstance(x, torch.Tensor) and x.dtype in _OTHER_FP8.values():
        fail(
            fn, TypeError, f"{name}.dtype",
            "float8_e4m3fn for FP8 attention (flash-attn 3's format: 3 mantissa bits; e5m2 has 2 and "
            "is meant for gradients, the fnuz/e8m0 formats are other vendors' or scale-only encodings; "
            "quantize with flashtile.fp8.quantize_fp8)",
            x.dtype,
        )


def check_fp8_mix(fn: str, q, k, v) -> None:
    """q, k, v are all float8_e4m3fn or none is (no mixed FP8 / non-FP8 inputs)."""
    n = sum(x.dtype == FP8_DTYPE for x in (q, k, v))
    if 0 < n < 3:
        fail(fn, TypeError, "q, k, v dtypes", "all float8_e4m3fn (FP8 attention) or none of them",
             f"{q.dtype}, {k.dtype}, {v.dtype}")


def check_descales(fn: str, descales, fp8: bool, batch: int, nheads_kv: int, device, fp8_what: str, plain_what: str) -> None:
    """FP8 descales ``((name, tensor or None), ...)``: each float32 ``(batch, nheads_kv)`` on
    ``device`` when ``fp8`` (the tensors they scale are float8_e4m3fn: ``fp8_what``), each None
    otherwise (``plain_what`` says why).  Shared by the attention functions' q/k/v descales and
    the KV cache's k/v descales."""
    if not fp8:
        for name, t in descales:
            if t is not None:
                fail(fn, ValueError, name, f"None for {plain_what}", describe(t))
        return
    expected = f"a float32 tensor of shape (batch, nheads_kv) = ({batch}, {nheads_kv}) for {fp8_what}"
    for name, t in descales:
        if t is None:
            fail(fn, ValueError, name, expected + " (real value = stored value x descale)", "None")
        if not isinstance(t, torch.Tensor):
            fail(fn, TypeError, name, expected, describe(t))
        if t.dtype != torch.float32:
            fail(fn, TypeError, f"{name}.dtype", "torch.float32", t.dtype)
        if t.shape != (batch, nheads_kv):
            fail(fn, ValueError, name, f"shape (batch, nheads_kv) = ({batch}, {nheads_kv})", f"shape {tuple(t.shape)}")
        if t.device != device:
            fail(fn, ValueError, f"{name}.device", f"q's device {device}", t.device)


def check_fp8_options(fn: str, q, k, v, sinks, q_descale, k_descale, v_descale, out_dtype, batch: int, nheads_kv: int) -> None:
    """The FP8 options: descales ``(batch, nheads_kv)`` float32 on q's device exactly when q, k, v
    are float8_e4m3fn; ``out_dtype`` bf16/fp16 (or None) for FP8, None or q's dtype otherwise.
    FP8 attention is forward-only (flash-attn 3's FP8 path has no backward): inputs that would
    need a gradient are refused."""
    fp8 = q.dtype == FP8_DTYPE
    if not fp8 and q_descale is None and k_descale is None and v_descale is None and (out_dtype is None or out_dtype == q.dtype):
        return  # the common case, without building the messages below
    descales = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    check_descales(fn, descales, fp8, batch, nheads_kv, q.device, "float8_e4m3fn inputs",
                   f"non-FP8 inputs (q.dtype is {q.dtype}; descales go with float8_e4m3fn q, k, v)")
    if not fp8:
        if out_dtype is not None and out_dtype != q.dtype:
            fail(fn, ValueError, "out_dtype", f"None or q's dtype {q.dtype} for non-FP8 inputs (out_dtype applies to float8_e4m3fn inputs)",
                 describe(out_dtype))
        return
    if out_dtype is not None and out_dtype not in FP8_OUT_DTYPES:
        fail(fn, TypeError, "out_dtype", "None (bfloat16), torch.bfloat16 or torch.float16 for FP8 inputs", describe(out_dtype))
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks)) + descales:
            if t is not None and t.requires_grad:
                raise NotImplementedError(
                    f"{fn}: {name} requires grad, but FP8 (float8_e4m3fn) attention is forward-only, as in "
                    "flash-attn 3: no gradients are produced. Run it under torch.no_grad() / "
                    "torch.inference_mode() or pass detached tensors; train in bf16/fp16."
                )
