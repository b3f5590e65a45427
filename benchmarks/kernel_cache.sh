#!/usr/bin/env bash
# Carry compiled kernels to the GPU machine instead of rebuilding them there.
#
# TileLang's disk cache is keyed by the kernel's TIR, target, pass configs, TileLang version
# and CPU platform, never by the GPU: kernels built on the CPU machine (nvcc 13.0, sm_90a) are
# hits on the device, and an entry that fails to load is treated as a miss (rebuilt).  Each
# fresh device machine would otherwise spend 3-4 of its 30 minutes rebuilding (~20 s a kernel).
# Only the host-platform entries travel: each executable.so embeds its cubin, so nvcc's
# separate cubin cache (cuda-binaries/) is not needed there.  `fill` builds what the device sessions' GPU suites and benchmarks run (dense, packed, decode);
# ~10 MB packed for ~150 kernels.
#
#   bash benchmarks/kernel_cache.sh fill [JOBS] [dense|varlen|fp8|decode ...]  # build into the cache
#   bash benchmarks/kernel_cache.sh mark     # before a fill: every entry looks unused ...
#   bash benchmarks/kernel_cache.sh prune    # ... after it: drop the entries the fill did not load
#   bash benchmarks/kernel_cache.sh pack     # here: local cache -> .carry/kernels.tar.xz
#   bash benchmarks/kernel_cache.sh unpack   # device: .carry/kernels.tar.xz -> $TILELANG_CACHE_DIR
#   bash benchmarks/kernel_cache.sh pack-used  # after mark + an experiment's builds: carry only those
#   bash benchmarks/kernel_cache.sh restore    # ... and the full pack back afterwards
set -euo pipefail
# An entry some process read since `mark` (see mark|prune): a file whose atime is after 2001.
read_since_mark() { [ -n "$(find "$1" -type f -newerat 2001-01-01 | head -1)" ]; }
ver=$(python3 -c "import tilelang; print(tilelang.__version__.split('+')[0])" 2>/dev/null || echo 0.1.15)
case ${1:-} in
  fill)
    # fill [JOBS] [dense] [varlen] [decode]: the groups to build (default all three).  With
    # FILL_S=<seconds>, a deadline: the build runs in its own process group, killed whole then
    # (`timeout` alone leaves the compile workers running on every core while a later step
    # times kernels: NOTES, 2026-11-23 second session).
    if [ -n "${FILL_S:-}" ]; then
      FILL_S= setsid bash "$0" "$@" &
      pid=$!
      ( sleep "$FILL_S"; kill -KILL -- -"$pid" ) > /dev/null 2>&1 &  # not holding our stdout open
      watch=$!
      wait "$pid"; rc=$?
      kill "$watch" 2>/dev/null
      exit "$rc"
    fi
    pc="python3 -m flashtile.kernels.precompile --jobs ${2:-2}"
    groups=${*:3}; groups=${groups:-dense varlen fp8 decode}
    stamp=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}/$ver/.fill_groups  # what ran since `mark` (`prune` checks)
    echo "$groups" >> "$stamp"
    for g in $groups; do
      case $g in
        dense)  # tests/test_gpu_kernels.py, test_gpu_integration.py, test_degenerate.py, flashtile bench
          $pc --headdim 64 96 128 192/128 256 40 200/100 --features plain --passes fwd bwd bwd-det bwd-lse
          $pc --headdim 64 128 --dtype bfloat16 --features sinks softcap both --passes fwd bwd bwd-det bwd-lse
          $pc --headdim 96 --dtype float16 --features sinks --passes fwd bwd-lse
          # ring attention's steps (benchmarks/ring_gpu.py, flashtile cp): no persistent grids
          $pc --headdim 64 128 --dtype bfloat16 --features plain softcap --passes fwd-ring bwd-ring;;
        varlen)  # tests/test_gpu_varlen.py, flashtile bench --varlen
          $pc --headdim 64 128 192/128 256 --dtype bfloat16 --features plain --passes vfwd vbwd vbwd-lse vbwd-det
          $pc --headdim 128 --dtype bfloat16 --features sinks softcap both --passes vfwd vbwd vbwd-lse vbwd-det
          $pc --headdim 128 40 --dtype float16 --features plain --passes vfwd vbwd
          $pc --headdim 96 --dtype bfloat16 --features sinks --passes vfwd vbwd-lse
          # packed ring attention's steps (no persistent dK/dV at d <= 96)
          $pc --headdim 64 --dtype bfloat16 --features plain --passes vbwd-ring;;
        fp8)  # tests/test_gpu_fp8.py, flashtile bench's flashtile-fp8 (--dtype: the output's)
          $pc --headdim 64 128 192/128 256 40 80/72 --dtype bfloat16 --features plain --passes fwd8
          $pc --headdim 128 --dtype bfloat16 float16 --features plain sinks softcap both --passes fwd8
          $pc --headdim 64 128 256 --dtype bfloat16 --features plain --passes vfwd8
          # tests/test_gpu_fp8.py's d = 256 cases with every feature and an fp16 output
          $pc --headdim 256 --dtype bfloat16 float16 --features plain both --passes fwd8
          $pc --headdim 128 --dtype bfloat16 --features both --passes vfwd8;;
        decode)  # tests/test_gpu_kvcache.py, benchmarks/decode_bench.py
          $pc --headdim 64 128 192/128 --features plain sinks softcap both --passes decode
          $pc --headdim 64 128 192/128 256 --features plain both --passes decode-fp8
          $pc --headdim 64/128 --dtype bfloat16 --features plain --passes decode-fp8;;
        *) echo "unknown group $g (dense, varlen, fp8, decode)" >&2; exit 2;;
      esac
    done;;
  mark|prune)
    # Stale entries (kernels whose TIR changed) are never loaded again but would travel.  The
    # disk is mounted relatime: a read updates a file's atime only when it is not newer than its
    # mtime, so `mark` sets every atime far back and `prune` removes the entries that no process
    # read since (run the fills, and sanitize_cases.py --precompile, in between).
    dir=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}/$ver/linux-x86_64/kernels
    stamp=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}/$ver/.fill_groups
    if [ "$1" = mark ]; then
      : > "$stamp"
      find "$dir" -type f -exec touch -a -d 2000-01-01 {} +
      echo "marked $(ls "$dir" | wc -l) entries"
    else
      # A fill of some groups only leaves the others unread: pruning then would delete them.
      for g in dense varlen fp8 decode; do
        if ! grep -qw "$g" "$stamp" 2>/dev/null; then
          echo "prune: no '$g' fill since mark (fill every group first, or the others' kernels are deleted)" >&2
          exit 1
        fi
      done
      n=0
      for e in "$dir"/*/; do
        if ! read_since_mark "$e"; then rm -rf "$e"; n=$((n + 1)); fi
      done
      echo "pruned $n entries, $(ls "$dir" | wc -l) left"
    fi;;
  pack)
    # xz -9e: the entries share most of their bytes (TileLang's runtime, cubin headers), which a
    # 64 MB dictionary finds across files: 9.8 -> 5.0 MB for 358 kernels (-6: 8 MB dictionary),
    # ~1 minute here.  The device tool's carry limit is 64 MiB with the TileLang bundle.
    src=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}/$ver
    tar -C "$src" -cf - linux-x86_64 | xz -T2 -9e > .carry/kernels.tar.xz
    echo "packed $(ls "$src/linux-x86_64/kernels" | wc -l) kernels: $(du -h .carry/kernels.tar.xz | cut -f1)";;
  pack-used|restore)
    # An experiment's device call carries only the kernels it reads (the full pack plus a
    # dozen new entries can pass the device tool's 64 MiB carry limit): `mark`, build or load
    # what the call runs (tune.py's prebuild, a fill under FLASHTILE_FWD_FLAGS, the test groups'
    # precompile), then `pack-used` moves the full pack aside to $FULL_PACK (outside .carry,
    # so it does not travel; kept if already there) and packs the entries read since `mark`.
    # `restore` puts the full pack back (it still matches a tree whose kernels did not change).
    full=${FULL_PACK:-/tmp/flashtile-kernels-full.tar.xz}
    if [ "$1" = restore ]; then
      mv "$full" .carry/kernels.tar.xz && echo "restored $full"
    else
      src=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}/$ver
      [ -f "$full" ] || mv .carry/kernels.tar.xz "$full"
      (cd "$src" && for e in linux-x86_64/kernels/*/; do
         if read_since_mark "$e"; then echo "${e%/}"; fi; done) > "$full.list"
      tar -C "$src" -cf - -T "$full.list" | xz -T2 -9e > .carry/kernels.tar.xz
      echo "packed $(wc -l < "$full.list") kernels read since mark: $(du -h .carry/kernels.tar.xz | cut -f1) (full pack: $full)"
    fi;;
  unpack)
    dst=${TILELANG_CACHE_DIR:?}/$ver
    mkdir -p "$dst"
    if [ -f .carry/kernels.tar.xz ]; then
      xz -dc .carry/kernels.tar.xz | tar -C "$dst" -xf -
      echo "unpacked $(ls "$dst/linux-x86_64/kernels" | wc -l) kernels into $dst"
    fi;;
  *) echo "usage: $0 fill|mark|prune|pack|pack-used|restore|unpack" >&2; exit 2;;
esac; exit  # read to here before running: an edit while a fill runs cannot change what it runs next
