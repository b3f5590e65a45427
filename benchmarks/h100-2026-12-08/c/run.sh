#!/usr/bin/env bash
# Call c (staged in the forty-second session; run it after call b if bwd_wide passed and won):
# the whole GPU suite and the dense bench with the developer switch FLASHTILE_BWD_FLAGS=
# replicate_scores=1, which runs kernels/bwd_wide.py on every d = d_v = 256 backward without
# softcap (dense, packed, deterministic), ~6 minutes.  Passing and faster: the table takes it
# (configs._bwd_row) with the same TIR, so this call's suite result carries over.
#
#   bash benchmarks/h100-2026-12-08/c/run.sh $OUT
set -uo pipefail
export FLASHTILE_BWD_FLAGS=replicate_scores=1
# The suite grew by the forty-second and forty-third sessions' GPU cases: more time for it, less
# for the host profile, under the tool's 600 s.
export TESTS_S=${TESTS_S:-270} TOTAL_S=${TOTAL_S:-440} HOST_S=${HOST_S:-60}
bash benchmarks/h100-2026-12-07f/a/run.sh "$1"
