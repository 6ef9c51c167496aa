#!/usr/bin/env bash
# One GPU machine call of the GPU benchmarks, most telling first, since a call may be cut short:
# the SFT table (bench/gpu.py writes its record after every row), then DPO against TRL's
# DPOTrainer (bench/dpo_gpu.py, its rows folded into the same record), then optionally the
# profile of the packed 2048-token row. Run from the project root on a machine that has torch,
# transformers and peft; the other packages come as wheels in .whl, the data from
# bench/gpu_prep.py and bench/dpo_gpu.py prep in .gpu (docs/benchmarks.md).
#
#   bash bench/gpu_session.sh OUT
#
# Environment: SFT_ROWS (bench/gpu.py --rows; "skip": none), SFT_BUDGET (seconds before the
# last SFT row starts, default 330), DPO_ROWS (bench/dpo_gpu.py --rows; empty: no DPO),
# DPO_BUDGET (default 120), MERGE (an earlier machine start's gpu-<device>.json: rows gain a
# range), PROFILE=1 (trace the packed row at the end).
set -uo pipefail
out=$1
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
quiet() { grep -v -E "it/s\]|s/it\]"; }
nvidia-smi -L
python3 -c "import torch, transformers, trl, peft, datasets, liger_kernel; print('torch',
torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft',
peft.__version__, 'datasets', datasets.__version__)" || exit 1
if [ "${SFT_ROWS:-}" != skip ]; then
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
if [ "${PROFILE:-0}" = 1 ]; then
    python3 bench/gpu.py --data .gpu --profile --work /tmp/bench-gpu-profile \
        --rows "ours 2048-token rows, packed Alpaca + compile" 2>&1 | quiet \
        | tee "$out/profile.log"
fi
