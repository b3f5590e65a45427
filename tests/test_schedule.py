"""Launch order of CTAs: the dK/dV kernel's (``kernels/schedule.py``, ``configs.dkdv_rows_per_group``)
and the persistent forward's tile pairs (``fwd_ws.tile_pair``).

``grouped_tile`` is integer arithmetic that the kernel evaluates per CTA; with Python ints it
evaluates here, so the permutation is checked on CPU for awkward sizes (a short last group,
one row, one block, groups larger than the grid).
"""

import dataclasses
import itertools

import pytest

from flashtile.kernels import configs
from flashtile.kernels.schedule import grouped_tile


@pytest.mark.parametrize(
    "n_blocks,n_rows,rows_per_group",
    [(4, 3, 2), (1, 7, 3), (33, 1, 1), (33, 5, 4), (32, 16, 4), (7, 9, 9), (5, 6, 1), (3, 10, 20)],
)
def test_grouped_tile_is_a_permutation_walking_groups_block_major(n_blocks, n_rows, rows_per_group):
    rows_per_group = min(rows_per_group, n_rows)  # what the launcher passes
    order = [grouped_tile(i, n_blocks, n_rows, rows_per_group) for i in range(n_blocks * n_rows)]
    assert sorted(order) == list(itertools.product(range(n_blocks), range(n_rows))), f"not a permutation: {order}"
    for start in range(0, n_rows, rows_per_group):
        rows = range(start, min(start + rows_per_group, n_rows))
        span = [order.index((blk, r)) for blk in range(n_blocks) for r in rows]
        # The group's CTAs are contiguous and walk block 0 of every row, then block 1, ...
        assert span == list(range(span[0], span[0] + len(span))), f"group at row {start} not block-major: {span}"


def test_row_by_row_order_is_the_plain_grid():
    assert [grouped_tile(i, 3, 2, 1) for i in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize(
    "kind,groups,rows,key_blocks,expected",
    [
        ("local", 4, 16, 32, 4),  # GQA 4:1 causal 4k on 132 SMs: measured best
        ("local", 4, 8, 64, 2),  # 8k
        ("local", 4, 4, 128, 1),  # 16k: a wave per row
        ("local", 4, 2, 1, 2),  # never more rows than there are
        ("local", 1, 64, 32, 1),  # MHA: row by row (measured equal or slower otherwise)
        ("full", 4, 16, 32, 1),  # no mask: every CTA equally long
    ],
)
def test_dkdv_rows_per_group(kind, groups, rows, key_blocks, expected):
    got = configs.dkdv_rows_per_group(kind, groups, rows, key_blocks, sm_count=132)
    assert got == expected, f"{kind} groups={groups} rows={rows} key_blocks={key_blocks}: {got}, want {expected}"


def _value(x):
    """A folded TileLang expression (``tile_pair`` is plain arithmetic on Python ints)."""
    from tilelang import tvm

    return x if isinstance(x, (int, bool)) else tvm.arith.Analyzer().simplify(x).value


@pytest.mark.parametrize("n_qb,H,B", [(1, 1, 1), (2, 3, 1), (5, 2, 3), (8, 4, 2), (33, 1, 2)])
def test_tile_pairs_cover_every_query_tile_once_with_balanced_causal_work(n_qb, H, B):
    """The persistent forward walks items of two query tiles (``fwd_ws.tile_pair``): every
    (head, batch, query block) is a real tile of exactly one item, and under a causal mask
    (block bx sees n_qb - bx key blocks) every item but an odd row's middle one holds
    n_qb + 1 blocks."""
    from flashtile.kernels.schedule import tile_pair

    pairs = (n_qb + 1) // 2
    seen = []
    for item in range(pairs * H * B):
        tiles = [tuple(_value(v) for v in tile_pair(item, half, n_qb, pairs, H)) for half in (0, 1)]
        real = [(h, b, bx) for h, b, bx, is_real in tiles if is_real]
        seen += real
        work = sum(n_qb - bx for _, _, bx in real)
        assert work == n_qb + 1 or (len(real) == 1 and n_qb % 2 == 1), f"item {item}: tiles {real} hold {work} blocks"
    assert sorted(seen) == sorted(itertools.product(range(H), range(B), range(n_qb))), f"not every tile once: {seen}"


def _packed_grid_tiles(lens, used, block, heads, head_group=1):
    """Evaluate a packed grid CTA by CTA with ``seqinfo``'s own slot arithmetic (the search the
    kernel's threads share, done here by a scan): [(entry, head, block)] of the CTAs with work."""
    from flashtile.kernels.seqinfo import packed_slots, slot_range, slot_tile

    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    batch, tiles = len(lens), []
    grid = heads * packed_slots(cu[-1], batch, block)  # Sequences.grid's extent
    for ids in range(grid):
        owners = [e for e in range(batch) if slot_range(cu, e, block)[0] <= ids // heads < slot_range(cu, e, block)[1]]
        assert len(owners) <= 1, f"slot {ids // heads} owned by {owners}"
        if not owners:
            continue
        e = owners[0]
        lo, hi = slot_range(cu, e, block)
        bx, h = slot_tile(ids, heads, lo, hi - lo, head_group)
        assert 0 <= h < heads, f"CTA {ids}: head {h}"
        if bx * block < used[e]:  # masks.query_tile's / query_block_range's live test
            tiles.append((e, h, bx))
    return tiles, grid


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("heads,head_group", [(1, 1), (3, 1), (3, 2), (8, 4)])
@pytest.mark.parametrize(
    "lens",
    [[1], [0, 0, 5], [128, 128, 128], [127, 129, 1, 0, 256, 255], [64] * 9, [1000, 3, 77, 0, 513], [0], [300]],
)
def test_packed_grid_runs_every_real_tile_once(lens, heads, head_group, block):
    """The packed grid (``seqinfo.packed_slots``): every (sequence, head, block) that holds
    rows is some CTA's, exactly once, and at most one slot per sequence and head is empty,
    whatever the head grouping (``slot_tile``; 3 heads in groups of 2 leave a short group)."""
    for used in (lens, [n // 2 for n in lens]):  # all rows, and seqused taking half
        tiles, grid = _packed_grid_tiles(lens, used, block, heads, head_group)
        want = [(e, h, bx) for e, n in enumerate(used) for h in range(heads) for bx in range(-(-n // block))]
        assert sorted(tiles) == sorted(want), f"lens {lens} used {used}: tiles {sorted(set(want) ^ set(tiles))[:5]} wrong"
        assert len(tiles) == len(set(tiles)), f"lens {lens}: a tile runs twice"
        if used == lens:
            assert grid - len(tiles) <= heads * len(lens), f"lens {lens}: {grid - len(tiles)} idle CTAs"


def test_packed_head_groups_start_every_longest_tile_first():
    """``slot_tile`` with a head group walks the group block-major: the group's heads all take
    block 0 (a sequence's last, longest causal tile) before any takes block 1."""
    from flashtile.kernels.seqinfo import slot_tile

    order = [slot_tile(i, 4, 0, 3, 2) for i in range(12)]  # 4 heads, 3 blocks, groups of 2
    assert order == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 2), (2, 3)], order


@pytest.mark.parametrize(
    "lens", [[1], [0, 0, 5], [127, 129, 1, 0, 256, 255], [64] * 9, [1000, 3, 77, 0, 513], [3] * 40, [0], [300]]
)
def test_packed_statistics_padding_covers_every_query_block(lens):
    """``packed_stats.stat_start``: each sequence's statistics start 4-aligned, and the ``STAT_PAD``
    entries after its rows (what a query block of up to STAT_PAD rows reads past the sequence's
    end: Delta 0, LSE2 +inf) belong to no other sequence and lie inside ``stat_rows``."""
    from flashtile.kernels.packed_stats import STAT_PAD, stat_rows, stat_start

    cu = [0, *itertools.accumulate(lens)]
    starts = [stat_start(cu[b], b) for b in range(len(lens))]
    rows = stat_rows(cu[-1], len(lens))
    assert all(s % 4 == 0 for s in starts) and rows % 4 == 0, f"starts {starts}, rows {rows}: not 16-byte aligned"
    for b, (s, n) in enumerate(zip(starts, lens)):
        end = s + n + STAT_PAD  # one past the last entry a query block may read
        nxt = starts[b + 1] if b + 1 < len(lens) else rows
        assert end <= nxt, f"lens {lens}: sequence {b}'s padding [{s + n}, {end}) reaches {nxt}"


@pytest.mark.parametrize("d,dv,sq,sk,short", [
    (64, 64, 1024, 1024, True), (64, 64, 1, 513, True), (64, 64, 1025, 512, False), (64, 64, 300, 2100, False),
    (48, 48, 512, 512, False), (64, 32, 512, 512, False), (128, 128, 512, 512, False),
    (256, 256, 512, 512, True), (256, 256, 1, 7, True), (256, 256, 513, 512, False), (256, 256, 1024, 1023, False),
    (192, 128, 512, 512, False),
])
def test_short_forwards_take_their_own_tiles(d, dv, sq, sk, short):
    """``configs.short_forward``: d = 64 with both lengths <= 1024 and d = 256 with both <= 512
    run a second compiled kernel, which precompile builds beside the long one: d = 64 the d=128 row's
    persistent 128-row pairs (with d = 64's per-thread partial row sums, and no pingpong turns for
    full attention), d = 256 64-key blocks instead of 80."""
    from flashtile.kernels import precompile

    assert configs.short_forward(d, dv, sq, sk) is short
    for kind in configs.MASK_KINDS:
        cfg = configs.fwd_config(64, 64, "bfloat16", kind, short=True)
        pairs = configs.fwd_config(128, 128, "bfloat16", kind)
        assert cfg == dataclasses.replace(pairs, defer_sum=True, pingpong=kind != "full"), cfg
        assert cfg.tiles_per_cta == 0 and not configs.fwd_config(128, 128, "bfloat16", kind).defer_sum, cfg
        long_64 = configs.fwd_config(64, 64, "bfloat16", kind)
        assert long_64.block_m == 192 and long_64.defer_sum, long_64
        long, short_cfg = configs.fwd_config(256, 256, "bfloat16", kind), configs.fwd_config(256, 256, "bfloat16", kind, short=True)
        assert (long.block_n, short_cfg.block_n) == (80, 64) and dataclasses.replace(short_cfg, block_n=80) == long, short_cfg
    built = [kw.get("short", False) for p, kw in precompile.structures([(d, dv)], ["bfloat16"], ["plain"], ["fwd", "vfwd"])]
    assert built == ([False, True, False] if (d, dv) in ((64, 64), (256, 256)) else [False, False]), built


@pytest.mark.parametrize("d,dv,sq,sk,short", [
    (128, 128, 4096, 4096, False), (128, 128, 16384, 4096, False), (128, 128, 4095, 16384, True),
    (128, 128, 16384, 1, True), (128, 128, 1, 1, True), (96, 96, 16384, 16384, False), (64, 64, 512, 512, True),
    (64, 64, 1024, 1024, True), (64, 64, 1, 1, True), (64, 64, 1025, 1024, False), (64, 64, 1024, 16384, False),
    (64, 64, 16384, 3, False), (64, 32, 512, 512, False), (256, 256, 512, 512, False),
])
def test_fp8_forwards_take_the_long_row_only_when_both_lengths_are_long(d, dv, sq, sk, short):
    """``configs.short_forward(..., fp8=True)``: the FP8 d = 128 forward runs one 192 x 96 tile per
    CTA on three consumer warpgroups when both lengths are at least 4096, the persistent pairs of
    128 x 128 tiles otherwise; d = 64 runs the same pairs when both lengths are at most 1024, one
    192 x 128 tile per CTA otherwise; packed batches and other head dims keep their one kernel,
    and precompile builds both rows of d = 128 and d = 64."""
    from flashtile.kernels import precompile

    fp8 = "float8_e4m3fn"
    assert configs.short_forward(d, dv, sq, sk, fp8=True) is short
    for kind in configs.MASK_KINDS:
        long_cfg, short_cfg = configs.fwd_config(128, 128, fp8, kind), configs.fwd_config(128, 128, fp8, kind, short=True)
        assert (long_cfg.block_m, long_cfg.block_n, long_cfg.threads, long_cfg.tiles_per_cta) == (192, 96, 384, 1), long_cfg
        assert (short_cfg.block_m, short_cfg.block_n, short_cfg.tiles_per_cta) == (128, 128, 0), short_cfg
        assert configs.fwd_config(128, 128, fp8, kind, varlen=True) == configs.fwd_config(128, 128, fp8, kind, True, True)
        assert configs.fwd_config(96, 96, fp8, kind) == configs.fwd_config(96, 96, fp8, kind, short=True)
        long_64, short_64 = configs.fwd_config(64, 64, fp8, kind), configs.fwd_config(64, 64, fp8, kind, short=True)
        assert (long_64.block_m, long_64.block_n, long_64.tiles_per_cta) == (192, 128, 1), long_64
        assert short_64 == short_cfg, short_64
        assert configs.fwd_config(64, 64, fp8, kind, varlen=True) == long_64
    built = [kw.get("short", False) for p, kw in precompile.structures([(d, dv)], ["bfloat16"], ["plain"], ["fwd8", "vfwd8"])]
    assert built == ([False, True, False] if (d, dv) in ((128, 128), (64, 64)) else [False, False]), built


def test_fwd_flags_switch_sets_flags_on_hand_written_rows_only(monkeypatch):
    """``FLASHTILE_FWD_FLAGS`` (developer switch: the GPU suite under a candidate flag) parses to
    ``overrides["fwd_flags"]``, which ``fwd_config`` sets on every hand-written row (packed and
    short rows too), never on an explicit ``overrides["fwd"]`` config; a bad entry is a named
    error."""
    assert configs._env_flags("FLASHTILE_FWD_FLAGS", "pingpong=0, skip_rescale=1") == {"pingpong": False, "skip_rescale": True}
    assert configs._env_flags("FLASHTILE_FWD_FLAGS", "tiles_per_cta=1") == {"tiles_per_cta": 1}
    assert configs._env_flags("FLASHTILE_FWD_FLAGS", "softmax_turns=2") == {"softmax_turns": 2}
    for bad in ("pingpong", "pingpong=2", "tiles_per_cta=3", "tiles_per_cta", "nope=1", "softmax_turns=3"):
        with pytest.raises(ValueError, match="FLASHTILE_FWD_FLAGS"):
            configs._env_flags("FLASHTILE_FWD_FLAGS", bad)
    monkeypatch.setitem(configs.overrides, "fwd_flags", {"skip_rescale": True})
    for dim, dtype, varlen, short in ((128, "bfloat16", False, False), (128, "bfloat16", True, False),
                                      (64, "bfloat16", False, True), (128, "float8_e4m3fn", False, False)):
        cfg = configs.fwd_config(dim, dim, dtype, "full", varlen, short)
        assert cfg.manual_ws and cfg.skip_rescale, (dim, dtype, varlen, short, cfg)
    monkeypatch.setitem(configs.overrides, "fwd_flags", configs._env_flags("FLASHTILE_FWD_FLAGS", "producer_regs=0"))
    for dim, varlen, short in ((64, False, True), (128, True, False)):  # a paired row, a one-tile row
        assert not configs.fwd_config(dim, dim, "bfloat16", "causal", varlen, short).producer_regs, (dim, varlen, short)
    monkeypatch.setitem(configs.overrides, "fwd", configs.FwdConfig(128, 128, 2, 256))
    assert not configs.fwd_config(128, 128, "bfloat16", "full").skip_rescale  # an explicit config wins


def test_bwd_flags_switch_sets_flags_on_hand_written_rows_only(monkeypatch):
    """``FLASHTILE_BWD_FLAGS`` (the backward's developer switch) parses to
    ``overrides["bwd_flags"]``, which ``bwd_config`` sets on the hand-written rows (d <= 128,
    no softcap) and not on the builder's (d = 256, softcap); forward-only flags are refused."""
    assert configs._env_flags("FLASHTILE_BWD_FLAGS", "producer_regs=1") == {"producer_regs": True}
    for bad in ("producer_regs", "pingpong=1", "producer_regs=2"):
        with pytest.raises(ValueError, match="FLASHTILE_BWD_FLAGS"):
            configs._env_flags("FLASHTILE_BWD_FLAGS", bad)
    monkeypatch.setitem(configs.overrides, "bwd_flags", {"producer_regs": True})
    for dim, varlen in ((64, False), (128, False), (128, True)):
        cfg = configs.bwd_config(dim, dim, "bfloat16", "causal", False, varlen)
        assert cfg.manual_ws and cfg.producer_regs, (dim, varlen, cfg)
    for dim, softcap in ((256, False), (128, True)):
        cfg = configs.bwd_config(dim, dim, "bfloat16", "causal", softcap)
        assert not cfg.manual_ws and not cfg.producer_regs, (dim, softcap, cfg)


def test_bwd_flags_switch_puts_bwd_wide_on_its_rows_only(monkeypatch):
    """``FLASHTILE_BWD_FLAGS=replicate_scores=1`` runs the d = 256 kernel of ``bwd_wide.py`` where
    it applies (d = d_v = 256 without softcap, dense and packed) and nowhere else."""
    assert configs._env_flags("FLASHTILE_BWD_FLAGS", "replicate_scores=1") == {"replicate_scores": True}
    monkeypatch.setitem(configs.overrides, "bwd_flags", {"replicate_scores": True})
    for varlen in (False, True):
        cfg = configs.bwd_config(256, 256, "bfloat16", "causal", False, varlen)
        assert cfg.replicate_scores and cfg.builder == "bwd_wide.attention_bwd_dkdv_wide", cfg
    for dim, dim_v, softcap in ((256, 256, True), (192, 128, False), (128, 128, False), (64, 64, False)):
        cfg = configs.bwd_config(dim, dim_v, "bfloat16", "causal", softcap)
        assert not cfg.replicate_scores, (dim, dim_v, softcap, cfg)


def test_sharing_sms_drops_persistent_schedules_only():
    """``configs.sharing_sms`` (ring attention's steps, beside NCCL's kernels): the persistent
    d=128 forward and d=64 short forward become one tile per CTA, the persistent d <= 96 dK/dV
    kernel a CTA per key block; every other row is returned as it is."""
    for dim, short in ((128, False), (64, True)):
        cfg = configs.fwd_config(dim, dim, "bfloat16", "causal", False, short)
        assert cfg.tiles_per_cta != 1, "the table's persistent rows changed: update this test"
        assert configs.sharing_sms(cfg) == dataclasses.replace(cfg, tiles_per_cta=1)
    for dim in (64, 256):
        cfg = configs.fwd_config(dim, dim, "bfloat16", "causal", False, False)
        assert configs.sharing_sms(cfg) is cfg
    bwd = configs.bwd_config(64, 64, "bfloat16", "causal", False, False)
    assert bwd.persistent and configs.sharing_sms(bwd) == dataclasses.replace(bwd, persistent=False)
    bwd128 = configs.bwd_config(128, 128, "bfloat16", "causal", False, False)
    assert not bwd128.persistent and configs.sharing_sms(bwd128) is bwd128
