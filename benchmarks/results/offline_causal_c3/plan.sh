# usage (from the repository root): bash benchmarks/results/offline_causal_c3/plan.sh ROOT TAG  (PYTHONPATH=ROOT; writes $OUT/TAG_*.json, OUT default /tmp/c3)
ROOT=$1; TAG=$2
D=$(cd "$(dirname "$0")" && pwd); mkdir -p ${OUT:-/tmp/c3}
C3T='{"block_m":192,"regs":"160/24","pingpong":true}'
C3F='{"block_m":192,"regs":"160/24","pingpong":false}'
C3TD='{"block_m":192,"regs":"160/24","pingpong":true,"diag_first":true}'
G='{}'
G64='{"pingpong":false}'
args=()
for v in fwd_d64_fp16 fwd_d64_bf16 fwd_causal_d64_fp16 fwd_causal_d64_bf16; do
  for c in "$C3T" "$C3F"; do args+=("$v@$c" "$v@$c@v"); done
done
args+=("fwd_causal_d64_bf16@$C3TD" "fwd_causal_d64_bf16@$C3TD@v")
for v in fwd_d64_bf16 fwd_dropout_d64_bf16 fwd_causal_d64_fp16 fwd_causal_d64_bf16 fwd_causal_dropout_d64_bf16; do
  args+=("$v@own" "$v@own@v" "$v@$G")
done
PYTHONPATH=$ROOT python $D/off.py specs/gpt2.yaml ${OUT:-/tmp/c3}/${TAG}_gpt2.json "${args[@]}" > ${OUT:-/tmp/c3}/${TAG}_gpt2.log 2>&1
args=()
for v in fwd_d128_bf16 fwd_causal_d128_bf16 fwd_window_d128_bf16 fwd_causal_d128_fp16; do
  args+=("$v@own" "$v@own@v")
done
PYTHONPATH=$ROOT python $D/off.py specs/llama.yaml ${OUT:-/tmp/c3}/${TAG}_llama.json "${args[@]}" > ${OUT:-/tmp/c3}/${TAG}_llama.log 2>&1
args=()
for v in fwd_causal_d64_bf16 fwd_causal_softcap_d64_bf16 fwd_causal_alibi_d64_bf16 fwd_causal_document_d64_bf16 fwd_prefix_lm_d64_bf16 fwd_window_sinks_d64_bf16 fwd_causal_sink_logits_d64_bf16 fwd_causal_softcap_key_padding_d64_bf16 fwd_causal_document_d128_bf16 fwd_window_sinks_d128_bf16; do
  args+=("$v@own" "$v@own@v")
done
args+=("fwd_causal_d64_bf16@$C3T")
PYTHONPATH=$ROOT python $D/off.py specs/mods.yaml ${OUT:-/tmp/c3}/${TAG}_mods.json "${args[@]}" > ${OUT:-/tmp/c3}/${TAG}_mods.log 2>&1
# d=64 sliding window (no shipped spec has one)
args=()
for v in fwd_window_d64_bf16; do
  args+=("$v@$C3T" "$v@$C3T@v" "$v@$C3F" "$v@own" "$v@own@v")
done
PYTHONPATH=$ROOT python $D/off.py $D/win64.yaml ${OUT:-/tmp/c3}/${TAG}_win64.json "${args[@]}" > ${OUT:-/tmp/c3}/${TAG}_win64.log 2>&1
echo done
