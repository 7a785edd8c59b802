#!/usr/bin/env bash
# torchtitan 0.2.2's own trainer on one GPU in our 1B shape, to set beside `make bench BENCH_ARGS="--only gpu"`.
#
#   bash bench/torchtitan/run.sh OUTDIR [compile 0|1] [local_batch_size] [extra torchtitan overrides...]
#
# From any directory. If bench/torchtitan/whl/ holds wheels (fetch_wheels.sh), installs them into
# OUTDIR/.site and puts that first on PYTHONPATH; otherwise torchtitan must already be importable.
# Makes assets/ with make_assets.py if it is missing. Then runs, from the repository root,
#   torchrun --standalone --nproc-per-node=1 bench/torchtitan/tt_train.py --job.config_file bench/torchtitan/llama1b.toml
# (as `python -m torch.distributed.run`, what the torchrun script calls, so the same interpreter) and
# writes the whole log to
#   OUTDIR/torchtitan-compile{0,1}-b{N}.log          (TT_FSDP1=1: torchtitan-fsdp1-compile{0,1}-b{N}.log)
# ending with a "# summary:" line. Extra arguments after the third go to torchtitan.
# Env: TT_STEPS (default 30), TT_TIMEOUT (seconds, default 900), TT_FSDP1 (0|1, see tt_train.py),
#      PYTHON (default python3: an interpreter with torch; a path is taken from the repository root,
#      e.g. PYTHON=.venv/bin/python).
set -uo pipefail  # no -e: the summary is written whatever the run's exit code

if [ $# -lt 1 ]; then
    echo "usage: bash bench/torchtitan/run.sh OUTDIR [compile 0|1] [local_batch_size] [extra overrides...]" >&2
    exit 2
fi
OUT_ARG=$1
COMPILE=${2:-0}
BS=${3:-8}
shift $(( $# < 3 ? $# : 3 ))
STEPS=${TT_STEPS:-30}
FSDP1=${TT_FSDP1:-0}
PYTHON=${PYTHON:-python3}
case "$COMPILE" in 0|1) ;; *) echo "compile must be 0 or 1, got '$COMPILE'" >&2; exit 2;; esac

mkdir -p "$OUT_ARG" && OUT=$(cd "$OUT_ARG" && pwd) || { echo "cannot create $OUT_ARG" >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$HERE/../.." || exit 2  # the repository root: the bench/torchtitan/ paths below are relative to it

TAG=compile${COMPILE}-b${BS}
[ "$FSDP1" = 1 ] && TAG=fsdp1-$TAG
LOG=$OUT/torchtitan-$TAG.log

{
    echo "# torchtitan run $TAG  steps=$STEPS  $(date -u +%FT%TZ)  host=$(hostname)"
    echo "# cwd=$(pwd)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1 || true
} > "$LOG"

# Carried wheels: no index, no dependencies, into a folder of this run's own
shopt -s nullglob
WHEELS=(bench/torchtitan/whl/*.whl)
if [ ${#WHEELS[@]} -gt 0 ]; then
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$OUT/.site" "${WHEELS[@]}"; then
        echo "pip install of bench/torchtitan/whl failed" | tee -a "$LOG" >&2
        exit 1
    fi
    export PYTHONPATH=$OUT/.site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ ! -d bench/torchtitan/assets ]; then
    "$PYTHON" bench/torchtitan/make_assets.py 2>&1 | tee -a "$LOG" || exit 1
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_DATASETS_CACHE=$OUT/.hf_datasets_cache/$TAG  # fresh, writable arrow cache for load_dataset
export TOKENIZERS_PARALLELISM=false
export TT_FSDP1=$FSDP1

# The versions in use, for the record
"$PYTHON" - >> "$LOG" 2>&1 <<'EOF'
import importlib, sys
print("# python", sys.version.split()[0])
for m in ["torch", "torchtitan", "torchdata", "datasets", "tyro", "typeguard", "typing_extensions",
          "dill", "multiprocess", "huggingface_hub", "pyarrow", "fsspec", "tokenizers", "numpy", "triton"]:
    try:
        mod = importlib.import_module(m)
        print(f"# {m:18s} {getattr(mod, '__version__', '?'):24s} {getattr(mod, '__file__', '')}")
    except Exception as e:
        print(f"# {m:18s} IMPORT FAILED: {type(e).__name__}: {e}")
EOF

ARGS=(--job.config_file bench/torchtitan/llama1b.toml
      --job.dump_folder "$OUT/tt_dump/$TAG"
      --model.hf_assets_path bench/torchtitan/assets/tokenizer
      --training.dataset c4_test
      --training.dataset_path bench/torchtitan/assets/data
      --training.local_batch_size "$BS"
      --training.steps "$STEPS")
[ "$COMPILE" = 1 ] && ARGS+=(--compile.enable)
ARGS+=("$@")

echo "# command: $PYTHON -m torch.distributed.run --standalone --nproc-per-node=1 bench/torchtitan/tt_train.py ${ARGS[*]}" >> "$LOG"
echo "# env: TT_FSDP1=$FSDP1 PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-} PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}" >> "$LOG"
START=$(date +%s)
timeout "${TT_TIMEOUT:-900}" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=1 \
    bench/torchtitan/tt_train.py "${ARGS[@]}" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
END=$(date +%s)

# Summary: torchtitan's tps/mfu over the logged steps. Step 1's window includes start-up (and compile),
# so the steady value is the mean over logged steps >= 10 (windows of 5 steps each).
{
    echo "# exit code $rc, wall $((END - START))s"
    awk '/ step: *[0-9]+ /{
            s = $0; sub(/.* step: */, "", s); step = s + 0
            t = $0; sub(/.* tps: */, "", t); sub(/ .*/, "", t); gsub(",", "", t)
            m = $0; sub(/.* mfu: */, "", m); sub(/%.*/, "", m)
            if (step >= 10) { n++; tps += t; mfu += m }
        }
        END { if (n) printf "# summary: steady (logged steps >= 10, n=%d) tps %.0f  mfu %.2f%%\n", n, tps / n, mfu / n
              else print "# summary: no step >= 10 logged" }' "$LOG"
} 2>&1 | tee -a "$LOG"
exit "$rc"
