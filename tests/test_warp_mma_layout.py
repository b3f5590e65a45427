"""The FP8-cache decode's mma.sync fragment layouts (``flashtile/kernels/warp_mma.py``), on the CPU.

One warp's 16-key slice is simulated lane by lane: the A / B / C fragment tables of PTX's
``mma.sync.m16n8k16`` (fp16), ``ldmatrix.trans`` and ``__byte_perm`` as the PTX ISA and the CUDA
documentation define them, and the kernel's own index maps (``q_slot``, ``k_offset``,
``v_reg``, ``vb_slot``, ``out_feature``, ``merge_source``, ``merge_column``).  If a map is
edited inconsistently, S or O lands in the wrong place here, long before a GPU run.
"""

import pytest
import torch

from flashtile.kernels import warp_mma as wm

LANES = [(lane // 4, lane % 4) for lane in range(32)]  # (g, t)


def a_at(h, g, t):
    """(row, k) of half h of lane (g, t)'s A fragment (16 x 16)."""
    return g + 8 * (h // 2 % 2), 2 * t + h % 2 + 8 * (h // 4)


def b_at(h, g, t):
    """(k, n) of half h of lane (g, t)'s B fragment (16 x 8)."""
    return 2 * t + h % 2 + 8 * (h // 2), g


def c_at(c, g, t):
    """(row, n) of element c of lane (g, t)'s C fragment (16 x 8)."""
    return g + 8 * (c // 2), 2 * t + c % 2


def mma(a, b):
    """C fragments of A B from per-lane fragments a[lane][8], b[lane][4] (float64)."""
    A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
    for lane, (g, t) in enumerate(LANES):
        for h in range(8):
            A[a_at(h, g, t)] = a[lane][h]
        for h in range(4):
            B[b_at(h, g, t)] = b[lane][h]
    C = A @ B
    return [[C[c_at(c, g, t)].item() for c in range(4)] for g, t in LANES]


def ldmatrix_trans(rows):
    """``ldmatrix...trans.b16`` of one 8 x 8 matrix of two-byte elements, ``rows[r]`` the 16
    bytes of row r: lane (g, t) receives elements (2t, g) and (2t + 1, g), as the register's
    low and high halves (bytes, low first)."""
    return [[rows[2 * t][2 * g], rows[2 * t][2 * g + 1], rows[2 * t + 1][2 * g], rows[2 * t + 1][2 * g + 1]]
            for g, t in LANES]


def byte_perm(x, selector):
    """``__byte_perm(x, 0, selector)`` on a register given as 4 bytes (low first)."""
    return [x[(selector >> (4 * i)) & 0xF] if (selector >> (4 * i)) & 0xF < 4 else 0 for i in range(4)]


def e4m3(byte):
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).double().item()


def q_fragments(q, dim):
    """Q's A fragments per lane (``load_queries``: ``q_slot``'s permuted feature order)."""
    qw, kc_n = dim // 4, dim // 16
    qa = [[0.0] * (kc_n * 8) for _ in LANES]
    for lane, (g, t) in enumerate(LANES):
        for kc in range(kc_n):
            for e in range(4):
                for hr in range(2):
                    qa[lane][wm.q_slot(kc, e, hr)] = q[g + 8 * hr, t * qw + 4 * kc + e].item()
    return qa


def slice_scores(qa, kflat, dim, want_s):
    """S = Q K^T of the slice's two n-tiles from the A fragments and each lane's K elements
    (``kflat``: lane t's features t qw .. of keys 8 j + g, j-major, as the kernel's operand),
    checked against ``want_s``; returns the C fragments s[j][lane]."""
    qw, kc_n = dim // 4, dim // 16
    s = []
    for j in range(2):
        acc = [[0.0] * 4 for _ in LANES]
        for kc in range(kc_n):
            off = wm.k_offset(j, kc, qw)
            part = mma([qa[lane][kc * 8:kc * 8 + 8] for lane in range(32)],
                       [kflat[lane][off:off + 4] for lane in range(32)])
            acc = [[a + b for a, b in zip(x, y)] for x, y in zip(acc, part)]
        s.append(acc)
    for j in range(2):
        for lane, (g, t) in enumerate(LANES):
            for c in range(4):
                row, n = c_at(c, g, t)
                assert abs(s[j][lane][c] - want_s[row, 8 * j + n].item()) < 1e-9, f"S n-tile {j} lane {lane} elt {c}"
    return s


def ldmatrix_registers(vb, vcols):
    """V's ldmatrix.trans registers per lane: matrix m of call q_ = keys 8 (m % 2) .. of 16-byte
    column 2 q_ + m // 2 (the kernel's lane addresses), into vraw[4 q_ + m]; ``vb`` the raw
    stage's bytes, ``vcols`` its 16-byte columns."""
    vraw = [[None] * (2 * vcols) for _ in LANES]
    for call in range(vcols // 2):
        for m in range(4):
            col = (2 * call + m // 2) * 16
            rows = [vb[8 * (m % 2) + r, col:col + 16].tolist() for r in range(8)]
            for lane, reg in enumerate(ldmatrix_trans(rows)):
                vraw[lane][4 * call + m] = reg
    return vraw


def assert_output_tile(o, fn, want_o, narrow):
    """P V's n-tile ``fn`` C fragments land on ``out_feature``'s columns."""
    for lane, (g, t) in enumerate(LANES):
        for c in range(4):
            row, n = c_at(c, g, t)
            got, want = o[lane][c], want_o[row, wm.out_feature(fn, n, narrow=narrow)].item()
            assert abs(got - want) < 1e-9, f"O n-tile {fn} lane {lane} elt {c}: {got} != {want}"


def assert_merge_covers_output(dim_v, narrow):
    """The merge: thread (warp w, lane) stores n-tiles fpt w + j at ``merge_column``; every
    output element exactly once, each from its own row and column."""
    fpt = dim_v // 8 // wm.WARPS
    runs, run = wm.merge_runs(fpt, narrow)
    seen = {}
    for w in range(wm.WARPS):
        for lane, (g, t) in enumerate(LANES):
            for hr in range(2):
                for h in range(runs):
                    for y in range(run):
                        j, e = wm.merge_source(h, y, hr, narrow)
                        row, n = c_at(e, g, t)
                        col = wm.merge_column(fpt, w, h, t, y, narrow)
                        assert row == g + 8 * hr and col == wm.out_feature(fpt * w + j, n, narrow), (w, lane, hr, h, y)
                        seen[row, col] = seen.get((row, col), 0) + 1
    assert sorted(seen) == [(r, c) for r in range(16) for c in range(dim_v)] and set(seen.values()) == {1}


@pytest.mark.parametrize("dim,dim_v", [(128, 128), (64, 64), (64, 128), (128, 64)])
def test_one_warp_slice_computes_q_k_v_in_place(dim, dim_v):
    g_ = torch.Generator().manual_seed(dim * 1000 + dim_v)
    q = torch.randn(16, dim, generator=g_).half().double()  # the fp16 A operand
    k8 = (torch.randn(16, dim, generator=g_) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(16, dim_v, generator=g_) * 2).to(torch.float8_e4m3fn)
    kb, vb = k8.view(torch.uint8), v8.view(torch.uint8)  # the raw stage's bytes
    k, v = k8.double(), v8.double()
    qw, fn_n = dim // 4, dim_v // 8

    # Q's A fragments and K's B fragments (kraw: lane t's bytes t qw .. of key 8 j + g, widened).
    qa = q_fragments(q, dim)
    kflat = [[e4m3(kb[8 * j + g, t * qw + x].item()) for j in range(2) for x in range(qw)] for g, t in LANES]
    s = slice_scores(qa, kflat, dim, q @ k.T)

    # P: S's C fragments reused as the A fragment (halves 4 j + c), rounded to fp16.
    pa = [[torch.tensor(s[h // 4][lane][h % 4]).half().double().item() for h in range(8)] for lane in range(32)]
    p = torch.zeros(16, 16, dtype=torch.float64)
    for lane, (g, t) in enumerate(LANES):
        for h in range(8):
            p[a_at(h, g, t)] = pa[lane][h]

    # V: ldmatrix.trans of 16-byte columns of 16 features, then byte_perm 0x3120 and the cvt.
    vraw = ldmatrix_registers(vb, dim_v // 16)
    for h in range(2):
        for c in range(dim_v // 16):
            assert wm.v_reg(h, c) == 4 * (c // 2) + 2 * (c % 2) + h  # matrix m = 2 (c % 2) + h of call c // 2
    vfrag = [[None] * (fn_n * 2) for _ in LANES]
    for lane in range(32):
        for h in range(2):
            for c in range(dim_v // 16):
                pair = byte_perm(vraw[lane][wm.v_reg(h, c)], 0x3120)
                vfrag[lane][wm.vb_slot(2 * c, h)] = [e4m3(pair[0]), e4m3(pair[1])]
                vfrag[lane][wm.vb_slot(2 * c + 1, h)] = [e4m3(pair[2]), e4m3(pair[3])]
    want_o = p @ v
    for fn in range(fn_n):
        at = wm.vb_slot(fn, 0)  # the kernel's mma reads two registers from here
        b = [vfrag[lane][at] + vfrag[lane][at + 1] for lane in range(32)]
        assert_output_tile(mma(pa, b), fn, want_o, narrow=True)

    assert_merge_covers_output(dim_v, narrow=True)


def half_of(lo, hi, dtype):
    """The 16-bit element (``dtype``) whose bytes, low first, are ``lo``, ``hi``."""
    return torch.tensor([lo, hi], dtype=torch.uint8).view(dtype).double().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,dim_v", [(128, 128), (64, 64), (64, 128), (128, 64)])
def test_one_warp_slice_of_a_16bit_cache(dim, dim_v, dtype):
    """The same slice over a 16-bit cache (``warp_mma_macros(cache_dtype=dtype)``): K's
    elements are the B fragments as loaded (``k_offset`` in elements), V's ldmatrix.trans
    registers (h, c) are n-tile c's B fragment as they are, output columns in the plain order
    (``out_feature(..., narrow=False)``), and the merge's runs of two columns cover every
    output element once."""
    g_ = torch.Generator().manual_seed(dim * 1000 + dim_v + 7)
    q = torch.randn(16, dim, generator=g_).to(dtype).double()
    k16 = torch.randn(16, dim, generator=g_).to(dtype)
    v16 = torch.randn(16, dim_v, generator=g_).to(dtype)
    k, v = k16.double(), v16.double()
    vb = v16.view(torch.uint8)  # 2 bytes an element, low first
    qw, fn_n = dim // 4, dim_v // 8

    kflat = [[k[8 * j + g, t * qw + x].item() for j in range(2) for x in range(qw)] for g, t in LANES]
    slice_scores(q_fragments(q, dim), kflat, dim, q @ k.T)

    p = torch.randn(16, 16, generator=g_).to(dtype).double()  # any P: the A fragment's layout is tested above
    pa = [[p[a_at(h, g, t)].item() for h in range(8)] for g, t in LANES]
    vraw = ldmatrix_registers(vb, dim_v // 8)  # 16-byte columns of 8 features
    want_o = p @ v
    for fn in range(fn_n):
        at = wm.v_reg(0, fn)  # the kernel's mma reads registers (0, fn), (1, fn) from here
        assert wm.v_reg(1, fn) == at + 1
        b = [[half_of(*vraw[lane][at][0:2], dtype), half_of(*vraw[lane][at][2:4], dtype),
              half_of(*vraw[lane][at + 1][0:2], dtype), half_of(*vraw[lane][at + 1][2:4], dtype)] for lane in range(32)]
        assert_output_tile(mma(pa, b), fn, want_o, narrow=False)

    assert_merge_covers_output(dim_v, narrow=False)
