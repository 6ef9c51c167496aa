#!/usr/bin/env bash
# One GPU machine call of the GPU benchmarks, most telling first, since a call may be cut short:
# optionally the profiles of PROFILE_ROWS side by side (bench/trace_summary.py), then the SFT
# table (bench/gpu.py writes its record after every row), then DPO against TRL's DPOTrainer
# (bench/dpo_gpu.py, its rows folded into the same record). Run from the project root on a machine that has torch,
# transformers and peft; the other packages come as wheels in .whl, the data from
# bench/gpu_prep.py and bench/dpo_gpu.py prep in .gpu (docs/benchmarks.md).
#
#   bash bench/gpu_session.sh OUT
#
# Environment: SFT_ROWS (bench/gpu.py --rows; "skip": none), SFT_BUDGET (seconds before the
# last SFT row starts, default 330; with LAST_START, the seconds since this script started by
# which the last SFT row must have started, what the profiles left of it), DPO_ROWS (bench/dpo_gpu.py --rows; empty: no DPO),
# DPO_BUDGET (default 120), MERGE (an earlier machine start's gpu-<device>.json: rows gain a
# range), PROFILE_ROWS (bench/gpu.py --rows to trace first: bench/gpu.py --profile writes
# their per-step summary side by side to OUT/profile-summary.md and each trace, gzipped, to OUT).
set -uo pipefail
out=$1
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
    # datasets 5 needs pyarrow >= 24; on an image with an older one, datasets 4.0 (.whl/alt)
    if ! python3 -c "import datasets" 2>/dev/null && [ -d .whl/alt ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site-alt .whl/alt/*.whl || exit 1
        export PYTHONPATH=/tmp/site-alt:/tmp/site
    fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
quiet() { grep -v -E "it/s\]|s/it\]"; }
nvidia-smi -L
python3 -c "import torch, transformers, trl, peft, datasets, liger_kernel; print('torch',
torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft',
peft.__version__, 'datasets', datasets.__version__)" || exit 1
if [ -n "${PROFILE_ROWS:-}" ]; then
    rm -rf /tmp/bench-gpu-profile
    python3 bench/gpu.py --data .gpu --profile --work /tmp/bench-gpu-profile \
        --rows "$PROFILE_ROWS" --out "$out" 2>&1 | quiet | tee "$out/profile.log"
fi
if [ "${SFT_ROWS:-}" != skip ]; then
    [ -n "${LAST_START:-}" ] && SFT_BUDGET=$(( LAST_START > SECONDS ? LAST_START - SECONDS : 0 ))
    python3 bench/gpu.py --data .gpu --window 6 --budget "${SFT_BUDGET:-330}" --out "$out" \
        ${SFT_ROWS:+--rows "$SFT_ROWS"} ${MERGE:+--merge "$MERGE"} 2>&1 | quiet \
        | tee "$out/gpu.log"
fi
if [ -n "${DPO_ROWS:-}" ]; then
    python3 bench/dpo_gpu.py run --data .gpu --rows "$DPO_ROWS" \
        --budget "${DPO_BUDGET:-120}" --out-json "$out/dpo-rows.json" 2>&1 | quiet \
        | tee "$out/dpo.log"
    record=$(ls "$out"/gpu-*.json 2>/dev/null | head -1)
    if [ -f "$out/dpo-rows.json" ] && [ -n "$record" ]; then
        python3 bench/gpu.py --data .gpu --merge "$record" --fold "$out/dpo-rows.json"
    fi
fi
