#!/usr/bin/env bash
# GPU checks, run on a CUDA machine from the repo root (no install needed: jax, flax, optax, numpy, pytest,
# tokenizers, safetensors must be importable; wheels in .whl/, e.g. ml_collections' and gguf's on a machine
# without a network, are installed into /tmp/site first).
#   bash benchmarks/gpu_checks.sh OUTDIR
# In priority order, each step capped by `timeout` so that one slow step cannot eat the lease, all output in
# OUTDIR/gpu_checks.log and at most 7 files beside it (a device call returns 8):
# 1. the Triton paged attention kernel compiled for real vs the reference, and the engine with impl="pallas"
#    giving the XLA path's tokens;
# 2. benchmarks/serve_batch.py: the continuous-batching scheduler end to end in bfloat16 (Gemma 3 270M's shapes,
#    random weights: the device has no network for the demo package), AR and n-gram at concurrency 1-64;
# 3. benchmarks/train_step.py: the EAGLE-3 training step (target in the step, and cached) at 8 x 512 and
#    64 x 512, bfloat16 target;
# 4. benchmarks/paged_attention.py: kernel bandwidth against XLA and jax's one-query kernel;
# 5. benchmarks/tree_step.py: chain vs 16/32/64-node tree steps (EAGLE-3 head, 270M's shapes);
# 6. benchmarks/draft_cost.py at the full 262144 vocabulary.
# Long GPU test files (trees, EAGLE-3, Gemma 4, DFlash) are left out: they take minutes of compiles; run them
# with `pytest tests/test_tree_speculative.py ...` when a lease has the time.
set -uo pipefail
out=${1:-gpu_checks_out}
mkdir -p "$out"
log="$out/gpu_checks.log"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
if compgen -G '.whl/*.whl' > /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
step() {  # step SECONDS NAME COMMAND...
  local limit=$1 name=$2
  shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$log"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0))s" | tee -a "$log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> "$log" 2>&1
$py -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())' >> "$log" 2>&1
step 90 kernel-tests $py -m pytest -q -p no:cacheprovider tests/test_paged_attention_kernel.py -k 'not Interpret' \
  tests/test_gpu_engine.py
step 200 serve-batch $py benchmarks/serve_batch.py -m random --dtype bfloat16 --arms ar ngram \
  --concurrency 1 4 16 64 --max-tokens 64 --json "$out/serve_batch.json"
step 50 train-step-b8 $py benchmarks/train_step.py --model random --kind eagle3 --batch 8 --len 512 --rounds 2 \
  --json "$out/train_step_b8.json"
step 50 train-step-b64 $py benchmarks/train_step.py --model random --kind eagle3 --batch 64 --len 512 --rounds 2 \
  --json "$out/train_step_b64.json"
step 45 paged-attention $py benchmarks/paged_attention.py --batch 1 64 --context 4096 32768 --queries 1 8 \
  --json "$out/paged_attention.json"
step 70 tree-step $py benchmarks/tree_step.py --model random --rounds 2 --json "$out/tree_step.json"
step 45 draft-cost $py benchmarks/draft_cost.py --vocab 262144 --rounds 2 --json "$out/draft_cost.json"
echo "=== done $(date -u +%T)" | tee -a "$log"
