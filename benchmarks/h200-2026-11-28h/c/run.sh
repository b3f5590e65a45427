#!/usr/bin/env bash
# Twenty-fourth session, call c: warp stalls of the d = 64 1k forward, ours (short row:
# persistent 128-row pairs) against cuDNN's.  $1 = out.
set -u
o=$1; mkdir -p "$o"
for c in "" "--causal"; do
  n=d64_1k${c:+_causal}
  timeout 150 ncu --profile-from-start off --kernel-name regex:'main|sdpa|fmha|attn' --set full --import-source yes -o /tmp/$n python3 benchmarks/ncu_dense.py --headdim 64 --seqlen 1024 $c > "$o/$n.log" 2>&1
  ncu -i /tmp/$n.ncu-rep --page source --csv --print-source sass > /tmp/$n.csv 2>/dev/null
  ncu -i /tmp/$n.ncu-rep --page details > "$o/${n}_details.txt" 2>&1
  { python3 benchmarks/ncu_stalls.py /tmp/$n.csv
    python3 benchmarks/ncu_stalls.py /tmp/$n.csv 0 --top 60
    python3 benchmarks/ncu_stalls.py /tmp/$n.csv 0 --by-count
    python3 benchmarks/ncu_stalls.py /tmp/$n.csv 0 --buckets 100 --warps 1584
    python3 benchmarks/ncu_stalls.py /tmp/$n.csv 1 --top 40
    python3 benchmarks/ncu_stalls.py /tmp/$n.csv 1 --by-count; } > "$o/${n}_stalls.txt" 2>&1
  [ -n "$c" ] || xz -T4 -c /tmp/$n.csv > "$o/$n.csv.xz"
done
ls -la "$o"
