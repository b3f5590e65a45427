#!/usr/bin/env bash
# Call q (thirty-sixth session): why prediction 8 lost.  Nsight Compute's full set plus L2
# reduction counters on the d = 256 backward (bf16, 4k, full, 8 heads x 4 batch) with the
# table's kernel and with the two-stage `dq_regs` candidate (`ncu_dense.py --config`), so the
# dQ reduction's cost shows as L2 / LSU throughput or as issue slots.
set -uo pipefail
OUTDIR=$1; repo=$PWD
bash benchmarks/kernel_cache.sh unpack > /dev/null
red=lts__t_requests_op_red.sum,lts__t_sectors_op_red.sum,l1tex__t_requests_pipe_lsu_mem_global_op_red.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__d_sectors_fill_sysmem.sum,smsp__inst_executed_op_global_red.sum
for v in ${VARIANTS:-table: regs2:--config=bwd:64,64,2,256,1,0,0,0,1}; do  # name:flags
  name=${v%%:*}; flags=${v#*:}
  (cd /tmp && timeout ${NCU_S:-100} ncu --clock-control none --profile-from-start off --kernel-name regex:'main' \
    --set full --metrics "$red" -o "$OUTDIR/$name" python3 "$repo/benchmarks/ncu_dense.py" --backward --headdim 256 --seqlen 4096 $flags \
    > "$OUTDIR/$name.log" 2>&1; echo "ncu $name rc=$?" >> "$OUTDIR/$name.log")
  ncu -i "$OUTDIR/$name.ncu-rep" --page details --csv 2>/dev/null | xz > "$OUTDIR/$name.details.csv.xz"
  ncu -i "$OUTDIR/$name.ncu-rep" --page raw --csv 2>/dev/null | xz > "$OUTDIR/$name.raw.csv.xz"
  tail -n 2 "$OUTDIR/$name.log"
  ncu -i "$OUTDIR/$name.ncu-rep" --page details 2>/dev/null | grep -E "^  [a-z_]|Duration|Issue Slots Busy|Compute \(SM\) Throughput|L2 Cache Throughput|Warp Cycles Per Issued|Mem Pipes Busy" | head -24
  ncu -i "$OUTDIR/$name.ncu-rep" --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin)); h = rows[0]
for r in rows[2:]:
    print(r[h.index('Kernel Name')][:12], r[h.index('Grid Size')], *(f'{m}={r[h.index(m)]}' for m in h if 'op_red' in m or m == 'gpu__time_duration.sum'))"
  rm -f "$OUTDIR/$name.ncu-rep"
done
ls -la "$OUTDIR"
# Issue 19 item 5's figure, not re-measured since the twenty-seventh session: the deterministic
# backward's time over the default's, same process.
timeout ${DET_S:-100} python3 benchmarks/det_ratio.py --headdim 64 128 256 --seqlen 4096 16384 --rounds 2 > "$OUTDIR/det_ratio.txt" 2>&1
echo "det_ratio rc=$?"; tail -n 30 "$OUTDIR/det_ratio.txt"
