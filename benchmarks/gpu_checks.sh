#!/usr/bin/env bash
# GPU checks, run on a CUDA machine from the repo root (no install needed:
# jax, flax, optax, numpy, pytest, tokenizers, safetensors and ml_collections must be
# importable; wheels in .whl/, e.g. ml_collections' on a machine without a network, are
# installed into /tmp/site first).
#   bash benchmarks/gpu_checks.sh OUTDIR
# 1. the Triton paged attention kernel compiled for real vs the reference;
# 2. the engine with impl="pallas" gives the XLA path's tokens;
# 3. benchmarks/paged_attention.py (kernel vs XLA vs jax's one-query kernel);
# 4. benchmarks/tree_step.py (chain vs 16/32/64-node tree steps, EAGLE-3 head on Gemma 3 270M's shapes with
#    random weights, bf16: the device has no network for the demo package), and the
#    tree / EAGLE-3 tests on the GPU;
# 5. the Gemma 4, assistant and DFlash 1 / 2 tests on the GPU (the Triton kernel with head dims 16 / 32, Gemma 4's
#    per-type head dims) and benchmarks/draft_cost.py at the full 262144 vocabulary;
# 6. benchmarks/train_step.py: training tokens/s of `specjax train`'s step (EAGLE-3, DFlash, MTP; the target in
#    the step and cached) on Gemma 3 270M's shapes, bf16 target, at the CPU configs' batch (8 x 512) and at 64 x 512.
set -uo pipefail
out=${1:-gpu_checks_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
if compgen -G '.whl/*.whl' > /dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())' | tee -a "$out/gpu.txt"
$py -m pytest -q -p no:cacheprovider tests/test_paged_attention_kernel.py -k 'not Interpret' \
    tests/test_gpu_engine.py 2>&1 | tee "$out/tests.log"
$py benchmarks/paged_attention.py --batch 1 8 64 --context 4096 32768 --queries 1 4 8 \
    --json "$out/paged_attention.json" 2>&1 | tee "$out/paged_attention.log"
$py -m pytest -q -p no:cacheprovider tests/test_tree_speculative.py tests/test_eagle3.py 2>&1 | tee "$out/tree_tests.log"
$py benchmarks/tree_step.py --model random --rounds 3 --json "$out/tree_step.json" 2>&1 | tee "$out/tree_step.log"
$py -m pytest -q -p no:cacheprovider tests/test_gemma4.py tests/test_gemma4_assistant.py tests/test_dflash.py \
    tests/test_dflash2.py 2>&1 | tee "$out/drafter_tests.log"
$py benchmarks/draft_cost.py --vocab 262144 --rounds 3 --json "$out/draft_cost.json" 2>&1 | tee "$out/draft_cost.log"
$py benchmarks/train_step.py --model random --batch 8 --len 512 --json "$out/train_step_b8.json" 2>&1 |
    tee "$out/train_step.log"
$py benchmarks/train_step.py --model random --batch 64 --len 512 --json "$out/train_step_b64.json" 2>&1 |
    tee -a "$out/train_step.log"
