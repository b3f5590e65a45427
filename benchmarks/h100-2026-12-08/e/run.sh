#!/usr/bin/env bash
# Call e (staged in the forty-third session, no device then), ~3 minutes: chunked attention
# (attention_chunk, Llama 4's 8192-key chunks) against FlexAttention with the chunk in its mask
# (and flash-attn 3 if installed), bf16 d = 128, GQA 4:1 and MHA, causal, 16k and 32k tokens,
# forward and backward, two rounds; then the same grid unchunked for flashtile's own ratio.
# Prediction (written before any run): flashtile's chunked calls take the dense kernels on
# equal chunks (16k / 32k are multiples of 8192: kernels.equal_lengths), so they run at its
# dense 8k causal rate, 1.3-2x FlexAttention's chunked time.
#
#   bash benchmarks/h100-2026-12-08/e/run.sh $OUT
set -uo pipefail
OUTDIR=$1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
bash benchmarks/kernel_cache.sh unpack
grid="--headdim 128 --seqlen 16k 32k --total-tokens 32k --nheads-kv 1:1 4:1 --causal true --mode fwd bwd --rounds 2"
timeout ${CHUNK_S:-120} python3 -m flashtile.bench $grid --chunk 8k --backends flashtile flex flash-attn \
  --time-limit $(( ${CHUNK_S:-120} - 10 )) --json "$OUTDIR/chunked.json" --markdown "$OUTDIR/chunked.md" > "$OUTDIR/chunked.log" 2>&1
echo "chunked bench rc=$?"; tail -n 30 "$OUTDIR/chunked.log"
timeout ${DENSE_S:-60} python3 -m flashtile.bench $grid --backends flashtile --time-limit $(( ${DENSE_S:-60} - 10 )) \
  --json "$OUTDIR/unchunked.json" --markdown "$OUTDIR/unchunked.md" > "$OUTDIR/unchunked.log" 2>&1
echo "unchunked bench rc=$?"; tail -n 20 "$OUTDIR/unchunked.log"
