"""Correctness self-test of whichever path this machine runs (CPU reference or GPU kernels).

Without CUDA, ``flash_attn_func`` on CPU tensors (the reference path) is compared in float32 and
float64 with ``naive_attention``: an independent float64 full-matrix computation written from
design.md's semantics (dense masks, GQA by ``repeat_interleave``, the sink as an extra softmax
column).  Outputs, lse and the gradients of q, k, v and sinks (autograd on both sides, the loss
also flowing through lse) are compared.

With CUDA, the same grid runs the TileLang kernels in bfloat16 and float16 and applies
flash-attn's rule against the reference in float32 (``ref32``): with ``ref_lp`` the reference
fed the low-precision inputs (outputs rounded to that precision),
``err(kernel, ref32) <= 2 * err(ref_lp, ref32) + 1e-5`` for out and lse, ``3 *`` for gradients
(the 1e-5 relative to the largest |ref32| value of the pass, and for dsinks the non-cancelling sum
of ref_lp's per-row errors, as in ``tests/test_gpu_kernels.py``).
A case no kernel covers (``NotImplementedError``) is reported as unsupported, not as a failure.

Exit status 0 iff every supported case passed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

NEG_INF = float("-inf")
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")


# --------------------------------------------------------------------------------------------
# The independent oracle
# --------------------------------------------------------------------------------------------


def naive_mask(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1), device=None, chunk: int = 0) -> torch.Tensor:
    """Dense boolean (seqlen_q, seqlen_k) mask of visible keys, straight from design.md (with
    ``chunk``: and row i, at key position i + off, sees only keys of its own chunk)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    off = seqlen_k - seqlen_q
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        vis = vis & (j <= i + off + right)
    if left >= 0:
        vis = vis & (j >= i + off - left)
    if chunk:
        vis = vis & ((i + off) // chunk == j // chunk)
    return vis


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    causal: bool = False,
    window=(-1, -1),
    sinks: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-matrix float64 attention: ``(out (b, sq, h, dv), lse (b, h, sq))``, both float64.

    Differentiable with respect to q, k, v and sinks, and NaN-free also for rows that see no
    key (out 0, lse -inf, zero gradients).  Written for clarity, not memory: it materialises
    the whole (b, h, sq, sk + 1) score matrix.
    """
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    group = h // hkv
    k = k.repeat_interleave(group, dim=2)  # query head hh reads kv head hh // group
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~naive_mask(sq, sk, causal, window, q.device, chunk), NEG_INF)
    # One extra softmax column: the sink logit, or -inf (no mass) without sinks.  It also keeps
    # the max below well defined when seqlen_k == 0.
    if sinks is not None:
        extra = sinks.double().reshape(1, h, 1, 1).expand(b, h, sq, 1)
    else:
        extra = s.new_full((b, h, sq, 1), NEG_INF)
    s = torch.cat([s, extra], dim=-1)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # the result does not depend on m
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    lse = torch.where(seen, torch.log(l_safe) + m, torch.full_like(l, NEG_INF)).squeeze(-1)
    p = (e / l_safe)[..., :sk]  # the sink takes mass and contributes no value
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


# --------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    seqlen_q: int
    seqlen_k: int
    nheads: int = 4
    nheads_kv: int = 4
    headdim: int = 32
    headdim_v: int = 32
    batch: int = 1
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    sinks: bool = False
    softcap: float = 0.0
    chunk: int = 0  # attention_chunk
    quick: bool = True  # part of --quick

    def describe(self) -> str:
        bits = [
            f"b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k} h{self.nheads}:{self.nheads_kv} d{self.headdim}"
            + (f"/{self.headdim_v}" if self.headdim_v != self.headdim else "")
        ]
        if self.causal:
            bits.append("causal")
        if self.window != (-1, -1):
            bits.append(f"win{self.window}")
        if self.sinks:
            bits.append("sinks")
        if self.softcap:
            bits.append(f"cap{self.softcap:g}")
        if self.chunk:
            bits.append(f"chunk{self.chunk}")
        return " ".join(bits)


# Every option appears; each case varies several axes at once (a covering design, not a product).
# Head dims stay at 64 (and 64/32 for d != d_v) so that the GPU mode compiles few kernels.
CASES = [
    Case("mha", 17, 33, 4, 4, 64, 64, batch=2),
    Case("gqa-causal-sq>sk", 33, 17, 8, 2, 64, 64, causal=True),
    Case("mqa-window", 29, 41, 4, 1, 64, 64, window=(5, 3)),
    Case("causal+window", 40, 40, 4, 2, 64, 64, causal=True, window=(7, -1), quick=False),
    Case("sinks-gqa", 23, 23, 4, 2, 64, 64, batch=2, sinks=True),
    Case("softcap", 19, 37, 4, 4, 64, 64, softcap=5.0, quick=False),
    Case("d!=dv-causal", 21, 21, 4, 2, 64, 32, causal=True),
    Case("masked-rows", 12, 5, 2, 1, 64, 64, window=(0, 0), quick=False),
    Case("masked-rows-sinks", 20, 10, 4, 2, 64, 64, causal=True, window=(0, 0), sinks=True),
    Case("decode-mqa", 1, 50, 8, 1, 64, 64, causal=True, quick=False),
    Case("everything", 31, 47, 4, 2, 64, 32, causal=True, window=(9, -1), sinks=True, softcap=5.0),
    Case("chunked-sinks", 45, 50, 4, 2, 64, 64, batch=2, causal=True, sinks=True, chunk=16, quick=False),
]


# --------------------------------------------------------------------------------------------
# Running one case
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    case: Case
    dtype: torch.dtype
    errors: dict = field(default_factory=dict)  # tensor -> (err, bound)
    status: str = "pass"  # pass | FAIL | unsupported
    note: str = ""


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; NaN anywhere counts as an infinite error."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    return float(torch.nan_to_num(d, nan=math.inf).max())


def lse_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| over ref's finite entries; inf unless a is -inf exactly where ref is."""
    if a.shape != ref.shape:
        return math.inf
    a, ref = a.detach().double(), ref.detach().double()
    masked = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(a), masked) or torch.isnan(a).any():
        return math.inf
    return max_abs_err(a[~masked], ref[~masked])


def _inputs(case: Case, device, dtype, gen: torch.Generator):
    """Fresh random leaf tensors (q, k, v, sinks or None, dout, dlse) in ``dtype`` on ``device``."""

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dt)

    b, sq, sk, h, hkv = case.batch, case.seqlen_q, case.seqlen_k, case.nheads, case.nheads_kv
    q = rnd(b, sq, h, case.headdim)
    k = rnd(b, sk, hkv, case.headdim)
    v = rnd(b, sk, hkv, case.headdim_v)
    sinks = rnd(h, dt=torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype) if case.sinks else None
    dout = rnd(b, sq, h, case.headdim_v)
    dlse = rnd(b, h, sq, dt=torch.float32 if dtype != torch.float64 else dtype)
    return q, k, v, sinks, dout, dlse


def _leaf(x):
    return None if x is None else x.detach().clone().requires_grad_(True)


def _loss_grads(out, lse, dout, dlse, leaves):
    """Backward of sum(out * dout) + sum(finite lse * dlse); grads of the leaves (None if unused)."""
    finite_lse = lse.masked_fill(torch.isneginf(lse.detach()), 0.0)
    loss = (out * dout.to(out.dtype)).sum() + (finite_lse * dlse.to(lse.dtype)).sum()
    used = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad(loss, used, allow_unused=True))
    return [None if x is None else next(grads) for x in leaves]


def _call(case: Case, q, k, v, sinks):
    from .interface import flash_attn_func

    return flash_attn_func(
        q, k, v, causal=case.causal, window_size=case.window, sinks=sinks, softcap=case.softcap, return_lse=True,
        attention_chunk=case.chunk,
    )


# Reference-vs-naive tolerances: max abs error <= TOL * max(1, max |naive|).
REFERENCE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def check_reference_case(case: Case, dtype: torch.dtype, seed: int) -> Result:
    """flash_attn_func on CPU tensors of ``dtype`` vs ``naive_attention`` (float64)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, sinks, dout, dlse = _inputs(case, "cpu", dtype, gen)
    res = Result(case, dtype)
    leaves = [_leaf(x) for x in (q, k, v, sinks)]
    out, lse = _call(case, *leaves)
    grads = _loss_grads(out, lse, dout, dlse, leaves)

    nleaves = [_leaf(x.double()) if x is not None else None for x in (q, k, v, sinks)]
    n_out, n_lse = naive_attention(
        *nleaves[:3], None, case.causal, case.window, nleaves[3], case.softcap, case.chunk
    )
    n_grads = _loss_grads(n_out, n_lse, dout.double(), dlse.double(), nleaves)

    tol = REFERENCE_TOL[dtype]
    pairs = [("out", out, n_out), ("lse", lse, n_lse)] + list(zip(TENSORS[2:], grads, n_grads))
    for name, got, want in pairs:
        if want is None:
            continue
        err = lse_err(got, want) if name == "lse" else max_abs_err(got, want)
        finite = want.detach()[torch.isfinite(want.detach())]
        bound = tol * max(1.0, float(finite.abs().max()) if finite.numel() else 1.0)
        res.errors[name] = (err, bound)
    if lse.dtype != (torch.float64 if dtype == torch.float64 else torch.float32):
        res.status, res.note = "FAIL", f"lse dtype {lse.dtype}"
    if any(err > bound for err, bound in res.errors.values()):
        res.status = "FAIL"
    return res


def check_kernel_case(case: Case, dtype: torch.dtype, seed: int, device="cuda") -> Result:
    """flash_attn_func in ``dtype`` on ``device`` vs the reference in float32, flash-attn's rule.

    On ``device="cpu"`` the "kernel" is the reference path itself (a self-test of this harness).
    """
    from . import reference
    from .kernels import debug

    gen = torch.Generator().manual_seed(seed)
    q, k, v, sinks, dout, dlse = _inputs(case, device, dtype, gen)
    res = Result(case, dtype)
    scale = 1.0 / math.sqrt(case.headdim)
    window = (case.window[0], 0) if case.causal else tuple(case.window)

    # The implementation under test, outputs NaN-poisoned so unwritten elements show.
    leaves = [_leaf(x) for x in (q, k, v, sinks)]
    try:
        with debug.poison():
            out, lse = _call(case, *leaves)
    except NotImplementedError as e:
        res.status, res.note = "unsupported", str(e)
        return res
    try:
        with debug.poison():
            grads = _loss_grads(out, lse, dout, dlse, leaves)
    except NotImplementedError as e:
        grads, res.status, res.note = None, "unsupported", f"backward: {e}"

    # ref32: the reference on the same (low-precision) values upcast to float32.
    f32 = [None if x is None else x.float() for x in (q, k, v, sinks)]
    o32, l32 = reference.attention_forward(*f32[:3], scale, window, f32[3], case.softcap, attention_chunk=case.chunk)
    # ref_lp: the reference fed the low-precision tensors (out rounded to dtype, lse float32).
    olp, llp = reference.attention_forward(q, k, v, scale, window, sinks, case.softcap, attention_chunk=case.chunk)
    # Rows with lse = -inf get no lse gradient (the loss masks them).
    dl = dlse.masked_fill(torch.isneginf(l32), 0.0)
    refs = {"out": (out, olp, o32), "lse": (lse, llp, l32)}
    if grads is not None:
        g32 = reference.attention_backward(dout.float(), *f32[:3], o32, l32, scale, window, f32[3], case.softcap, dl,
                                           attention_chunk=case.chunk)
        glp = reference.attention_backward(dout, q, k, v, olp, llp, scale, window, sinks, case.softcap, dl,
                                           attention_chunk=case.chunk)
        for i, name in enumerate(TENSORS[2:]):
            if g32[i] is not None:
                refs[name] = (grads[i], glp[i], g32[i])

    # The 1e-5 floor is relative to each pass's scale (out; lse; all gradients together): lse's
    # ref_lp error is exactly 0 (same float32 arithmetic as ref32), and a gradient that is ~0 by
    # cancellation carries float32 noise of the size of the other gradients.
    def magnitude(*xs):
        vals = [x.detach()[torch.isfinite(x.detach())].abs().max() for x in xs if x is not None and torch.isfinite(x).any()]
        return max([1.0] + [float(v) for v in vals])

    grad_scale = magnitude(*(r[2] for n, r in refs.items() if n not in ("out", "lse")))
    for name, (got, lp, r32) in refs.items():
        if got is None:
            res.errors[name] = (math.inf, 0.0)
            continue
        if name == "lse":
            err, lp_err = lse_err(got, r32), lse_err(lp, r32)
        else:
            err, lp_err = max_abs_err(got, r32), max_abs_err(lp, r32)
        if name == "dsinks":
            # One scalar per head summed over batch x seqlen_q rows: ref_lp's per-row errors
            # cancel by chance, so use the most they could add up to (see test_gpu_kernels.py).
            w = torch.exp(f32[3][None, :, None] - l32)

            def delta(o, do):
                return (do.float() * o.float()).sum(-1).transpose(1, 2) - dl

            lp_err = max(lp_err, float((w * (delta(olp, dout) - delta(o32, dout)).abs()).sum(dim=(0, 2)).max()))
        factor = 2 if name in ("out", "lse") else 3
        floor = 1e-5 * (magnitude(r32) if name in ("out", "lse") else grad_scale)
        res.errors[name] = (err, factor * lp_err + floor)
    if any(err > bound for err, bound in res.errors.values()):
        res.status = "FAIL"
    return res


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a smaller grid (a few seconds)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the inputs (default 0)")
    p.add_argument(
        "--mode",
        choices=("auto", "reference", "kernels"),
        default="auto",
        help="auto: GPU kernels when CUDA is available, else the CPU reference vs naive float64; "
        "kernels without CUDA runs the low-precision harness on the CPU reference (self-test)",
    )
    p.add_argument("-k", dest="only", default=None, help="run only cases whose name contains this")


def _fmt(err: float, bound: float) -> str:
    """The error, red when over its bound."""
    def f(x):
        return "inf" if math.isinf(x) else f"{x:.1e}".replace("e-0", "e-").replace("e+0", "e")

    return f(err) if err <= bound else f"[bold red]{f(err)}!"


SHORT_DTYPE = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def results_table(results: list[Result], what: str, console):
    """The results as a rich Table in the widest layout that fits ``console.width``: every
    tensor's error with the case's shape, then without the shape, then only the worst ratio
    (with the tensor it comes from).  No cell is ever squeezed: columns never wrap."""
    from rich.measure import Measurement
    from rich.table import Table

    def build(layout: str) -> Table:
        title = f"flashtile check: {what}"
        if layout != "compact":
            title += "; cells: max abs error (! = over its bound)"
        title += "; worst: largest error / allowed"
        table = Table(title=title, pad_edge=False)
        table.add_column("case", no_wrap=True)
        if layout == "full":
            table.add_column("shape / options", style="dim", no_wrap=True)
        table.add_column("dtype", no_wrap=True)
        if layout != "compact":
            for name in TENSORS:
                table.add_column(name, justify="right", no_wrap=True)
        table.add_column("worst", justify="right", no_wrap=True)
        table.add_column("result", no_wrap=True)
        for r in results:
            style = {"pass": "[green]pass", "FAIL": "[bold red]FAIL", "unsupported": "[yellow]unsupported"}[r.status]
            ratios = {n: (e / b if b > 0 else math.inf) for n, (e, b) in r.errors.items()}
            worst_name = max(ratios, key=ratios.get) if ratios else None
            worst = f"{ratios[worst_name]:.2f}" if ratios else "-"
            row = [r.case.name]
            if layout == "full":
                row.append(r.case.describe())
            row.append(SHORT_DTYPE.get(r.dtype, str(r.dtype).removeprefix("torch.")))
            if layout == "compact":
                row.append(f"{worst} {worst_name}" if worst_name else worst)
            else:
                row += [_fmt(*r.errors[n]) if n in r.errors else "-" for n in TENSORS]
                row.append(worst)
            table.add_row(*row, style)
        return table

    for layout in ("full", "medium"):
        table = build(layout)
        if Measurement.get(console, console.options.update(max_width=10_000), table).maximum <= console.width:
            return table
    return build("compact")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console() if sys.stdout.isatty() else Console(width=200)
    mode = getattr(args, "mode", "auto")
    if mode == "auto":
        mode = "kernels" if torch.cuda.is_available() else "reference"
    device = "cuda" if (mode == "kernels" and torch.cuda.is_available()) else "cpu"
    if mode == "reference":
        dtypes, fn, what = (torch.float32, torch.float64), check_reference_case, "reference (CPU) vs naive float64"
    else:
        dtypes, what = (torch.bfloat16, torch.float16), f"{'TileLang kernels' if device == 'cuda' else 'CPU reference'} vs reference float32 (flash-attn rule)"

        def fn(case, dtype, seed):
            return check_kernel_case(case, dtype, seed, device=device)

    cases = [c for c in CASES if (c.quick or not args.quick) and (args.only is None or args.only in c.name)]
    if not cases:
        pool = [c.name for c in CASES if c.quick or not args.quick]
        print(
            f"flashtile check: error: -k {args.only!r} matches no case{' of --quick' if args.quick else ''}; "
            f"cases: {', '.join(pool)}",
            file=sys.stderr,
        )
        return 2
    jobs = [(c, dt) for c in cases for dt in dtypes]
    results: list[Result] = []
    t0 = time.perf_counter()
    with Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        task = progress.add_task("checking", total=len(jobs))
        for i, (case, dtype) in enumerate(jobs):
            progress.update(task, description=f"{case.name} {str(dtype).removeprefix('torch.')}")
            try:
                results.append(fn(case, dtype, args.seed + i))
            except Exception as e:  # a crash is a failure of that case, not of the whole check
                results.append(Result(case, dtype, status="FAIL", note=f"{type(e).__name__}: {e}"))
            progress.advance(task)

    console.print(results_table(results, what, console))
    for r in results:
        if r.note:
            console.print(f"[dim]{r.case.name} {str(r.dtype).removeprefix('torch.')}:[/dim] {r.status}: {r.note}")
    n_fail = sum(r.status == "FAIL" for r in results)
    n_unsup = sum(r.status == "unsupported" for r in results)
    n_pass = len(results) - n_fail - n_unsup
    dev = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    console.print(
        f"{n_pass} passed, {n_fail} failed, {n_unsup} unsupported on {dev} in {time.perf_counter() - t0:.1f} s"
    )
    return 0 if n_fail == 0 else 1


def main(argv: list[str] | None = None) -> int:
    from .cli import PlainFormatter

    p = argparse.ArgumentParser(prog="flashtile check", description=__doc__.strip(), formatter_class=PlainFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
