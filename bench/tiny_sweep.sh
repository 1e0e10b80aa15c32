#!/usr/bin/env bash
# Tuning sweep for the tiny GRPO job: bench/tiny_grpo_baseline.py over a grid of SFT lengths,
# learning rates and warmups, each run pinned to its own 2 cores (the demo machine's size) so
# that several run side by side on a bigger box without disturbing each other.
#
#   bash bench/tiny_sweep.sh OUT_DIR STEPS "sft:lr:warmup ..."
#
# Writes OUT_DIR/<sft>_<lr>_<warmup>.log (one row per step and the summary) per run.
set -euo pipefail
out=$1; steps=$2; grid=$3
mkdir -p "$out"
cores=$(nproc); slots=$((cores / 2))
export PYTHONPATH=operator:trainer_image OMP_NUM_THREADS=2
# Builds first (one per SFT length), in parallel.
i=0
for sft in $(tr ' ' '\n' <<<"$grid" | cut -d: -f1 | sort -u); do
  taskset -c $((2 * i)),$((2 * i + 1)) python3 -c "
from pathlib import Path
from kuberl_trainer.tiny.build import BuildConfig, build
build(Path('$out/tiny-$sft'), BuildConfig(sft_steps=$sft))" >"$out/build-$sft.log" 2>&1 &
  i=$(((i + 1) % slots))
done
wait
i=0
for cfg in $grid; do
  IFS=: read -r sft lr warmup <<<"$cfg"
  taskset -c $((2 * i)),$((2 * i + 1)) python3 bench/tiny_grpo_baseline.py --out "$out/tiny-$sft" \
    --sft-steps "$sft" --lr "$lr" --warmup "$warmup" --steps "$steps" \
    >"$out/${sft}_${lr}_${warmup}.log" 2>&1 &
  i=$((i + 1))
  if [ "$i" -ge "$slots" ]; then wait; i=0; fi
done
wait
tail -n 4 "$out"/*_*.log
