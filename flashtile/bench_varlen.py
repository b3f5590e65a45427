"""``flashtile bench --varlen``: packed (variable-length) batches.

    flashtile bench --varlen                       # GPU grid below, or a tiny CPU run
    flashtile bench --varlen --headdim 128 --causal true --mode fwd --json varlen.json

Batches (lengths drawn with a fixed seed): 16 sequences of 128..4096 tokens, 64 sequences of
64..1024, and 8 equal sequences of 4096; bf16, nheads * headdim = 2048 (32 heads at d = 64, 16 at
d = 128), causal and full, forward and backward.  Every batch is timed for:

    flashtile-varlen   flash_attn_varlen_func on the packed tokens
    flashtile-packed   the same with the packed kernels forced, on batches of equal lengths only
                       (which flashtile-varlen runs with the dense kernels); n/a elsewhere
    flashtile-padded   flash_attn_func on the batch right-padded to its longest sequence
    flashtile-equal    flash_attn_func on batch x (total // batch) tokens: the same work spread evenly
    sdpa-nested        PyTorch SDPA on nested jagged tensors, cuDNN / flash backends
    loop               flash_attn_func once per sequence, in a Python loop
    flash-attn         flash_attn_varlen_func of flash-attn, when it is installed

Useful TFLOP/s count only the real tokens: the sum over sequences of flash-attn's count
(``flashtile.flops``: 4 * Sq * Sk_visible * d per head forward, backward 2.5x), so padding
shows up as lost throughput; flashtile-equal counts the FLOPs of its own equal-length batch.
Timing is ``flashtile bench``'s (``triton.testing.do_bench`` median on CUDA, wall clock on
CPU).  flashtile-varlen is first compared with the float32 reference on the first two
sequences and heads; a mismatch is reported and not timed.  A backend that cannot run says
why in one word, as in ``flashtile bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from . import bench, reference
from .flops import attention_flops
from .interface import flash_attn_func
from .varlen import flash_attn_varlen_func

BACKENDS = ("flashtile-varlen", "flashtile-packed", "flashtile-padded", "flashtile-equal", "sdpa-nested", "loop",
            "flash-attn")
GPU_HEADDIMS = (64, 128)
GPU_MODES = ("fwd", "bwd")
CPU_HEADDIMS = (16,)
CPU_NHEADS = 2
SEED = 0


@dataclass(frozen=True)
class Batch:
    name: str
    lengths: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.lengths)


def batches(device: str, seed: int = SEED) -> list[Batch]:
    """The benchmark's packed batches (tiny ones on CPU)."""
    rng = random.Random(seed)
    if device == "cuda":
        return [
            Batch("16 x 128..4096", tuple(rng.randint(128, 4096) for _ in range(16))),
            Batch("64 x 64..1024", tuple(rng.randint(64, 1024) for _ in range(64))),
            Batch("8 x 4096", (4096,) * 8),
        ]
    return [
        Batch("4 x 8..64", tuple(rng.randint(8, 64) for _ in range(4))),
        Batch("8 x 4..32", tuple(rng.randint(4, 32) for _ in range(8))),
        Batch("2 x 48", (48, 48)),
    ]


def useful_flops(lengths, nheads: int, headdim: int, causal: bool, mode: str) -> int:
    """FLOPs of the real tokens: flash-attn's count per sequence, summed."""
    return sum(attention_flops(1, nheads, n, n, headdim, headdim, causal=causal, mode=mode) for n in lengths)


@dataclass(frozen=True)
class Case:
    batch: Batch
    headdim: int
    nheads: int
    causal: bool


@dataclass
class Row:
    batch: str
    lengths: list
    headdim: int
    nheads: int
    causal: bool
    mode: str
    backend: str
    status: str = "ok"
    ms: Optional[float] = None
    tflops: Optional[float] = None
    note: str = ""


# --- backends: each returns a bench.Runner (fwd() -> out, leaves, dout) -------------------------


class Packed:
    """A case's random packed q, k, v, dout (total, H, D) and cu_seqlens, made once."""

    def __init__(self, case: Case, device: str, dtype: torch.dtype):
        gen = torch.Generator(device=device).manual_seed(SEED)
        shape = (case.batch.total, case.nheads, case.headdim)
        self.q, self.k, self.v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
        self.dout = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        lengths = torch.tensor(case.batch.lengths)
        self.cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)
        self.starts = self.cu.tolist()
        self.max_len = max(case.batch.lengths)


def _dense(case: Case, device: str, dtype: torch.dtype, batch: int, seqlen: int):
    gen = torch.Generator(device=device).manual_seed(SEED)
    shape = (batch, seqlen, case.nheads, case.headdim)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(shape, generator=gen, device=device, dtype=dtype)


def _varlen(case, p: Packed, device, dtype):
    def fwd():
        return flash_attn_varlen_func(p.q, p.k, p.v, p.cu, p.cu, p.max_len, p.max_len, causal=case.causal)

    return bench.Runner(fwd, [p.q, p.k, p.v], p.dout)


class NotApplicable(Exception):
    """The backend measures nothing new on this batch (reported as 'n/a')."""


def _packed_kernels(case, p: Packed, device, dtype):
    from . import kernels

    if len(set(case.batch.lengths)) > 1 or device != "cuda":
        raise NotApplicable("lengths differ: flashtile-varlen runs the packed kernels")

    @contextlib.contextmanager
    def forced():
        kernels.EQUAL_AS_DENSE = False
        try:
            yield
        finally:
            kernels.EQUAL_AS_DENSE = True

    runner = _varlen(case, p, device, dtype)
    runner.context = forced
    return runner


def _padded(case, p: Packed, device, dtype):
    q, k, v, dout = _dense(case, device, dtype, len(case.batch.lengths), p.max_len)
    return bench.Runner(lambda: flash_attn_func(q, k, v, causal=case.causal), [q, k, v], dout, f"padded to {p.max_len}")


def _equal(case, p: Packed, device, dtype):
    b = len(case.batch.lengths)
    q, k, v, dout = _dense(case, device, dtype, b, case.batch.total // b)
    return bench.Runner(lambda: flash_attn_func(q, k, v, causal=case.causal), [q, k, v], dout,
                        f"{b} x {case.batch.total // b}, own FLOPs")


def _loop(case, p: Packed, device, dtype):
    spans = list(zip(p.starts[:-1], p.starts[1:]))

    def fwd():
        outs = [flash_attn_func(p.q[None, s:e], p.k[None, s:e], p.v[None, s:e], causal=case.causal)[0] for s, e in spans]
        return torch.cat(outs)

    return bench.Runner(fwd, [p.q, p.k, p.v], p.dout)


def _nested(case, p: Packed, device, dtype):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    offsets = p.cu.long()
    context = contextlib.nullcontext
    if device == "cuda":
        context = lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION])  # noqa: E731

    def fwd():
        q, k, v = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (p.q, p.k, p.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
        return out.transpose(1, 2).values()

    return bench.Runner(fwd, [p.q, p.k, p.v], p.dout, "cuDNN/flash" if device == "cuda" else "", context)


def _flash_attn(case, p: Packed, device, dtype):
    try:
        from flash_attn import flash_attn_varlen_func as fa
    except ImportError as e:
        raise bench.Unsupported("flash-attn is not installed") from e

    def fwd():
        return fa(p.q, p.k, p.v, p.cu, p.cu, p.max_len, p.max_len, causal=case.causal)

    return bench.Runner(fwd, [p.q, p.k, p.v], p.dout)


FACTORIES: dict[str, Callable] = {
    "flashtile-varlen": _varlen,
    "flashtile-packed": _packed_kernels,
    "flashtile-padded": _padded,
    "flashtile-equal": _equal,
    "sdpa-nested": _nested,
    "loop": _loop,
    "flash-attn": _flash_attn,
}


def check_varlen(case: Case, p: Packed, out: torch.Tensor, grads, dtype) -> Optional[str]:
    """flashtile-varlen against the float32 reference on the first two sequences and heads."""
    tol_out, tol_grad = bench.TOLERANCES.get(dtype, bench.TOLERANCES[torch.float32])
    n = p.starts[min(2, len(p.starts) - 1)]
    cu = p.cu[: min(3, len(p.starts))]
    qs, ks, vs = (x.detach()[:n, :2].float() for x in (p.q, p.k, p.v))
    scale = reference.default_scale(case.headdim)
    window = (-1, 0) if case.causal else (-1, -1)
    with torch.no_grad():
        ref_out, ref_lse = reference.varlen_attention_forward(qs, ks, vs, cu, cu, scale, window)
        errs = {"out": (bench._rel_err(out[:n, :2], ref_out), tol_out)}
        if grads is not None:
            dref = reference.varlen_attention_backward(p.dout[:n, :2].float(), qs, ks, vs, ref_out, ref_lse, cu, cu, scale, window)
            for name, g, r in zip(("dq", "dk", "dv"), grads, dref[:3]):
                errs[name] = (bench._rel_err(g[:n, :2], r), tol_grad)
    bad = [f"{k} rel err {e:.1e} > {t:.0e}" for k, (e, t) in errs.items() if not e <= t]
    return "; ".join(bad) or None


# --- the sweep ----------------------------------------------------------------------------------


def _flops(case: Case, backend: str, mode: str) -> int:
    if backend == "flashtile-equal":
        b = len(case.batch.lengths)
        return attention_flops(b, case.nheads, case.batch.total // b, case.batch.total // b, case.headdim, causal=case.causal, mode=mode)
    return useful_flops(case.batch.lengths, case.nheads, case.headdim, case.causal, mode)


def sweep(cases, modes, backends, device, dtype, timer, check=True, log=print, time_limit=None) -> list[Row]:
    rows = []
    start = time.perf_counter()
    need_bwd = any(m != "fwd" for m in modes)
    for case in cases:
        p = Packed(case, device, dtype)
        for backend in backends:
            new = {m: Row(case.batch.name, list(case.batch.lengths), case.headdim, case.nheads, case.causal, m, backend) for m in modes}
            rows.extend(new.values())

            def fail(status, detail):
                for r in new.values():
                    r.status, r.note = status, detail

            if time_limit is not None and time.perf_counter() - start > time_limit:
                fail("skipped", "time limit")
                continue
            try:
                runner = FACTORIES[backend](case, p, device, dtype)
                with warnings.catch_warnings(), runner.context():
                    warnings.simplefilter("ignore")
                    out = runner.fwd()
                    grads = torch.autograd.grad(out, runner.leaves, runner.dout) if need_bwd else None
                    if check and backend in ("flashtile-varlen", "flashtile-packed"):
                        bad = check_varlen(case, p, out, grads, dtype)
                        if bad:
                            fail("mismatch", bad)
                            continue
                    for mode, row in new.items():
                        ms = timer(bench._timed_fn(runner, mode), runner.leaves)
                        row.ms, row.tflops, row.note = ms, _flops(case, backend, mode) / (ms * 1e-3) / 1e12, runner.note
            except Exception as e:  # noqa: BLE001 - reported as one word, as in flashtile bench
                status, detail = ("n/a", str(e)) if isinstance(e, NotApplicable) else bench.classify(e)
                if "no viable backend" in detail.lower():  # SDPA on nested tensors: e.g. CPU and causal
                    status = "unsupported"
                fail(status, detail)
            finally:
                for x in p.q, p.k, p.v:
                    x.grad = None
            for r in new.values():
                log(_line(r))
    return rows


def _line(r: Row) -> str:
    what = f"{r.batch:>16} d{r.headdim:<3} h{r.nheads:<3} {'causal' if r.causal else 'full':6} {r.mode:4} {r.backend:17}"
    if r.status != "ok":
        return f"{what} {r.status}: {r.note}"
    return f"{what} {r.ms:9.3f} ms {r.tflops:8.3g} TFLOP/s  {r.note}"


def ratios(rows: list[Row], base: str = "flashtile-varlen") -> dict:
    """{(batch, d, causal, mode, backend): time of base / time of backend} (> 1: faster than base)."""
    key = lambda r: (r.batch, r.headdim, r.causal, r.mode)  # noqa: E731
    base_ms = {key(r): r.ms for r in rows if r.backend == base and r.status == "ok"}
    return {key(r) + (r.backend,): base_ms[key(r)] / r.ms for r in rows if r.status == "ok" and key(r) in base_ms}


def markdown(rows: list[Row], meta: dict) -> str:
    backends = [b for b in BACKENDS if any(r.backend == b for r in rows)]
    out = [f"# flashtile bench --varlen on {meta['device']} ({meta['date']})", "",
           f"{meta['dtype']}; useful TFLOP/s (real tokens only; flashtile-equal: its own batch); {meta['timing']}", ""]
    out.append("| batch | d | mask | pass | " + " | ".join(backends) + " |")
    out.append("| --- | ---: | --- | --- | " + " | ".join("---:" for _ in backends) + " |")
    cells = {(r.batch, r.headdim, r.causal, r.mode, r.backend): r for r in rows}
    for key in dict.fromkeys((r.batch, r.headdim, r.causal, r.mode) for r in rows):
        vals = []
        for b in backends:
            r = cells.get(key + (b,))
            vals.append("" if r is None else (f"{r.tflops:.3g}" if r.status == "ok" else r.status))
        out.append(f"| {key[0]} | {key[1]} | {'causal' if key[2] else 'full'} | {key[3]} | " + " | ".join(vals) + " |")
    return "\n".join(out) + "\n"


def plan(args: argparse.Namespace, cuda_available: bool):
    """(device, dtype, cases, modes) from ``flashtile bench``'s flags."""
    device = "cuda" if (args.device == "cuda" or (args.device == "auto" and cuda_available)) else "cpu"
    dtype = bench.DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    headdims = [d for d, _ in args.headdim] if args.headdim else list(GPU_HEADDIMS if device == "cuda" else CPU_HEADDIMS)
    causals = {"true": [True], "false": [False], "both": [True, False]}[args.causal]
    modes = tuple(args.mode) if args.mode else GPU_MODES
    cases = []
    for batch in batches(device):
        for d in headdims:
            nheads = args.nheads or (max(1, bench.HEADS_TIMES_DIM // d) if device == "cuda" else CPU_NHEADS)
            cases += [Case(batch, d, nheads, c) for c in causals]
    return device, dtype, cases, modes


def run(args: argparse.Namespace) -> int:
    """The varlen sweep with ``flashtile bench``'s flags; 1 if flashtile-varlen failed."""
    device, dtype, cases, modes = plan(args, torch.cuda.is_available())
    timer, timing = bench.make_timer(device, args.warmup, args.rep)
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if device == "cuda" else "CPU (reference path, no GPU kernel)",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "timing": timing,
        "seed": SEED,
    }
    print(f"flashtile bench --varlen on {meta['device']}; {meta['dtype']}; {timing}")
    print("useful TFLOP/s: FLOPs of the real tokens only (flashtile-equal: its own equal-length batch)")
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    try:
        wanted = getattr(args, "varlen_backends", None) or BACKENDS
        unknown = sorted(set(wanted) - set(BACKENDS))
        if unknown:
            raise SystemExit(f"flashtile bench --varlen-backends: unknown {', '.join(unknown)} (from {', '.join(BACKENDS)})")
        backends = [b for b in BACKENDS if b in wanted]
        rows = sweep(cases, modes, backends, device, dtype, timer, check=not args.no_check, time_limit=args.time_limit)
    finally:
        torch.set_num_threads(threads)
    rel = ratios(rows)
    print("\nspeed relative to flashtile-varlen (> 1 is faster):")
    for (batch, d, causal, mode, backend), r in rel.items():
        if backend != "flashtile-varlen":
            print(f"  {batch:>16} d{d:<3} {'causal' if causal else 'full':6} {mode:4} {backend:17} {r:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, meta))
    failed = [r for r in rows if r.backend == "flashtile-varlen" and r.status not in ("ok", "skipped")]
    return 1 if failed else 0
