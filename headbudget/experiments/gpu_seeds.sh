#!/usr/bin/env bash
# One call on a lent GPU (docs/gpu.md, "What the next lent GPU is for", items 1-2): seeds of the kept whole-model
# recipe (--exits 3) and of the attention-only run with the same recipe, all four runs at once on the one GPU
# (eight at a time took 2-6 minutes each on an H100, session 17). Each run's small files go to $OUT as one
# tarball the moment its sweep is written, so a call cut off at its limit still returns every run that finished;
# weights stay there (a sweep is enough: experiments/standin.py times its plans here, and
# experiments/scope_retime.py places the two scopes by latency measured on this CPU).
#
#   here:   python -m headbudget.experiments.gpu_transfer carry --out .carry
#   device: run(command="bash experiments/gpu_seeds.sh 13 21", carry=[".carry"], timeout_s=560)
#   here:   tar xzf /work/.device/.../m13.tar.gz -C runs/ ... then scope_retime --pair 13 runs/m13/sweep.json runs/a13/sweep.json
set -u
SEEDS=("${@:-13}")
[ -n "${OUT:-}" ] || { echo "OUT is not set (this script runs through the device tool)"; exit 2; }
source .carry/setup.sh
# HB_RECIPE, HB_EXITS, HB_DEVICE and HB_EVERY are for a smoke run of this script on a CPU (tiny base, synthetic
# task; tests/experiments/test_gpu_seeds.py), so that a lent GPU's minutes are not spent finding its bugs.
KEPT="--base minilm --data ag_news --recipe full --set length_buckets=true --set hard_teacher=dense"
KEPT+=" --set hard_epochs=10 --set sandwich=true --set fused_sandwich=true"
read -r -a RECIPE <<< "${HB_RECIPE:-$KEPT}"
EXITS=${HB_EXITS:-3}
DEVICE=${HB_DEVICE:-cuda}

one() {  # NAME SEED SCOPE-ARGS...: train, then pack the run's small files for the trip back
  local name=$1 seed=$2
  shift 2
  hb train "${RECIPE[@]}" --device "$DEVICE" --seed "$seed" "$@" --out "runs/$name" > "runs/$name.log" 2>&1
  local rc=$?
  echo "$(date +%T) $name exit $rc" >> "$OUT/progress.log"
  tar czf "$OUT/$name.tar.gz" -C runs "$name.log" \
    $(cd runs && ls -d "$name"/{sweep.json,config.json,run.json,stages/*/done.json,pareto.png} 2>/dev/null)
}

mkdir -p runs
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/progress.log" 2>&1 || true
for seed in "${SEEDS[@]}"; do
  one "m$seed" "$seed" --scope model --exits "$EXITS" &
  one "a$seed" "$seed" --scope attention &
done
while sleep "${HB_EVERY:-30}"; do  # a line per half minute: how far each run got, for a call that is cut off
  line="$(date +%T)"
  for f in runs/*.log; do line+=" $(basename "$f" .log):$(grep -o 'stage [a-z]*' "$f" | tail -1 | cut -c7-)"; done
  echo "$line" >> "$OUT/progress.log"
  jobs -r | grep -q . || break
done
wait
