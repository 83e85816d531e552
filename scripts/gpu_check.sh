#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU (and pip's registry as its only
# network); about 8 minutes, most of it downloading the CUDA wheels.
#
#   bash scripts/gpu_check.sh [--dry-run | --wheels DIR] [gpu_check.py options, e.g. --json FILE]
#
# 1. Creates .venv-gpu (apart from the training venv: onnxruntime-gpu and the
#    training builds both install the module `onnxruntime`) with
#    onnxruntime-gpu, the CUDA 12 runtime wheels it loads, onnxconverter-common
#    and this project (`pip install -e .`, no extras).
# 2. Runs scripts/gpu_check.py: real-fp16 parity of models/*.onnx on the CUDA
#    EP, and fp32 vs fp16 latency of a BERT-base-sized encoder and a
#    ResNet-50-sized CNN (onnxmp and onnxconverter-common).
# 3. Training hook (see the marked section below), and scripts/gpu_train_check.py: the
#    portable engine's fp32/fp16/bf16 step time on the CUDA EP beside PyTorch AMP.
#
# --wheels DIR is for a GPU machine without a package registry: no venv, no
# download.  The interpreter (PYTHON, else python3) must already have numpy,
# onnx, tqdm and the CUDA runtime wheels its onnxruntime-gpu build loads (a
# PyTorch image has them); DIR holds the wheels it lacks (onnxruntime-gpu,
# onnx-graphsurgeon, onnxconverter-common), installed with --no-index into
# DIR/site and put first on PYTHONPATH.  Step 3 is skipped (the training build
# needs its own CUDA 11.8 venv).
#
# Exits non-zero if parity fails or a step breaks.  --dry-run creates no venv:
# it runs step 2 with the current environment on the CPU EP with emulated fp16
# and tiny models, and only lists what steps 1 and 3 would do.
#
# Environment overrides: PYTHON (interpreter for the venvs, or for --dry-run),
# VENV (default .venv-gpu), ORT_SPEC, TRAIN_TIMEOUT (seconds per training script).
set -uo pipefail

cd "$(dirname "$0")/.."

DRY_RUN=0
WHEELS=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --wheels)
            if [ $# -lt 2 ] || [ ! -d "$2" ]; then
                echo "gpu_check.sh: error: --wheels needs a folder of .whl files" >&2; exit 2
            fi
            WHEELS=$2; shift ;;
        *) ARGS+=("$1") ;;
    esac
    shift
done
if [ "$DRY_RUN" = 1 ] && [ -n "$WHEELS" ]; then
    echo "gpu_check.sh: error: --dry-run and --wheels exclude each other" >&2; exit 2
fi

VENV=${VENV:-.venv-gpu}
TRAIN_VENV=${TRAIN_VENV:-.venv-gpu-train}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-240}
# onnxruntime-gpu 1.27 and later are CUDA 13 builds (driver >= 580); the 1.19-1.26
# line is CUDA 12 + cuDNN 9, which any driver from 525 on runs.
ORT_SPEC=${ORT_SPEC:-"onnxruntime-gpu[cuda,cudnn]>=1.19,<1.27"}
# Listed as well as the extras: 1.19/1.20 have no such extras, and cuBLAS only
# comes in through cuDNN's own dependencies.
CUDA_WHEELS=(nvidia-cuda-runtime-cu12 nvidia-cublas-cu12 nvidia-cudnn-cu12 nvidia-curand-cu12
             nvidia-cufft-cu12 nvidia-cuda-nvrtc-cu12)
# onnxruntime-training 1.19.2 from PyPI is a CUDA 11.8 + cuDNN 8 build (its CUDA
# provider links libcudart.so.11.0, libcublas.so.11, libcudnn.so.8).
TRAIN_CUDA_WHEELS=("nvidia-cuda-runtime-cu11==11.8.*" "nvidia-cublas-cu11==11.11.*" "nvidia-cudnn-cu11>=8.9,<9"
                   "nvidia-curand-cu11==10.3.*" "nvidia-cufft-cu11==10.9.*")
# Results land in $OUT when the caller provides one (the device runner does).
RESULTS=${OUT:-gpu-check-results}

STEPS=()
FAILED=0
record() {  # record NAME STATUS
    STEPS+=("$(printf '%-26s %s' "$1" "$2")")
    case "$2" in ok*|skipped*|dry-run*) ;; *) FAILED=1 ;; esac
}

pick_python() {
    # The project declares Python 3.10-3.11; prefer those when the machine has them.
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    for candidate in python3.11 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1; then echo "$candidate"; return; fi
    done
    echo python
}

# onnxruntime < 1.21 has no preload_dlls(): it finds the nvidia-* wheels' libs
# only through the loader path.  CUDA 12 wheels keep them in nvidia/<lib>/lib,
# CUDA 13 ones in nvidia/cu13/lib: take every folder holding a shared library.
export_cuda_libs() {  # export_cuda_libs PYTHON
    local roots dir
    roots=$("$1" -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null) || return 0
    while IFS= read -r dir; do
        [ -n "$dir" ] && LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done < <(find $roots -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u)
    export LD_LIBRARY_PATH
}

make_venv() {  # make_venv DIR PROJECT_SPEC PIP_ARGS...: a venv with PIP_ARGS, then `pip install -e PROJECT_SPEC`
    local dir=$1 project=$2; shift 2
    local base; base=$(pick_python)
    if [ ! -x "$dir/bin/python" ]; then
        "$base" -m venv "$dir" || return 1
    fi
    local pip=("$dir/bin/python" -m pip install --disable-pip-version-check -q)
    "${pip[@]}" "$@" || return 1
    local ignore=()
    if ! "$dir/bin/python" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 11))'; then
        echo "warning: $("$dir/bin/python" --version) is outside the project's declared 3.10-3.11; installing anyway"
        ignore=(--ignore-requires-python)
    fi
    "${pip[@]}" ${ignore[@]+"${ignore[@]}"} -e "$project" || return 1
}

if [ "$DRY_RUN" = 1 ]; then
    if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
    elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
    else PY=python3; fi
    echo "[dry-run] would create $VENV and install: $ORT_SPEC ${CUDA_WHEELS[*]} onnxconverter-common, -e ."
    record "venv $VENV" "dry-run (using $PY)"
elif [ -n "$WHEELS" ]; then
    echo "== GPU"
    if nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; then
        record "nvidia-smi" ok
    else
        record "nvidia-smi" "FAILED (no NVIDIA driver?)"
    fi
    PY=${PYTHON:-python3}
    echo "== wheels from $WHEELS (no index)"
    if "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --upgrade \
            --target "$WHEELS/site" "$WHEELS"/*.whl; then
        record "wheels $WHEELS" ok
    else
        record "wheels $WHEELS" FAILED
    fi
    export PYTHONPATH="$WHEELS/site${PYTHONPATH:+:$PYTHONPATH}"
    export_cuda_libs "$PY"
else
    echo "== GPU"
    if nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; then
        record "nvidia-smi" ok
    else
        record "nvidia-smi" "FAILED (no NVIDIA driver?)"
    fi
    echo "== venv $VENV"
    start=$SECONDS
    if make_venv "$VENV" . "$ORT_SPEC" "${CUDA_WHEELS[@]}" onnxconverter-common; then
        record "venv $VENV" "ok ($((SECONDS - start)) s)"
    else
        record "venv $VENV" "FAILED"
    fi
    PY=$VENV/bin/python
    export_cuda_libs "$PY"
fi

echo "== gpu_check.py"
start=$SECONDS
if [ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1; then
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" scripts/gpu_check.py --dry-run ${ARGS[@]+"${ARGS[@]}"}
    else
        mkdir -p "$RESULTS"
        case " ${ARGS[*]-} " in *" --json "*) ;; *) ARGS+=(--json "$RESULTS/gpu_check.json") ;; esac
        "$PY" scripts/gpu_check.py "${ARGS[@]}"
    fi
    rc=$?
    case $rc in
        0) record "gpu_check.py" "ok ($((SECONDS - start)) s)" ;;
        1) record "gpu_check.py" "FAILED: parity" ;;
        2) record "gpu_check.py" "FAILED: a step broke (see its table)" ;;
        *) record "gpu_check.py" "FAILED: exit $rc" ;;
    esac
else
    record "gpu_check.py" "FAILED: no interpreter $PY"
fi

# ============================================================================
# TRAINING GPU CHECK (hook)
# scripts/validate_training.py and scripts/bench_training.py come from the
# training work. They need onnxruntime-training (the `train-gpu` extra), which
# cannot share a venv with onnxruntime-gpu, hence $TRAIN_VENV. Each script is
# run if present, under TRAIN_TIMEOUT seconds, and skipped with a message if not.
# ============================================================================
DRY_DIR=$(mktemp -d)
trap 'rm -rf "$DRY_DIR"' EXIT
TRAIN_SCRIPTS=(
    "scripts/validate_training.py --device cuda --no-progress --plot $RESULTS/validate_training_cuda.png
     --json $RESULTS/validate_training_cuda.json"
    "scripts/bench_training.py --device cuda --json $RESULTS/bench_training_cuda.json"
)
train_ready=""
for entry in "${TRAIN_SCRIPTS[@]}"; do
    script=${entry%% *}
    name=$(basename "$script")
    if [ ! -f "$script" ]; then
        echo "skipping $name: $script is not there yet"
        record "$name" "skipped (not present)"
        continue
    fi
    if [ -n "$WHEELS" ]; then
        record "$name" "skipped (--wheels: no training venv)"
        continue
    fi
    if [ "$DRY_RUN" = 1 ]; then
        # Same script, tiny and on the CPU (emulated fp16), in the current environment.
        echo "[dry-run] on a GPU this runs in $TRAIN_VENV: python $entry"
        case "$name" in
            validate_training.py) cpu_entry="$script --device cpu --quick --no-progress --plot $DRY_DIR/vt.png --json $DRY_DIR/vt.json" ;;
            *) cpu_entry="$script --device cpu --sizes 64-32-10 --batch-size 16 --steps 3 --warmup 1" ;;
        esac
        start=$SECONDS
        # shellcheck disable=SC2086  # the entry is a command line on purpose
        if "$PY" $cpu_entry > "$DRY_DIR/$name.log" 2>&1; then
            record "$name" "ok, dry run on CPU ($((SECONDS - start)) s)"
        else
            tail -20 "$DRY_DIR/$name.log"
            record "$name" "FAILED dry run on CPU"
        fi
        continue
    fi
    if [ -z "$train_ready" ]; then
        echo "== venv $TRAIN_VENV"
        mkdir -p "$RESULTS"
        if make_venv "$TRAIN_VENV" ".[train-gpu]" "${TRAIN_CUDA_WHEELS[@]}" scikit-learn; then
            train_ready=ok
        else
            train_ready=failed
        fi
    fi
    if [ "$train_ready" != ok ]; then
        record "$name" "FAILED: $TRAIN_VENV setup"
        continue
    fi
    echo "== $name"
    start=$SECONDS
    # shellcheck disable=SC2086  # the entry is a command line on purpose
    if (export_cuda_libs "$TRAIN_VENV/bin/python"; timeout "$TRAIN_TIMEOUT" "$TRAIN_VENV/bin/python" $entry); then
        record "$name" "ok ($((SECONDS - start)) s)"
    else
        record "$name" "FAILED (exit $? after $((SECONDS - start)) s)"
    fi
done
# ============================================================================

# Training through the portable engine (issue 28): BERT-base-sized and ResNet-50-sized models,
# fp32/fp16/bf16 step time on the CUDA EP beside PyTorch AMP on the same model and batch.  The
# artifacts are built in $TRAIN_VENV (onnxruntime-training) and trained in $VENV (plain
# onnxruntime-gpu); torch comes from TORCH_PYTHON (default python3, the machine's own torch).
TORCH_PYTHON=${TORCH_PYTHON:-python3}
name=gpu_train_check.py
if [ -n "$WHEELS" ]; then
    record "$name" "skipped (--wheels: no training venv to build the artifacts in)"
elif [ "$DRY_RUN" = 1 ] && ! "$TORCH_PYTHON" -c "import torch" >/dev/null 2>&1; then
    record "$name" "skipped (dry run: no torch in $TORCH_PYTHON; set TORCH_PYTHON)"
elif [ "$DRY_RUN" = 1 ]; then
    echo "[dry-run] on a GPU: builds in $TRAIN_VENV, trains in $VENV, torch from $TORCH_PYTHON"
    start=$SECONDS
    if "$PY" scripts/gpu_train_check.py --dry-run --torch-python "$TORCH_PYTHON" > "$DRY_DIR/$name.log" 2>&1; then
        cat "$DRY_DIR/$name.log"
        record "$name" "ok, dry run on CPU ($((SECONDS - start)) s)"
    else
        tail -20 "$DRY_DIR/$name.log"
        record "$name" "FAILED dry run on CPU"
    fi
else
    if [ -z "$train_ready" ]; then
        mkdir -p "$RESULTS"
        make_venv "$TRAIN_VENV" ".[train-gpu]" "${TRAIN_CUDA_WHEELS[@]}" && train_ready=ok || train_ready=failed
    fi
    echo "== $name"
    start=$SECONDS
    if [ "$train_ready" != ok ]; then
        record "$name" "FAILED: $TRAIN_VENV setup"
    elif (export_cuda_libs "$PY"; timeout "$TRAIN_TIMEOUT" "$PY" scripts/gpu_train_check.py \
            --torch-python "$TORCH_PYTHON" --build-python "$TRAIN_VENV/bin/python" --train-python "$PY" \
            --json "$RESULTS/gpu_train_check.json"); then
        record "$name" "ok ($((SECONDS - start)) s)"
    else
        record "$name" "FAILED (exit $? after $((SECONDS - start)) s)"
    fi
fi

echo
echo "== steps"
for line in "${STEPS[@]}"; do echo "$line"; done
exit $FAILED
