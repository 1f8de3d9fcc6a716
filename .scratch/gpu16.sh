#!/bin/bash
# issue 16 helper (branch h16): the Gluon backward's program order for block-mask variants.
# Run from the repo root on the H100: PYTHONPATH=$PWD bash .scratch/gpu16.sh (writes under $OUT)
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out16}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
# 1. correctness on the GPU: the Gluon backward of every mask-mod variant against float64
#    (they now walk PROG_ORDER), and the order's CPU test
timeout 110 python -m pytest -m gpu -x -q -n 8 tests/test_gluon_bwd_mods.py \
  -k "document or prefix or window or key_padding" 2>&1 | tail -5 | tee $OUT/tests.txt
TRITON_INTERPRET=1 timeout 60 python -m pytest -x -q tests/test_mods.py -k program_order 2>&1 | tail -2 | tee -a $OUT/tests.txt
# 2. A/B: head-major (q=0, the old order) vs longest-first (q=1.0 default, q=0.5), backward
#    ms interleaved in one process, then Flex's backward on the same inputs
timeout 170 python benchmarks/bwd_order_ab.py --rounds 3 --flex-budget-s 110 \
  --json $OUT/bwd_order_ab.json 2>&1 | grep -v Warning | tee $OUT/ab.txt
