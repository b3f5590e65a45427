"""Timing table: flashtile against cuDNN, flash and efficient SDPA, FlexAttention and flash-attn.

    flashtile bench                                   # default grid (GPU), or a small CPU run
    flashtile bench --decode --out DIR [--quick] [--fp8]   # KV-cache decode vs HBM bandwidth (GPU)
    flashtile bench --headdim 128 --seqlen 4k 16k --causal true --mode fwd bwd
    flashtile bench --json r.json --csv r.csv --plot r.png --markdown r.md

On CUDA the default grid is bf16, head dims 64/128/256 with nheads * headdim = 2048, seqlen 512
to 16k at 16k tokens in total (batch = 16k / seqlen), causal and not, MHA everywhere and GQA 4:1
at headdim 128; forward, backward and forward+backward.  Each case is timed for flashtile and
every anchor in the same process: PyTorch SDPA restricted to its cuDNN, flash and efficient
backends ((B, H, S, D) contiguous inputs), FlexAttention (torch.compile'd, block mask for
causal) and flash-attn when it is installed.

Method.  triton.testing.do_bench (median; L2 cleared before each run) or CUDA events when Triton
is missing; random inputs (torch.randn), never zeros.  Forward is timed as in training (inputs
require grad); backward times the backward alone (retain_graph, one fixed random dout, grads
reset to None between runs).  FLOPs follow flash-attn (``flashtile.flops``): forward
4 * B * H * Sq * Sk * D for full attention, exact visible pairs under causal/window, backward
2.5x and forward+backward 3.5x the forward.  Every flashtile result is first compared with the
float32 reference (``flashtile.reference``) on batch 0 and the first heads; a mismatch is never
timed and makes the exit status 1 (``--no-check`` skips the comparison).  A backend that cannot
run a case says why in one word (unsupported, oom, error, mismatch, skipped).

Without CUDA, the reference path of flashtile (PyTorch on CPU) is timed beside
torch.nn.functional.scaled_dot_product_attention at small sizes; no GPU kernel runs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Optional

import torch

from . import reference
from .flops import MODES, attention_flops
from .interface import flash_attn_func, normalize_window

BACKENDS = ("flashtile", "flashtile-fp8", "cudnn", "flash", "efficient", "flex", "flash-attn", "sdpa")
GPU_BACKENDS = ("flashtile", "flashtile-fp8", "cudnn", "flash", "efficient", "flex", "flash-attn")
CPU_BACKENDS = ("flashtile", "sdpa")
MODE_TITLES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}
BASELINE_LABELS = {"cudnn": "cuDNN", "sdpa": "SDPA"}
DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
# (out, gradients): max |x - ref| <= tol * max |ref| against the float32 reference.
TOLERANCES = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (1e-2, 3e-2), torch.float32: (1e-4, 1e-3)}
# flashtile-fp8 against the float32 reference of the unquantized inputs: q, k, v and P rounded to
# e4m3 (3 mantissa bits).  Long full-attention rows average many keys, so their outputs are small
# and the error is a larger share of the largest one: H100, 16k full d=64 and 4k GQA d=128 measured
# 0.10-0.11 (the GPU tests hold the kernel to 2x a same-rounding baseline; README "FP8").
FP8_TOLERANCE = 0.25

# Default grid on CUDA.  nheads * headdim = 2048 as in flash-attn's benchmark; GQA 4:1 only at
# the LLM head dim keeps the whole grid (48 cases x 3 modes x 5-6 backends) inside ~6 minutes
# of an H100 including every compile (FlexAttention compiles per mask/GQA/head-dim structure).
GPU_HEADDIMS = ((64, 64), (128, 128), (256, 256))
GPU_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
GPU_TOTAL_TOKENS = 16384
HEADS_TIMES_DIM = 2048
GPU_GQA_HEADDIMS = (128,)
GPU_DTYPE = "bf16"
# Without CUDA: small enough for 2 CPU cores in a few seconds.
CPU_HEADDIMS = ((64, 64),)
CPU_SEQLENS = (128, 256, 512)
CPU_BATCH, CPU_NHEADS = 1, 4
CPU_MODES = ("fwd", "fwdbwd")
CPU_DTYPE = "fp32"
DEFAULT_WARMUP_MS, DEFAULT_REP_MS = 10.0, 50.0

CPU_NOTE = (
    "NOTE: no CUDA GPU here, so the GPU kernels were NOT run.  This times flashtile's reference "
    "path (PyTorch on CPU) beside torch's CPU scaled_dot_product_attention at small sizes; the "
    "figures say nothing about GPU performance."
)


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def _size(tok: str) -> int:
    """'512', '4k', '16K' -> int >= 1."""
    t = tok.strip().lower()
    mult = 1024 if t.endswith("k") else 1
    value = int(t[:-1] if mult > 1 else t) * mult
    if value < 1:
        raise ValueError(f"expected a positive size, got {tok!r}")
    return value


def _headdim(tok: str) -> tuple[int, int]:
    """'128' -> (128, 128); '192/128' -> (headdim, headdim_v)."""
    parts = tok.split("/")
    if len(parts) > 2:
        raise ValueError(f"expected D or D/DV, got {tok!r}")
    dims = tuple(int(p) for p in parts)
    if min(dims) < 1:
        raise ValueError(f"head dims must be positive, got {tok!r}")
    return (dims[0], dims[-1])


def _mode(tok: str) -> tuple[str, ...]:
    t = tok.lower().replace("+", "").replace("_", "").replace("-", "")
    if t == "all":
        return MODES
    if t not in MODES:
        raise ValueError(f"expected one of {', '.join(MODES)} or all, got {tok!r}")
    return (t,)


def _backend(tok: str) -> tuple[str, ...]:
    t = tok.lower().replace("_", "-")
    t = {"flashattn": "flash-attn", "fa": "flash-attn", "mem-efficient": "efficient", "flexattention": "flex"}.get(t, t)
    if t == "all":
        return GPU_BACKENDS
    if t not in BACKENDS:
        raise ValueError(f"expected names from {', '.join(BACKENDS)}, got {tok!r}")
    return (t,)


def _kv_heads(tok: str) -> tuple[str, int]:
    """'4' -> ('abs', 4) kv heads; '4:1' -> ('ratio', 4) query heads per kv head."""
    if ":" in tok:
        g, one = tok.split(":")
        if int(one) != 1 or int(g) < 1:
            raise ValueError(f"expected a ratio G:1, got {tok!r}")
        return ("ratio", int(g))
    n = int(tok)
    if n < 1:
        raise ValueError(f"expected a positive head count, got {tok!r}")
    return ("abs", n)


def _window(tok: str) -> tuple[int, int]:
    parts = tok.replace(" ", "").split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (e.g. 256,0 or 128,-1), got {tok!r}")
    try:
        left, right = (int(p) for p in parts)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected two ints LEFT,RIGHT, got {tok!r}") from e
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"window entries must be >= -1 (-1 = unbounded), got {tok!r}")
    return (left, right)


def _list_action(convert: Callable[[str], object], flatten: bool = False):
    """argparse action: space- and/or comma-separated values, converted, duplicates dropped."""

    class _ListAction(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            items: list = []
            for value in values:
                for tok in str(value).split(","):
                    if not tok.strip():
                        continue
                    try:
                        got = convert(tok.strip())
                    except ValueError as e:
                        parser.error(f"argument {option_string}: {e}")
                    for item in (got if flatten else (got,)):
                        if item not in items:
                            items.append(item)
            setattr(namespace, self.dest, items)

    return _ListAction


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` flags; grid flags default to None and are resolved per device."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("grid (defaults depend on the device, see above)")
    g.add_argument("--headdim", nargs="+", action=_list_action(_headdim), metavar="D[/DV]",
                   help="head dims (GPU default 64 128 256; 192/128 sets headdim_v)")
    g.add_argument("--seqlen", nargs="+", action=_list_action(_size), metavar="S",
                   help="sequence lengths, q and k alike (GPU default 512 1k 2k 4k 8k 16k)")
    g.add_argument("--total-tokens", type=_size, metavar="N",
                   help="batch = N // seqlen (GPU default 16k); ignored with --batch")
    g.add_argument("--batch", type=_size, help="fixed batch size for every seqlen")
    g.add_argument("--nheads", type=_size,
                   help=f"query heads (GPU default {HEADS_TIMES_DIM} // headdim, a multiple of 4)")
    g.add_argument("--nheads-kv", nargs="+", action=_list_action(_kv_heads), metavar="N|G:1",
                   help="kv heads as a count or a ratio (GPU default 1:1, plus 4:1 at headdim 128)")
    g.add_argument("--causal", choices=("true", "false", "both"), default="both")
    g.add_argument("--window", type=_window, metavar="LEFT,RIGHT",
                   help="sliding window (-1 = unbounded); causal forces RIGHT=0")
    g.add_argument("--chunk", type=_size, default=0, metavar="C",
                   help="chunked local attention (attention_chunk, Llama 4) in chunks of C keys; backends "
                        "without it (SDPA) report unsupported, FlexAttention gets the chunk in its mask")
    g.add_argument("--mode", nargs="+", action=_list_action(_mode, flatten=True), metavar="MODE",
                   help="fwd, bwd, fwdbwd or all (GPU default all; CPU fwd fwdbwd)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="GPU default bf16, CPU fp32")
    g.add_argument("--backends", nargs="+", action=_list_action(_backend, flatten=True), metavar="NAME",
                   help=f"comma list from {', '.join(BACKENDS)} (sdpa = PyTorch's own choice)")
    t = parser.add_argument_group("timing")
    t.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_MS, metavar="MS", help="warm-up per timing (ms)")
    t.add_argument("--rep", type=float, default=DEFAULT_REP_MS, metavar="MS", help="timed repetitions per timing (ms)")
    t.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="time every case N times, the backends in turn each round; report the median "
                        "(clock and temperature drift then hits every backend alike)")
    t.add_argument("--no-check", action="store_true", help="do not compare flashtile with the reference first")
    t.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    t.add_argument("--cpu-threads", type=_size, default=1, metavar="N",
                   help="intra-op threads for the CPU run (default 1: the tensors are tiny, and spare "
                        "threads on a busy machine cost more than they give)")
    t.add_argument("--time-limit", type=float, metavar="S",
                   help="stop timing after S seconds; the rest is reported as skipped")
    g.add_argument("--decode", action="store_true",
                   help="time KV-cache decode instead (flashtile.bench_decode: flash_attn_with_kvcache against the "
                        "measured HBM read bandwidth, cuDNN / flash SDPA, FlexAttention, flash-attn if installed; "
                        "its own flags below)")
    from .bench_decode import add_arguments as add_decode_arguments

    add_decode_arguments(parser.add_argument_group("decode (with --decode)"))
    g.add_argument("--varlen", action="store_true",
                   help="time packed variable-length batches instead (flashtile.bench_varlen: varlen vs padded, "
                        "equal-length, nested-jagged SDPA, a per-sequence loop, flash-attn); honours --headdim, "
                        "--nheads, --causal, --mode, --dtype, timing and --json/--markdown")
    g.add_argument("--varlen-backends", nargs="+", metavar="NAME",
                   help="with --varlen: only these of flashtile-varlen, flashtile-padded, flashtile-equal, "
                        "sdpa-nested, loop, flash-attn (default all)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="every figure with the environment")
    o.add_argument("--csv", metavar="PATH", help="one row per (case, mode, backend), environment columns included")
    o.add_argument("--plot", metavar="PATH", help="PNG bar chart of TFLOP/s, one subplot per mode")
    o.add_argument("--markdown", metavar="PATH", help="Markdown tables")


# --------------------------------------------------------------------------------------------
# Plan: what to run
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    headdim_v: int
    causal: bool
    window: tuple[int, int]
    dtype: str
    chunk: int = 0  # attention_chunk (0: off)

    @property
    def mask(self) -> str:
        left, right = normalize_window(self.causal, self.window)
        if (left, right) == (-1, -1):
            mask = "full"
        elif (left, right) == (-1, 0):
            mask = "causal"
        else:
            mask = f"{'causal ' if self.causal else ''}window({left},{right})"
        return f"{mask} chunk{_short(self.chunk)}" if self.chunk else mask

    @property
    def dims(self) -> str:
        return str(self.headdim) if self.headdim == self.headdim_v else f"{self.headdim}/{self.headdim_v}"

    @property
    def heads(self) -> str:
        return f"{self.nheads}/{self.nheads_kv}"

    @property
    def seqlen(self) -> str:
        return str(self.seqlen_q) if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"

    @property
    def label(self) -> str:
        kv = "" if self.nheads == self.nheads_kv else f" gqa{self.nheads // self.nheads_kv}"
        return f"d{self.dims} s{_short(self.seqlen_q)} {self.mask}{kv}"

    def flops(self, mode: str) -> int:
        return attention_flops(self.batch, self.nheads, self.seqlen_q, self.seqlen_k, self.headdim,
                               self.headdim_v, self.causal, self.window, mode, self.chunk)

    def fields(self) -> dict:
        return {
            "batch": self.batch, "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k,
            "nheads": self.nheads, "nheads_kv": self.nheads_kv, "headdim": self.headdim,
            "headdim_v": self.headdim_v, "causal": self.causal, "window": list(self.window),
            "chunk": self.chunk, "mask": self.mask, "dtype": self.dtype,
        }


@dataclass
class Plan:
    device: str
    dtype: torch.dtype
    cases: list[Case]
    modes: tuple[str, ...]
    backends: tuple[str, ...]
    warmup: float
    rep: float
    check: bool
    time_limit: Optional[float]
    notes: list[str] = field(default_factory=list)
    rounds: int = 1  # timings per (case, backend, mode), taken in turn across the backends

    @property
    def baseline(self) -> Optional[str]:
        return next((b for b in ("cudnn", "sdpa") if b in self.backends), None)

    @property
    def timings(self) -> int:
        return len(self.cases) * len(self.backends) * len(self.modes) * self.rounds


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flash_attn_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("flash_attn_interface", "flash_attn"))


def resolve(args: argparse.Namespace, cuda_available: bool) -> Plan:
    """Turn the flags into a concrete plan for this machine; ValueError on a bad combination."""
    if args.device == "cuda" and not cuda_available:
        raise ValueError("--device cuda: no CUDA device is visible")
    device = "cuda" if (args.device == "cuda" or (args.device == "auto" and cuda_available)) else "cpu"
    gpu = device == "cuda"
    notes = []
    dtype = DTYPES[args.dtype or (GPU_DTYPE if gpu else CPU_DTYPE)]
    headdims = args.headdim or list(GPU_HEADDIMS if gpu else CPU_HEADDIMS)
    seqlens = args.seqlen or list(GPU_SEQLENS if gpu else CPU_SEQLENS)
    modes = tuple(m for m in MODES if m in (args.mode or (MODES if gpu else CPU_MODES)))
    if args.backends:
        backends = tuple(args.backends)
    elif gpu:
        backends = GPU_BACKENDS if flash_attn_available() else tuple(b for b in GPU_BACKENDS if b != "flash-attn")
        if "flash-attn" not in backends:
            notes.append("flash-attn is not installed: not timed")
    else:
        backends = CPU_BACKENDS
    causals = {"true": (True,), "false": (False,), "both": (False, True)}[args.causal]
    window = args.window or (-1, -1)
    if args.warmup < 0 or args.rep <= 0:
        raise ValueError("--warmup must be >= 0 and --rep > 0 (milliseconds)")
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")

    cases = []
    for dim, dim_v in headdims:
        if args.nheads:
            nheads = args.nheads
        elif gpu:
            nheads = max(4, HEADS_TIMES_DIM // max(dim, dim_v) // 4 * 4)
        else:
            nheads = CPU_NHEADS
        if args.nheads_kv:
            kv_specs = args.nheads_kv
        elif gpu and dim in GPU_GQA_HEADDIMS:
            kv_specs = [("ratio", 1), ("ratio", 4)]
        else:
            kv_specs = [("ratio", 1)]
        for causal in causals:
            for kind, n in kv_specs:
                nheads_kv = nheads // n if kind == "ratio" else n
                if nheads_kv < 1 or nheads % nheads_kv:
                    raise ValueError(f"--nheads-kv: {nheads} query heads (headdim {dim}) are not a multiple of "
                                     f"{'ratio ' + str(n) + ':1' if kind == 'ratio' else str(n) + ' kv heads'}")
                for s in seqlens:
                    if args.batch:
                        batch = args.batch
                    elif args.total_tokens or gpu:
                        batch = max(1, (args.total_tokens or GPU_TOTAL_TOKENS) // s)
                    else:
                        batch = CPU_BATCH
                    cases.append(Case(batch, s, s, nheads, nheads_kv, dim, dim_v, causal, window, _dtype_name(dtype),
                                      args.chunk))
    return Plan(device, dtype, cases, modes, backends, args.warmup, args.rep, not args.no_check,
                args.time_limit, notes, args.rounds)


# --------------------------------------------------------------------------------------------
# Backends: each returns a Runner over its own layout of one case's inputs
# --------------------------------------------------------------------------------------------


class Unsupported(Exception):
    """A backend cannot run this case (reported as 'unsupported', never a traceback)."""


@dataclass
class Runner:
    fwd: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]  # tensors whose .grad the backward fills
    dout: torch.Tensor
    note: str = ""
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    fallback: Optional[Callable[[], "Runner"]] = None  # tried when the first call fails ...
    fallback_on: tuple[str, ...] = ("unsupported",)  # ... with one of these words
    forward_only: bool = False  # no backward (FP8): bwd / fwd+bwd are reported unsupported


class Inputs:
    """One case's random inputs in flashtile's (B, S, H, D) layout, plus (B, H, S, D) copies."""

    def __init__(self, case: Case, device: str, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

        b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
        self.q = randn(b, sq, case.nheads, case.headdim).requires_grad_()
        self.k = randn(b, sk, case.nheads_kv, case.headdim).requires_grad_()
        self.v = randn(b, sk, case.nheads_kv, case.headdim_v).requires_grad_()
        self.dout = randn(b, sq, case.nheads, case.headdim_v)
        self._bhsd = None

    def bhsd(self):
        """(q, k, v, dout) transposed to (B, H, S, D) and made contiguous (once, untimed)."""
        if self._bhsd is None:
            t = [x.detach().transpose(1, 2).contiguous() for x in (self.q, self.k, self.v, self.dout)]
            self._bhsd = [x.requires_grad_() for x in t[:3]] + [t[3]]
        return self._bhsd


def _flashtile(case: Case, inp: Inputs, device: str) -> Runner:
    def fwd():
        return flash_attn_func(inp.q, inp.k, inp.v, causal=case.causal, window_size=case.window,
                               attention_chunk=case.chunk)

    return Runner(fwd, [inp.q, inp.k, inp.v], inp.dout)


def _flashtile_fp8(case: Case, inp: Inputs, device: str) -> Runner:
    """flashtile's FP8 forward.  q, k, v are quantized once, outside the timed region (an FP8
    model holds them in FP8 already); V's transposing pre-pass runs inside every call and is
    timed (``kernels/operands.py``)."""
    if device != "cuda":
        raise Unsupported("FP8 kernels need a Hopper GPU")
    from . import fp8

    q8, k8, v8, qd, kd, vd = fp8.quantize_qkv(inp.q.detach(), inp.k.detach(), inp.v.detach())

    def fwd():
        return flash_attn_func(q8, k8, v8, causal=case.causal, window_size=case.window, q_descale=qd, k_descale=kd,
                               v_descale=vd, out_dtype=inp.q.dtype, attention_chunk=case.chunk)

    return Runner(fwd, [], inp.dout, "e4m3, forward only", forward_only=True)


def _sdpa(case: Case, inp: Inputs, device: str, backend: Optional[str]) -> Runner:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend is not None and device != "cuda":
        raise Unsupported(f"SDPA's {backend} backend needs CUDA")
    if case.chunk:
        raise Unsupported("SDPA has no chunked attention (only through a dense mask)")
    left, right = normalize_window(case.causal, case.window)
    if (left, right) == (-1, -1):
        is_causal = False
    elif (left, right) == (-1, 0) and case.seqlen_q == case.seqlen_k:
        is_causal = True  # SDPA's causal is top-left aligned: equal lengths only
    else:
        raise Unsupported("SDPA has no sliding window and aligns causal top-left")
    q, k, v, dout = inp.bhsd()
    enum = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
    context = (lambda: sdpa_kernel([getattr(SDPBackend, enum[backend])])) if backend else contextlib.nullcontext
    group = case.nheads // case.nheads_kv

    def build(expand: bool) -> Runner:
        kk, vv = k, v
        if expand:  # outside the timed region; the group reduction of dK/dV is not timed either
            kk, vv = (x.detach().repeat_interleave(group, dim=1).requires_grad_() for x in (k, v))
        gqa = group > 1 and not expand

        def fwd():
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=is_causal, enable_gqa=gqa)

        return Runner(fwd, [q, kk, vv], dout, "kv expanded" if expand else "", context,
                      (lambda: build(True)) if gqa else None)

    return build(False)


@functools.lru_cache(maxsize=None)
def _compiled_flex(dynamic: bool):
    from torch.nn.attention.flex_attention import flex_attention

    import torch._dynamo.config as dynamo_config

    # Every mask/GQA/head-dim structure (and, static, every shape) is one more compiled entry.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
    # The backward is timed with retain_graph=True (one forward, many backwards); a compiled
    # backward that donates its saved buffers refuses that, so keep the buffers.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    # dynamic=True: one compile per structure instead of one per shape (batch 1 adds one more).
    return torch.compile(flex_attention, dynamic=dynamic)


_flex_state = {"dynamic": True}  # set to False once a dynamic-shape compile has failed


@functools.lru_cache(maxsize=None)
def _flex_mask_mod(off: int, left: int, right: int, chunk: int = 0):
    """Bottom-right aligned visibility as a FlexAttention mask_mod (one object per window and
    chunk size)."""

    def mask_mod(b, h, q_idx, kv_idx):
        diag = q_idx + off
        visible = kv_idx >= 0
        if right >= 0:
            visible = visible & (kv_idx <= diag + right)
        if left >= 0:
            visible = visible & (kv_idx >= diag - left)
        if chunk:
            visible = visible & (diag // chunk == kv_idx // chunk)
        return visible

    return mask_mod


def _flex(case: Case, inp: Inputs, device: str) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask

    dynamic = _flex_state["dynamic"]

    left, right = normalize_window(case.causal, case.window)
    block_mask = None
    if (left, right) != (-1, -1) or case.chunk:
        mod = _flex_mask_mod(case.seqlen_k - case.seqlen_q, left, right, case.chunk)
        block_mask = create_block_mask(mod, None, None, case.seqlen_q, case.seqlen_k, device=device)
    flex = _compiled_flex(dynamic)
    q, k, v, dout = inp.bhsd()
    gqa = case.nheads != case.nheads_kv

    def fwd():
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    def static() -> Runner:  # from now on compile per shape: slower to sweep, but it runs
        _flex_state["dynamic"] = False
        return _flex(case, inp, device)

    if dynamic:
        return Runner(fwd, [q, k, v], dout, "", fallback=static, fallback_on=("error",))
    return Runner(fwd, [q, k, v], dout, "static shapes")


def _flash_attn(case: Case, inp: Inputs, device: str) -> Runner:
    try:
        from flash_attn_interface import flash_attn_func as fa

        note = "FA3"
    except ImportError:
        try:
            from flash_attn import flash_attn_func as fa

            note = "FA2"
        except ImportError as e:
            raise Unsupported("flash-attn is not installed") from e

    kw = {}
    if case.chunk:
        if note != "FA3":
            raise Unsupported("flash-attn 2 has no chunked attention")
        kw["attention_chunk"] = case.chunk

    def fwd():
        out = fa(inp.q, inp.k, inp.v, causal=case.causal, window_size=case.window, **kw)
        return out[0] if isinstance(out, tuple) else out

    return Runner(fwd, [inp.q, inp.k, inp.v], inp.dout, note)


FACTORIES = {
    "flashtile": _flashtile,
    "flashtile-fp8": _flashtile_fp8,
    "cudnn": functools.partial(_sdpa, backend="cudnn"),
    "flash": functools.partial(_sdpa, backend="flash"),
    "efficient": functools.partial(_sdpa, backend="efficient"),
    "sdpa": functools.partial(_sdpa, backend=None),
    "flex": _flex,
    "flash-attn": _flash_attn,
}

_UNSUPPORTED_HINTS = ("no available kernel", "not supported", "unsupported", "no valid execution plan",
                      "outofresources", "out of resource")


def classify(exc: BaseException) -> tuple[str, str]:
    """(one word, one line) for a failure: unsupported, oom or error."""
    msg = str(exc).strip()
    detail = f"{type(exc).__name__}: {msg.splitlines()[0] if msg else ''}"[:300]
    if isinstance(exc, (Unsupported, NotImplementedError, ImportError)):
        return "unsupported", detail
    low = f"{type(exc).__name__} {msg}".lower()
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in low:
        return "oom", detail
    if any(h in low for h in _UNSUPPORTED_HINTS):
        return "unsupported", detail
    return "error", detail


# --------------------------------------------------------------------------------------------
# Checking flashtile against the reference
# --------------------------------------------------------------------------------------------


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    err = (x.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    return err / max(scale, 1e-6) if math.isfinite(err) else float("inf")


def check_flashtile(case: Case, inp: Inputs, out: torch.Tensor, grads, dtype: torch.dtype, fp8: bool = False) -> Optional[str]:
    """None when flashtile's out (and dq, dk, dv) match the float32 reference, else what differs.

    Compared on batch 0 and the query heads of the first kv head (two heads for MHA), so the
    check stays cheap at 16k tokens; the reference runs on the same device.
    """
    tol_out, tol_grad = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    if fp8:
        tol_out = FP8_TOLERANCE
    group = case.nheads // case.nheads_kv
    hk = min(case.nheads_kv, 1 if group > 1 else 2)
    hq = hk * group
    window = normalize_window(case.causal, case.window)
    scale = reference.default_scale(case.headdim)
    qs, ks, vs = (x.detach()[:1, :, :h].float() for x, h in ((inp.q, hq), (inp.k, hk), (inp.v, hk)))
    with torch.no_grad():
        ref_out, ref_lse = reference.attention_forward(qs, ks, vs, scale, window, attention_chunk=case.chunk)
        errs = {"out": (_rel_err(out[:1, :, :hq], ref_out), tol_out)}
        if grads is not None:
            dout = inp.dout[:1, :, :hq].float()
            dref = reference.attention_backward(dout, qs, ks, vs, ref_out, ref_lse, scale, window,
                                                attention_chunk=case.chunk)
            for name, g, r, h in zip(("dq", "dk", "dv"), grads, dref[:3], (hq, hk, hk)):
                errs[name] = (_rel_err(g[:1, :, :h], r), tol_grad)
    bad = [f"{n} rel err {e:.1e} > {t:.0e}" for n, (e, t) in errs.items() if not e <= t]
    return "; ".join(bad) or None


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def _triton_do_bench():
    try:
        from triton.testing import do_bench
    except Exception:  # ImportError, or a Triton that cannot initialise here
        return None
    return do_bench


def make_timer(device: str, warmup: float, rep: float) -> tuple[Callable, str]:
    """(timer(fn, grad_to_none) -> median ms, description of the method)."""
    if device == "cuda":
        do_bench = _triton_do_bench()
        if do_bench is not None:
            def timer(fn, grads):
                return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads, return_mode="median"))

            return timer, (f"triton.testing.do_bench, median, warm-up {warmup:g} ms, rep {rep:g} ms, "
                           "L2 cleared before every run")
        return (functools.partial(_loop_timer, warmup=warmup, rep=rep, cuda=True),
                f"CUDA events, median, warm-up {warmup:g} ms, rep {rep:g} ms, L2 cleared before every run "
                "(Triton not importable)")
    return (functools.partial(_loop_timer, warmup=warmup, rep=rep, cuda=False),
            f"wall clock (time.perf_counter), median, warm-up {warmup:g} ms, rep {rep:g} ms")


def _loop_timer(fn, grads, warmup: float, rep: float, cuda: bool) -> float:
    """do_bench's procedure with CUDA events (cuda) or the wall clock (CPU): median ms.

    One untimed call (lazy initialisation), a runtime estimate, warm-up calls filling
    ``warmup`` ms, then ``rep`` ms of timed calls (at least 3), grads reset before each.
    """
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if cuda else None
    fn()
    sync()
    n_est = 3 if cuda else 1
    t0 = time.perf_counter()
    for _ in range(n_est):
        fn()
    sync()
    estimate = max((time.perf_counter() - t0) * 1e3 / n_est, 1e-3)
    times = [] if cuda else [estimate]  # on CPU the estimate is a wall-clock sample already
    for _ in range(int(warmup / estimate)):
        fn()
    for _ in range(min(10_000, max(3, int(rep / estimate))) - len(times)):
        for x in grads:
            x.grad = None
        if cuda:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    sync()
    if cuda:
        times = [s.elapsed_time(e) for s, e in times]
    return statistics.median(times)


def _timed_fn(runner: Runner, mode: str):
    if mode == "fwd":
        return runner.fwd
    if mode == "bwd":
        out = runner.fwd()
        return lambda: out.backward(runner.dout, retain_graph=True)
    return lambda: runner.fwd().backward(runner.dout)


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    case: Case
    mode: str
    backend: str
    status: str = "ok"  # ok, unsupported, oom, error, mismatch, skipped
    ms: Optional[float] = None  # median over ``samples``
    note: str = ""
    detail: str = ""
    vs_baseline: Optional[float] = None
    samples: list[float] = field(default_factory=list)  # one median ms per round

    @property
    def flops(self) -> int:
        return self.case.flops(self.mode)

    @property
    def tflops(self) -> Optional[float]:
        return self.flops / (self.ms * 1e-3) / 1e12 if self.ms else None

    def row(self) -> dict:
        return {
            "mode": self.mode, **self.case.fields(), "backend": self.backend, "status": self.status,
            "ms": self.ms, "tflops": self.tflops, "flops": self.flops, "vs_baseline": self.vs_baseline,
            "note": self.note, "detail": self.detail,
            "rounds_ms": " ".join(f"{x:.4f}" for x in self.samples),
        }


class Reporter:
    """Progress over the sweep: a rich bar on a terminal, one plain line per case otherwise."""

    def __init__(self, total: int, ncases: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.ncases = ncases
        self.t0 = time.monotonic()
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=True, disable=not self.live)
        self.task = self.progress.add_task("bench", total=total)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def case(self, index: int, case: Case) -> None:
        if not self.live:
            print(f"[{index + 1}/{self.ncases}] {case.label} b{case.batch} h{case.heads}  "
                  f"({time.monotonic() - self.t0:.0f} s)", file=sys.stderr, flush=True)

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)

    def completed(self, n: int) -> None:
        self.progress.update(self.task, completed=n)


def sweep(plan: Plan, timer: Callable, reporter: Optional[Reporter] = None) -> list[Result]:
    """Every (case, backend, mode) once; results in plan order, ratios to the baseline filled."""
    results: list[Result] = []
    t0 = time.monotonic()
    need_bwd = any(m != "fwd" for m in plan.modes)
    stop: Optional[str] = None  # why the rest is skipped
    done = 0
    for index, case in enumerate(plan.cases):
        if reporter:
            reporter.case(index, case)
        case_results: list[Result] = []
        inp, inp_failure = None, None
        if stop is None:
            try:
                inp = Inputs(case, plan.device, plan.dtype)
            except Exception as e:  # noqa: BLE001 - reported, e.g. oom
                inp_failure = classify(e)
        primed = []  # (runner, results) of the backends that ran and passed the check
        for backend in plan.backends:
            new = [Result(case, m, backend) for m in plan.modes]
            case_results += new
            if stop is None and plan.time_limit is not None and time.monotonic() - t0 > plan.time_limit:
                stop = f"time limit {plan.time_limit:g} s"
            if stop or inp_failure:
                failure = ("skipped", stop) if stop else inp_failure
                for r in new:
                    r.status, r.detail = failure
            else:
                try:
                    runner = _prime_backend(plan, case, inp, backend, new, need_bwd, reporter)
                    if runner is not None:
                        primed.append((runner, new))
                except KeyboardInterrupt:
                    stop = "interrupted"
        for _ in range(plan.rounds):
            for runner, new in primed:
                try:
                    if stop is None:
                        _time_backend(plan, case, runner, new, timer, reporter)
                except KeyboardInterrupt:
                    stop = "interrupted"
        for r in case_results:
            if r.samples:
                r.ms = statistics.median(r.samples)
            elif r.status == "ok":
                r.status, r.detail = "skipped", stop or "not timed"
        done += len(case_results) * plan.rounds
        if reporter:
            reporter.completed(done)
        _ratios(case_results, plan.baseline)
        results += case_results
        del inp
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    return results


@contextlib.contextmanager
def _quiet(runner: Runner):
    """The backend's own context (e.g. SDPA's backend choice), its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with runner.context():
            yield


def _prime_backend(plan, case, inp, backend, results, need_bwd, reporter) -> Optional[Runner]:
    """First call (compile), gradients, and for flashtile the reference check: the runner to
    time, or None with the failure written into ``results`` as words."""
    by_mode = {r.mode: r for r in results}

    def fail(modes, failure):
        for m in modes:
            if m in by_mode and by_mode[m].status == "ok":
                by_mode[m].status, by_mode[m].detail = failure

    if reporter:
        reporter.describe(f"{case.label} · {backend} · first call (compile)")
    try:
        runner = FACTORIES[backend](case, inp, plan.device)
    except Exception as e:  # noqa: BLE001
        fail(plan.modes, classify(e))
        return None
    with _quiet(runner):
        out = None
        try:
            out = runner.fwd()
        except Exception as e:  # noqa: BLE001
            failure = classify(e)
            if runner.fallback is not None and failure[0] in runner.fallback_on:
                runner = runner.fallback()
                try:
                    out = runner.fwd()
                except Exception as e2:  # noqa: BLE001
                    failure = classify(e2)
            if out is None:
                fail(plan.modes, failure)
                return None
        grads = None
        if need_bwd and runner.forward_only:
            fail([m for m in plan.modes if m != "fwd"], ("unsupported", "forward only"))
        elif need_bwd:
            try:
                grads = torch.autograd.grad(out, runner.leaves, runner.dout)
            except Exception as e:  # noqa: BLE001
                fail([m for m in plan.modes if m != "fwd"], classify(e))
        if backend.startswith("flashtile") and plan.check:
            try:
                bad_fwd = check_flashtile(case, inp, out, None, plan.dtype, fp8=backend == "flashtile-fp8")
                if bad_fwd:
                    fail(plan.modes, ("mismatch", bad_fwd))
                elif grads is not None:
                    bad = check_flashtile(case, inp, out, grads, plan.dtype)
                    if bad:
                        fail([m for m in plan.modes if m != "fwd"], ("mismatch", bad))
            except Exception as e:  # noqa: BLE001 - the check could not run: never time unchecked
                fail(plan.modes, ("error", "check failed: " + classify(e)[1]))
        del out, grads
    for r in results:
        r.note = runner.note
    return runner if any(r.status == "ok" for r in results) else None


def _time_backend(plan, case, runner, results, timer, reporter) -> None:
    """One round: time each mode still ok once, appending to its samples."""
    with _quiet(runner):
        for r in results:
            if r.status != "ok":
                continue
            if reporter:
                reporter.describe(f"{case.label} · {r.backend} · {r.mode}")
            try:
                r.samples.append(timer(_timed_fn(runner, r.mode), runner.leaves))
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001
                r.status, r.detail = classify(e)
                if plan.device == "cuda" and r.status == "oom":
                    torch.cuda.empty_cache()
            finally:
                for x in runner.leaves:
                    x.grad = None
            if reporter:
                reporter.advance()


def _ratios(results: list[Result], baseline: Optional[str]) -> None:
    """vs_baseline = baseline ms / ms (= TFLOP/s ratio; > 1 is faster than the baseline)."""
    if baseline is None:
        return
    base = {r.mode: r.ms for r in results if r.backend == baseline and r.status == "ok" and r.ms}
    for r in results:
        if r.status == "ok" and r.ms and base.get(r.mode):
            r.vs_baseline = base[r.mode] / r.ms


def summarize(results: list[Result], baseline: Optional[str]) -> list[dict]:
    """Per (mode, mask, head dims, backend): geometric mean of vs_baseline over the cases."""
    groups: dict[tuple, list[float]] = {}
    for r in results:
        if r.backend == baseline:
            continue
        key = (r.mode, r.case.mask, r.case.dims, r.backend)
        groups.setdefault(key, [])
        if r.vs_baseline:
            groups[key].append(r.vs_baseline)
    out = []
    for (mode, mask, dims, backend), ratios in sorted(groups.items(), key=lambda kv: MODES.index(kv[0][0])):
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else None
        out.append({"mode": mode, "mask": mask, "headdim": dims, "backend": backend,
                    "geomean_vs_baseline": geo, "n": len(ratios), "baseline": baseline})
    return out


def fp8_speedups(results: list[Result], fp8: str = "flashtile-fp8", bf16: str = "flashtile") -> list[dict]:
    """Per (mode, mask, head dims): geometric mean over the cases of ``bf16`` ms / ``fp8`` ms in
    the same run (> 1: FP8 faster), for issue 17's FP8-vs-own-bf16 bar; cases where either did
    not run are left out."""
    ms = {(r.case, r.mode, r.backend): r.ms for r in results if r.status == "ok" and r.ms}
    groups: dict[tuple, list[float]] = {}
    for r in results:
        if r.backend != fp8 or (r.case, r.mode, bf16) not in ms or (r.case, r.mode, fp8) not in ms:
            continue
        groups.setdefault((r.mode, r.case.mask, r.case.dims), []).append(ms[(r.case, r.mode, bf16)] / ms[(r.case, r.mode, fp8)])
    return [{"mode": m, "mask": mask, "headdim": d, "geomean_fp8_speedup": math.exp(sum(map(math.log, v)) / len(v)), "n": len(v)}
            for (m, mask, d), v in groups.items()]


# --------------------------------------------------------------------------------------------
# Environment and reports
# --------------------------------------------------------------------------------------------


def _pkg_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> Optional[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - fall back to nvidia-smi
        pass
    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return got.stdout.strip().splitlines()[0] if got.returncode == 0 and got.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


def environment(plan: Plan, timing: str) -> dict:
    from . import __version__

    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device_type": plan.device,
        "flashtile": __version__,
        "torch": torch.__version__,
        "tilelang": _pkg_version("tilelang"),
        "triton": _pkg_version("triton"),
        "flash_attn": _pkg_version("flash_attn") or _pkg_version("flash_attn_3"),
        "python": platform.python_version(),
        "timing": timing,
        "flops": ("flash-attn convention: fwd = 2*B*H*pairs*(D+Dv) (= 4*B*H*Sq*Sk*D for full attention), "
                  "pairs = exact visible (query, key) pairs under causal/window; bwd = 2.5x fwd; fwdbwd = 3.5x fwd"),
        "forward": "timed as in training (inputs require grad)",
        "backward": "timed alone: retain_graph=True, fixed random dout, grads set to None between runs",
        "inputs": "torch.randn (never zeros), seed 0",
        "dtype": _dtype_name(plan.dtype),
        "baseline": plan.baseline,
        "warmup_ms": plan.warmup,
        "rep_ms": plan.rep,
        "check": None,
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
    if plan.check:
        tol_out, tol_grad = TOLERANCES.get(plan.dtype, TOLERANCES[torch.float32])
        meta["check"] = (f"flashtile vs the float32 reference on batch 0, first kv head's query heads: "
                         f"max|err| <= {tol_out:g} * max|ref| (out), {tol_grad:g} (dq, dk, dv)")
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update({
            "device": torch.cuda.get_device_name(0),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "sm_count": props.multi_processor_count,
            "l2_mb": round(getattr(props, "L2_cache_size", 0) / 1e6, 1),
            "memory_gb": round(props.total_memory / 1e9, 1),
            "driver": _driver_version(),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        })
    else:
        threads = torch.get_num_threads()
        cpu = platform.processor() or platform.machine()
        meta.update({"device": f"CPU {cpu} ({threads} thread{'s' * (threads > 1)})",
                     "driver": None, "cuda": None, "cudnn": None, "note": CPU_NOTE})
    return meta


def _fmt_tflops(t: Optional[float]) -> str:
    if t is None:
        return ""
    return f"{t:.1f}" if t >= 10 else f"{t:.3g}"


def _fmt_ms(ms: Optional[float]) -> str:
    return "" if ms is None else (f"{ms:.3f}" if ms < 100 else f"{ms:.1f}")


def _fmt_ratio(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.2f}x"


def header_lines(meta: dict, plan: Plan) -> list[str]:
    lines = [f"flashtile bench on {meta['device']} ({meta['date']})"]
    if plan.device == "cuda":
        lines.append(f"  {meta['sm_count']} SMs, L2 {meta['l2_mb']} MB, driver {meta['driver']}, CUDA {meta['cuda']}, "
                     f"cuDNN {meta['cudnn']}")
    lines.append(f"  torch {meta['torch']}, triton {meta['triton']}, tilelang {meta['tilelang']}, "
                 f"flash-attn {meta['flash_attn']}, flashtile {meta['flashtile']}")
    lines.append(f"  timing: {meta['timing']}")
    if plan.device == "cuda" and plan.cases:
        smallest = min(c.batch * c.seqlen_q * c.nheads * c.headdim for c in plan.cases) * plan.dtype.itemsize
        lines.append(f"  inputs: torch.randn; q alone is >= {smallest / 2**20:.0f} MiB per case (L2 {meta['l2_mb']} MB)"
                     f"{', so inputs exceed L2 and are not rotated' if smallest > meta['l2_mb'] * 1e6 else ''}")
    lines.append(f"  forward {meta['forward']}; backward {meta['backward']}; fwd+bwd one call of each")
    lines.append(f"  FLOPs: {meta['flops']}")
    lines.append(f"  check: {meta['check'] or 'off (--no-check)'}")
    if any(b in plan.backends for b in ("cudnn", "flash", "efficient", "sdpa", "flex")):
        lines.append("  anchors: SDPA and FlexAttention on (B, H, S, D) contiguous copies; GQA by enable_gqa where "
                     "the backend takes it, else K/V expanded beforehand (note 'kv expanded'); FlexAttention "
                     "torch.compile(dynamic=True; note 'static shapes' if that failed), block mask from "
                     "create_block_mask for causal/window")
    base = BASELINE_LABELS.get(plan.baseline, plan.baseline)
    if base:
        lines.append(f"  vs {base} = {base} ms / ms (> 1: faster than {base})")
    lines.append(f"  sweep: {len(plan.cases)} cases x {len(plan.backends)} backends ({', '.join(plan.backends)}) x "
                 f"{len(plan.modes)} modes = {plan.timings} timings, {_dtype_name(plan.dtype)}")
    lines += [f"  note: {n}" for n in plan.notes]
    return lines


def _case_columns(case: Case) -> list[str]:
    return [case.mask, case.dims, case.seqlen, str(case.batch), case.heads]


def render_tables(console, results: list[Result], plan: Plan) -> None:
    from rich.table import Table

    base = BASELINE_LABELS.get(plan.baseline, plan.baseline or "-")
    for mode in plan.modes:
        table = Table(title=MODE_TITLES[mode], title_justify="left")
        for name in ("mask", "d", "seqlen", "batch", "heads", "backend"):
            table.add_column(name, justify="right" if name in ("d", "seqlen", "batch") else "left")
        for name in ("ms", "TFLOP/s", f"vs {base}"):
            table.add_column(name, justify="right")
        table.add_column("note")
        rows = [r for r in results if r.mode == mode]
        for i, r in enumerate(rows):
            first = i == 0 or rows[i - 1].case != r.case
            last = i == len(rows) - 1 or rows[i + 1].case != r.case
            case_cols = _case_columns(r.case) if first else [""] * 5
            ms = _fmt_ms(r.ms) if r.status == "ok" else f"[yellow]{r.status}[/]"
            name = f"[bold]{r.backend}[/]" if r.backend == "flashtile" else r.backend
            table.add_row(*case_cols, name, ms, _fmt_tflops(r.tflops) if r.status == "ok" else "",
                          _fmt_ratio(r.vs_baseline), r.note, end_section=last)
        console.print(table)


def render_summary(console, summary: list[dict], plan: Plan) -> None:
    from rich.table import Table

    if not plan.baseline or not summary:
        return
    base = BASELINE_LABELS.get(plan.baseline, plan.baseline)
    others = [b for b in plan.backends if b != plan.baseline]
    table = Table(title=f"geometric mean of speed vs {base} over seqlens and head counts", title_justify="left")
    for name in ("mode", "mask", "d"):
        table.add_column(name)
    for b in others:
        table.add_column(b, justify="right")
    index = {(s["mode"], s["mask"], s["headdim"], s["backend"]): s for s in summary}
    keys = list(dict.fromkeys((s["mode"], s["mask"], s["headdim"]) for s in summary))
    for mode, mask, dims in keys:
        cells = []
        for b in others:
            s = index.get((mode, mask, dims, b))
            cells.append(_fmt_ratio(s["geomean_vs_baseline"]) if s and s["geomean_vs_baseline"] else "-")
        table.add_row(mode, mask, dims, *cells)
    console.print(table)


def _parent(path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(path: str, meta: dict, results: list[Result], summary: list[dict]) -> None:
    with open(_parent(path), "w") as f:
        json.dump({"meta": meta, "results": [r.row() for r in results], "summary": summary}, f, indent=1)


META_COLUMNS = ("date", "device", "driver", "cuda", "cudnn", "torch", "triton", "tilelang", "flash_attn", "flashtile",
                "timing")


def write_csv(path: str, meta: dict, results: list[Result]) -> None:
    rows = [{**{k: meta.get(k) for k in META_COLUMNS}, **r.row()} for r in results]
    for row in rows:
        row["window"] = ",".join(map(str, row["window"]))
    fields = list(META_COLUMNS) + list(results[0].row()) if results else list(META_COLUMNS)
    with open(_parent(path), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_markdown(path: str, meta: dict, plan: Plan, results: list[Result], summary: list[dict]) -> None:
    base = BASELINE_LABELS.get(plan.baseline, plan.baseline or "-")
    out = [f"# flashtile bench: {meta['device']}, {meta['date']}", ""]
    out += [f"- {line.strip()}" for line in header_lines(meta, plan)[1:]]
    if plan.device != "cuda":
        out += ["", f"> {CPU_NOTE}"]
    out.append("")
    for mode in plan.modes:
        out += [f"## {MODE_TITLES[mode]}", "",
                f"Cells: TFLOP/s, ms, speed vs {base} (> 1 is faster); a word says why a backend did not run.", "",
                "| mask | d | seqlen | batch | heads | " + " | ".join(plan.backends) + " |",
                "|---|---:|---:|---:|---|" + "---:|" * len(plan.backends)]
        by_case: dict[Case, dict[str, Result]] = {}
        for r in results:
            if r.mode == mode:
                by_case.setdefault(r.case, {})[r.backend] = r
        for case, cells in by_case.items():
            texts = []
            for b in plan.backends:
                r = cells.get(b)
                if r is None:
                    texts.append("")
                elif r.status != "ok":
                    texts.append(r.status)
                else:
                    ratio = f" · {_fmt_ratio(r.vs_baseline)}" if r.vs_baseline and b != plan.baseline else ""
                    texts.append(f"{_fmt_tflops(r.tflops)} · {_fmt_ms(r.ms)} ms{ratio}")
            out.append("| " + " | ".join(_case_columns(case) + texts) + " |")
        out.append("")
    if summary and plan.baseline:
        others = [b for b in plan.backends if b != plan.baseline]
        index = {(s["mode"], s["mask"], s["headdim"], s["backend"]): s for s in summary}
        out += [f"## Geometric mean of speed vs {base}", "", "| mode | mask | d | " + " | ".join(others) + " |",
                "|---|---|---:|" + "---:|" * len(others)]
        for mode, mask, dims in dict.fromkeys((s["mode"], s["mask"], s["headdim"]) for s in summary):
            cells = [index.get((mode, mask, dims, b)) for b in others]
            out.append(f"| {mode} | {mask} | {dims} | " + " | ".join(
                _fmt_ratio(s["geomean_vs_baseline"]) if s and s["geomean_vs_baseline"] else "-" for s in cells) + " |")
        out.append("")
    speedups = fp8_speedups(results)
    if speedups:
        out += ["## flashtile-fp8 vs flashtile (bf16/fp16) in the same run", "",
                "Geometric mean of flashtile ms / flashtile-fp8 ms over the cases (> 1: FP8 faster; the FP8 call",
                "includes its V^T pre-pass).", "", "| mode | mask | d | speed-up | cases |", "|---|---|---:|---:|---:|"]
        out += [f"| {x['mode']} | {x['mask']} | {x['headdim']} | {_fmt_ratio(x['geomean_fp8_speedup'])} | {x['n']} |" for x in speedups]
        out.append("")
    with open(_parent(path), "w") as f:
        f.write("\n".join(out))


def write_plot(path: str, meta: dict, plan: Plan, results: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in results))
    width = 0.8 / max(1, len(plan.backends))
    fig, axes = plt.subplots(len(plan.modes), 1, squeeze=False,
                             figsize=(min(40, max(10, 2 + 0.4 * len(cases))), 4 * len(plan.modes)))
    index = {(r.case, r.mode, r.backend): r for r in results}
    for ax, mode in zip(axes[:, 0], plan.modes):
        for bi, backend in enumerate(plan.backends):
            xs, ys = [], []
            for ci, case in enumerate(cases):
                r = index.get((case, mode, backend))
                if r is not None and r.status == "ok" and r.tflops:
                    xs.append(ci + (bi - (len(plan.backends) - 1) / 2) * width)
                    ys.append(r.tflops)
            ax.bar(xs, ys, width=width, label=backend)
        ax.set_title(MODE_TITLES[mode])
        ax.set_ylabel("TFLOP/s")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c.label for c in cases], rotation=90, fontsize=7)
        ax.set_xlim(-0.6, len(cases) - 0.4)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=len(plan.backends))
    fig.suptitle(f"flashtile bench, {meta['device']}, {_dtype_name(plan.dtype)}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(_parent(path), dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def _stdout_console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def run(args: argparse.Namespace) -> int:
    """Run the sweep, print the tables, write the requested files; 1 if flashtile failed."""
    if getattr(args, "decode", False):
        from .bench_decode import run as run_decode

        return run_decode(args)
    if getattr(args, "varlen", False):
        from .bench_varlen import run as run_varlen

        return run_varlen(args)
    console = _stdout_console()
    try:
        plan = resolve(args, torch.cuda.is_available())
    except ValueError as e:
        console.print(f"flashtile bench: {e}", markup=False)
        return 2
    threads = torch.get_num_threads()
    if plan.device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    try:
        return _run(args, plan, console)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, plan: Plan, console) -> int:
    timer, timing = make_timer(plan.device, plan.warmup, plan.rep)
    if plan.rounds > 1:
        timing += f"; median of {plan.rounds} rounds, the backends timed in turn each round"
    meta = environment(plan, timing)
    for line in header_lines(meta, plan):
        console.print(line, markup=False, highlight=False)
    if plan.device != "cuda":
        console.print(CPU_NOTE, style="bold yellow")
    console.print()
    with Reporter(plan.timings, len(plan.cases)) as reporter:
        results = sweep(plan, timer, reporter)
    summary = summarize(results, plan.baseline)
    render_tables(console, results, plan)
    render_summary(console, summary, plan)
    if args.json:
        write_json(args.json, meta, results, summary)
    if args.csv:
        write_csv(args.csv, meta, results)
    if args.markdown:
        write_markdown(args.markdown, meta, plan, results, summary)
    if args.plot:
        write_plot(args.plot, meta, plan, results)
    written = [p for p in (args.json, args.csv, args.markdown, args.plot) if p]
    if written:
        console.print("wrote " + ", ".join(written), markup=False)
    failures = [r for r in results if r.backend == "flashtile" and r.status in ("mismatch", "error")]
    skipped = [r for r in results if r.status == "skipped"]
    if skipped:
        console.print(f"{len(skipped)} timings skipped: {skipped[0].detail}", markup=False)
    if plan.device != "cuda":
        console.print(CPU_NOTE, style="bold yellow")
    if failures:
        console.print(f"FAILED: {len(failures)} flashtile result(s):", style="bold red")
        for r in failures:
            console.print(f"  {r.mode} {r.case.label} b{r.case.batch} h{r.case.heads}: {r.status}: {r.detail}",
                          markup=False)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtile bench", description=__doc__)
    add_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
