#!/usr/bin/env bash
# Twenty-fourth session, call b: where the short-sequence forward stands (issue 19 item 2) and
# which tiles serve it.  Run from the repo root on the device after the usual prefix; $1 = out.
set -u
o=$1; mkdir -p "$o"
t() { timeout "$1" python3 benchmarks/tune.py fwd "${@:2}" --repeat 2 2>&1 | grep -E "TUNE|rror" >> "$o/tune.txt"; }
t 130 --headdim 64 --seqlen 512 1024 2048 --configs 128,128,2,256,1,1,0 128,128,2,256,1,1,0,1 128,64,2,256,1,1,0 192,128,2,384,1,1,1 128,128,2,256,1,1,2 192,128,2,384,1,1,0
t 110 --headdim 128 --seqlen 512 1024 2048 --configs 128,128,2,256,1,1,0 128,128,2,256,1,1,0,1 128,64,2,256,1,1,0 128,128,2,256,1,1,1 128,96,2,256,1,1,0
t 110 --headdim 256 --seqlen 512 1024 2048 --configs 128,80,2,256,1,1,1,1 128,64,2,256,1,1,1,1 128,80,2,256,1,1,1,0 128,48,2,256,1,1,1,1
grep -c TUNE "$o/tune.txt"
timeout 60 python3 benchmarks/tile_cost.py --headdim 64 --seqlen-q 1024 --batch 16 --heads 32 --seqlen-k 256 512 768 1024 > "$o/tile_cost_d64.txt" 2>&1
timeout 60 python3 benchmarks/tile_cost.py --headdim 128 --seqlen-q 1024 --batch 16 --heads 16 --seqlen-k 256 512 1024 2048 4096 > "$o/tile_cost_d128.txt" 2>&1
grep FIT "$o"/tile_cost_*.txt
for c in "" "--causal"; do
  timeout 90 ncu --profile-from-start off --kernel-name regex:'main|sdpa|fmha|attn' --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis python3 benchmarks/ncu_dense.py --headdim 64 --seqlen 1024 $c > "$o/ncu_d64_1k${c:+_causal}.txt" 2>&1
done
grep -E "Duration|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|No Eligible|Registers Per|Grid Size" "$o"/ncu_d64_1k.txt | head -30
