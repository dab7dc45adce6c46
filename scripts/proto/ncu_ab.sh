#!/usr/bin/env bash
# Nsight Compute on the A/B bench's kernels: stall reasons, tensor pipe, L2/DRAM breakdown.
#   bash scripts/proto/ncu_ab.sh H,S variant[,variant] kernel_name
set -u
case=$1 variants=$2 kernel=$3
/usr/local/cuda/bin/ncu --kernel-name "$kernel" --launch-skip 2 --launch-count 1 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed \
  python scripts/proto/ab_gluon.py --case "$case" --variants "$variants" 2>&1 \
  | grep -E "^\s+(gpu__|dram__|lts__|sm__pipe_tensor_cycles|smsp__)|expert_mlp" | awk '$NF+0 > 0.05 || /expert/' | sed -E "s/smsp__average_warps_issue_stalled_(.*)_per_issue_active.ratio/stall \1/"
