#!/usr/bin/env bash
# Call v (written in the thirty-eighth session; not run there: the device budget went to refused
# starts), ~7 minutes on an H100 with the kernel pack carried:
# 0. The FP8 d = 64 short row (128 x 128 persistent pairs, built by configs.fp8_fwd_config, not
#    yet selected: configs.FP8_SHORT_SEQLEN): the FP8 d = 64 GPU tests under it and under the
#    192 x 128 row (tune.py --fp8 --check), then both timed at 1k / 2k.  If they pass, add
#    64: 1024 to FP8_SHORT_SEQLEN (1k measured faster: NOTES, thirty-eighth session).
# 1. Prediction 11 (NOTES): FwdConfig.softmax_turns (the pingpong turns around each block's
#    softmax (1) or its exponentials (2, as cuDNN's forward) instead of the GEMM issues) against
#    the table's rows, with
#    tune.py --check first: d = 64 short row (1k; also without turns), d = 128 pairs (1k / 4k),
#    d = 64 long row (4k / 16k); two interleaved rounds.
# 2. The forward bench at 1k / 4k, d = 64 / 128, bf16 and FP8 against cuDNN in the same run.
# Each step under its own deadline; the lines worth reading go to summary.txt.
#
#   bash benchmarks/h100-2026-12-07d/v/run.sh $OUT
set -uo pipefail
OUTDIR=$1; S=$OUTDIR/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
bash benchmarks/kernel_cache.sh unpack > /dev/null
tune() {  # tune NAME DEADLINE ARGS...: one tune.py run, its TUNE / CHECK lines into the summary
  name=$1; deadline=$2; shift 2
  timeout "$deadline" python3 benchmarks/tune.py fwd --repeat 2 --jobs 12 "$@" > "$OUTDIR/tune_$name.txt" 2>&1
  echo "tune $name rc=$?" | tee -a "$S"; grep -E "^TUNE|^CHECK|^FAIL|rror|passed|failed" "$OUTDIR/tune_$name.txt" | cut -c1-150 | tee -a "$S"
}
tune fp8d64 ${FP8_S:-120} --fp8 --headdim 64 --seqlen 1024 2048 --check --configs 192,128,2,384,1,1,1,0,0,0 128,128,2,256,1,1,0,0,0,0,1
c=128,128,2,256,1,1,0,0,1,0,1  # d = 64 short row, causal (GEMM turns); full attention runs it without turns
tune d64short ${D64S_S:-100} --headdim 64 --seqlen 1024 --check --configs $c $c,1 $c,2 128,128,2,256,1,0,0,0,1,0,1
c=128,128,2,256,1,1,0,0,0,0,1  # d = 128 pairs
tune d128 ${D128_S:-100} --headdim 128 --seqlen 1024 4096 --check --configs $c $c,1 $c,2
c=192,128,2,384,1,1,1,0,1,0,1  # d = 64 long row
tune d64long ${D64L_S:-90} --headdim 64 --seqlen 4096 16384 --configs $c $c,1 $c,2
timeout ${BENCH_S:-120} python3 -m flashtile.bench --headdim 64 128 --seqlen 1k 4k --mode fwd --rounds 2 \
  --backends flashtile flashtile-fp8 cudnn --time-limit $(( ${BENCH_S:-120} - 15 )) > "$OUTDIR/bench.md" 2>&1
echo "bench rc=$?" | tee -a "$S"; tail -n 40 "$OUTDIR/bench.md"
