#!/usr/bin/env bash
# The full default grid of `flashtile bench` on one GPU, written into DIR:
#
#   bash benchmarks/run_gpu_bench.sh DIR [extra bench flags]
#
# DIR gets <device>-<date>.json, .csv, .png, .md and .log (the console output).  Expects
# PYTHONPATH to hold flashtile and TileLang already; python is python3.
#
# Default grid: bf16, headdim 64/128/256 (nheads*headdim = 2048), seqlen 512..16k at 16k tokens,
# causal and not, MHA plus GQA 4:1 at headdim 128 = 48 cases; fwd, bwd, fwd+bwd; flashtile,
# SDPA cuDNN/flash/efficient, FlexAttention (+ flash-attn if installed) = 720 timings (864).
# Estimate on an H100: ~1.5 min of timing, ~1-1.5 min of flashtile compiles, ~3 min of
# FlexAttention compiles (8 structures, a second compile for batch 1), ~0.5 min start-up and
# reference checks: 6-7 minutes.  --time-limit keeps it inside 8: whatever would start later
# is reported as "skipped" and every file is still written.
set -uo pipefail
dir=${1:?usage: bash benchmarks/run_gpu_bench.sh DIR [extra flashtile bench flags]}
shift
mkdir -p "$dir"
gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo unknown)
tag=$(printf '%s-%s' "$gpu" "$(date -u +%Y%m%d)" | tr -c 'A-Za-z0-9._-' '-')
export PYTHONUNBUFFERED=1
python3 -m flashtile.bench --time-limit "${FLASHTILE_BENCH_TIME_LIMIT:-450}" \
  --json "$dir/$tag.json" --csv "$dir/$tag.csv" --plot "$dir/$tag.png" --markdown "$dir/$tag.md" \
  "$@" 2>&1 | tee "$dir/$tag.log"
exit "${PIPESTATUS[0]}"
