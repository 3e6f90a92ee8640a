#!/usr/bin/env bash
# The draft trainings behind bench/RESULTS.md "Draft models", on this 2-core CPU, two runs at a time with
# one thread each. The corpus is specdec/data/corpus/smollm2-bf16 (its manifest holds the command that made
# it); the target's hidden states are computed once into $SPECDEC_CACHE/features (outside the repository).
#   bash bench/distill_runs.sh main     # the shipped drafts: both kinds on the whole corpus
#   bash bench/distill_runs.sh shapes   # draft shapes and the data-size curve, on seeded subsets
#   bash bench/distill_runs.sh gpu      # the same on one GPU, nine runs at once for MINUTES (5.5) each: the
#                                       # first GPU-trained smollm2-eagle is its "eagle" (H100, bench/RESULTS.md)
#   bash bench/distill_runs.sh gpu-init # the shipped smollm2-eagle: "eagle" above, gone on with --init (H100)
# Drafts land in ${RUNS:-/tmp/distill_runs}/NAME, their logs in .../w_NAME/log.jsonl.
set -euo pipefail
R=${RUNS:-/tmp/distill_runs}
C=specdec/data/corpus/smollm2-bf16
F=${SPECDEC_CACHE:-$HOME/.cache/specdec}/features/smollm2-bf16
common="--target smollm2 --corpus $C --feature-cache $F --max-tokens 4096 --steps 100000 --eval-every 200 \
  --eval-positions 20000 --held-out 0.03 --seed 0 --threads 1"
run() { name=$1; shift; OMP_NUM_THREADS=1 python -m specdec distill $common --out $R/$name --work $R/w_$name "$@" \
  > $R/$name.log 2>&1; }
mkdir -p $R
case ${1:-main} in
  features)  # the one prefill pass (both cores), which every run below then reads
    OMP_NUM_THREADS=2 python -m specdec distill ${common/--threads 1/--threads 2} --out $R/features --work $R/w_features \
      --arch eagle --steps 0 --eval-every 0 > $R/features.log 2>&1 ;;
  main)
    run eagle --arch eagle --layers 29 --lr 1e-3 --train-minutes ${MINUTES:-20} --patience 5 &
    run layers --arch layers --layers 0,29 --lr 5e-4 --train-minutes ${MINUTES:-20} --patience 5 &
    wait ;;
  shapes)  # the held-out examples' features first, so the paired runs below do not both write them
    run held-out-features --arch eagle --steps 0 --eval-every 0 --threads 2
    S="--max-positions 250000 --train-minutes ${MINUTES:-4} --patience 3 --lr 1e-3 --arch eagle"
    run eagle-250k $S --layers 29 & run eagle-250k-unroll2 $S --layers 29 --unroll 2 & wait
    run eagle-250k-2layer $S --layers 28,29 & run eagle-250k-v16k $S --layers 29 --draft-vocab 16384 & wait
    run eagle-250k-topk8 $S --layers 29 --labels topk:8 & run eagle-60k ${S/250000/60000} --layers 29 & wait ;;
  gpu)  # no feature cache: the teacher runs on the GPU at every step; one torch thread per run (16 cores)
    G="--target smollm2 --corpus $C --device cuda --threads 1 --max-tokens 16384 --steps 100000 \
      --train-minutes ${MINUTES:-5.5} --eval-every 250 --eval-positions 20000 --patience 5 --held-out 0.03 --seed 0"
    grun() { name=$1; shift; python -m specdec distill $G --out $R/$name --work $R/w_$name "$@" > $R/$name.log 2>&1; }
    grun eagle --arch eagle --layers 29 --lr 1e-3 & grun layers --arch layers --layers 0,29 --lr 3e-4 &
    grun eagle-unroll2 --arch eagle --layers 29 --lr 1e-3 --unroll 2 &
    grun eagle-2layer --arch eagle --layers 28,29 --lr 1e-3 &
    grun eagle-v16k --arch eagle --layers 29 --lr 1e-3 --draft-vocab 16384 &
    grun eagle-topk8 --arch eagle --layers 29 --lr 1e-3 --labels topk:8 &
    for n in 250000 500000 1000000; do grun eagle-$n --arch eagle --layers 29 --lr 1e-3 --max-positions $n & done
    wait ;;
  gpu-init)  # the shipped smollm2-eagle (bench/RESULTS.md "Going on from a draft"), on one H100 in 9.5 minutes:
    # grow the corpus (2 more sampled replies per training prompt, Magpie turns steered by task openings, newest
    # answered first), three runs at once, then the best one 2.2 minutes more on the corpus as it was before
    # (git 6bcc5a7's; the device's working tree was re-sent between the two calls, so that is what it read)
    specdec corpus --target smollm2 --out $C --device cuda --gen-dtype bf16 --prompts specdec/data/train_prompts.jsonl \
      --samples 6 --temperature 0.8 --magpie 40600 --magpie-batch 2048 --magpie-tokens 384 --magpie-temperature 0.8 \
      --magpie-openings specdec/data/magpie_openings.jsonl --reply-order newest --exclude bench/dev_prompts.jsonl \
      --gen-tokens 192 --batch-size 2048 --shard-prompts 4096 --minutes 2.8
    I="--target smollm2 --device cuda --threads 5 --max-tokens 16384 --steps 100000 --eval-every 250 \
      --eval-positions 20000 --patience 5 --held-out 0.03 --arch eagle"
    irun() { name=$1; shift; python -m specdec distill $I --out $R/$name --work $R/w_$name "$@" > $R/$name.log 2>&1; }
    G="--corpus $C --train-minutes 4.22 --seed 0"
    irun init-c1024 $G --init smollm2-eagle --max-context 1024 --lr 5e-4 &
    irun init-c256 $G --init smollm2-eagle --max-context 256 --lr 5e-4 &
    irun c1024 $G --layers 29 --max-context 1024 --lr 1e-3 & wait
    mkdir -p $R/before && git archive 6bcc5a7 $C | tar x -C $R/before
    irun init-c1024-more --corpus $R/before/$C --train-minutes 2.2 --seed 1 --threads 15 --init $R/init-c1024 \
      --max-context 1024 --lr 3e-4 ;;
esac
