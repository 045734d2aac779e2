#!/usr/bin/env bash
# Lean GPU check for a lent GPU machine without internet, from the repository root:
#     bash benchmarks/gpu_check_lean.sh
#
# It uses the machine's own python (its image's PyTorch, transformers, peft, triton and pytest); vLLM and
# Ray are neither needed nor installed. benchmarks/gpu_check.sh is the full check, for machines with
# internet.
#
# 1. installs the wheels in benchmarks/gpu_wheels/ (DeepSpeed's source package, its pure-Python
#    dependencies, liger-kernel, ring-flash-attn: how to fill the folder is in benchmarks/README.md) with
#    pip --no-index --no-deps into a folder of this run; the six workspace packages go on PYTHONPATH
#    (nothing is built);
# 2. checks that everything the workspace imports is there (one line naming what is missing);
# 3. benchmarks/weightsync_gpu.py --transports cuda_ipc,nccl: a 7B-size bf16 state dict against a
#    device-to-device copy;
# 4. the `gpu` tests that import neither vLLM nor Ray, each file in its own pytest process: the learner
#    (flash-attn packing, liger-kernel, ZeRO-3 and FSDP2 in bf16 with offload and reload, ring attention,
#    QLoRA), rlhf-weightsync's transports, one RLHF step through the four libraries with the
#    transformers engine receiving weights over CUDA IPC, on text and on image prompts with the vision
#    tower trained (tests/test_gpu_rlhf_step.py), and the tiny vision-language model's packed rows and
#    FSDP2 bf16 training (tests/test_gpu_vlm.py);
# 5. prints one table (check, result, target, pass?).
# Exit status: non-zero when the install or the import check fails, a test fails, or the benchmark
# crashes (its target is reported, not fatal). It is sized to finish in under 8 minutes on one H100.
#
# Environment (optional): GPU_LEAN_PYTHON (default: python3), GPU_LEAN_WHEELS (default:
# benchmarks/gpu_wheels), GPU_LEAN_LOG_DIR (default: a new folder under $TMPDIR or /tmp),
# GPU_LEAN_TEST_TIMEOUT=300 (seconds per test file), GPU_LEAN_WEIGHTSYNC_TIMEOUT=150.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PY=${GPU_LEAN_PYTHON:-python3}
WHEELS=${GPU_LEAN_WHEELS:-benchmarks/gpu_wheels}
LOG_DIR=${GPU_LEAN_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_lean.XXXXXX")}
T_TEST=${GPU_LEAN_TEST_TIMEOUT:-300}
T_WS=${GPU_LEAN_WEIGHTSYNC_TIMEOUT:-150}
mkdir -p "$LOG_DIR" || exit 2
SUMMARY="$LOG_DIR/summary.tsv"
: >"$SUMMARY"
FAILED=0
SITE="$LOG_DIR/site"
SRC=packages/algos/src:packages/learner/src:packages/weightsync/src:packages/rollout/src:packages/testkit/src:packages/cli/src
export PYTHONPATH="$SITE:$SRC${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1

say() { echo "[gpu_check_lean $(date +%T)] $*"; }
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"; }
last_line() { grep -v '^[[:space:]]*$' "$1" | tail -n 1 | cut -c1-150; }
limited() {
    local seconds=$1
    shift
    timeout --kill-after=15 "$seconds" "$@"
}

say "python: $(command -v "$PY"), logs: $LOG_DIR"

# --- 1. install -------------------------------------------------------------------------------------
log="$LOG_DIR/install.log"
: >"$log"
install() {  # wheels first (setuptools among them), then source packages, which build with them on PYTHONPATH
    local files=("$WHEELS"/$1)
    [ -e "${files[0]}" ] || return 0
    limited 300 "$PY" -m pip install --no-index --no-deps --no-build-isolation --target "$SITE" "${files[@]}" >>"$log" 2>&1
}
if compgen -G "$WHEELS/*.whl" >/dev/null || compgen -G "$WHEELS/*.tar.gz" >/dev/null; then
    install "*.whl" && install "*.tar.gz"
    rc=$?
    if [ "$rc" = 0 ]; then
        row "install $WHEELS" "ok: $(ls "$WHEELS" | wc -l) packages" "exit 0" "yes"
    else
        row "install $WHEELS" "failed (exit $rc): $(last_line "$log")" "exit 0" "NO"
        FAILED=1
    fi
else
    row "install $WHEELS" "no wheels there (see benchmarks/README.md)" "exit 0" "NO"
    FAILED=1
fi

# --- 2. imports -------------------------------------------------------------------------------------
log="$LOG_DIR/imports.log"
"$PY" - >"$log" 2>&1 <<'PYEOF'
import importlib
needed = ["torch", "transformers", "peft", "triton", "pytest", "deepspeed", "liger_kernel", "safetensors",
          "rlhf_algos", "rlhf_learner", "rlhf_weightsync", "rlhf_rollout", "rlhf_testkit.pytest_plugin",
          "rlhf_learner.strategy.strategy", "rlhf_rollout.hf_engine", "rlhf_weightsync.module_ext", "PIL",
          "rlhf_cli.data.images", "rlhf_cli.demo.tiny_vlm", "rlhf_testkit.engine_process",
          "torchvision"]
missing = []
for name in needed:
    try:
        importlib.import_module(name)
    except Exception as err:  # what is missing, named
        missing.append(f"{name} ({type(err).__name__}: {err})")
import torch, transformers
print("cuda:", torch.cuda.is_available(), torch.cuda.device_count(), "torch", torch.__version__,
      "transformers", transformers.__version__)
print("missing: " + "; ".join(missing) if missing else "all imported")
raise SystemExit(1 if missing or not torch.cuda.is_available() else 0)
PYEOF
if [ $? = 0 ]; then
    row "imports (workspace, DeepSpeed, liger-kernel) and CUDA" "$(head -n 1 "$log")" "all imported" "yes"
else
    row "imports (workspace, DeepSpeed, liger-kernel) and CUDA" "$(last_line "$log")" "all imported" "NO"
    FAILED=1
fi

# --- 3. weight sync benchmark -----------------------------------------------------------------------
log="$LOG_DIR/weightsync_gpu.log"
before=$(wc -l <"$SUMMARY")
say "weightsync_gpu.py (timeout ${T_WS}s)"
limited "$T_WS" "$PY" benchmarks/weightsync_gpu.py --syncs 3 --warmup 1 --timeout 90 --summary "$SUMMARY" >"$log" 2>&1
rc=$?
if [ "$rc" != 0 ] && [ "$(wc -l <"$SUMMARY")" = "$before" ]; then
    row "weightsync_gpu.py" "crashed (exit $rc): $(last_line "$log")" "runs" "NO"
    FAILED=1
fi

# --- 4. gpu tests, a pytest process per file ---------------------------------------------------------
TESTS=(
    packages/learner/tests/test_gpu.py
    packages/weightsync/tests/test_gpu.py
    tests/test_gpu_rlhf_step.py
    tests/test_gpu_vlm.py
)
PLUGIN=(-p rlhf_testkit.pytest_plugin)  # the testkit's fixtures and markers, unless pip installed them
"$PY" -c 'import importlib.metadata as m, sys; sys.exit(0 if any(e.value.startswith("rlhf_testkit") for e in m.entry_points(group="pytest11")) else 1)' 2>/dev/null && PLUGIN=()
for file in "${TESTS[@]}"; do
    log="$LOG_DIR/$(echo "$file" | tr '/' '_').log"
    say "pytest -m gpu $file (timeout ${T_TEST}s)"
    start=$SECONDS
    limited "$T_TEST" "$PY" -m pytest "$file" -m gpu -q -p no:cacheprovider "${PLUGIN[@]}" \
        -o addopts="" --import-mode=importlib -rs >"$log" 2>&1
    rc=$?
    final=$(grep -E '[0-9]+ (passed|failed|skipped|errors?)|no tests ran' "$log" | tail -n 1)
    result="${final:-no summary} in $((SECONDS - start)) s"
    if [ "$rc" = 0 ]; then
        row "gpu tests: $file" "$result" "0 failed" "yes"
    else
        [ "$rc" = 124 ] && result="$result (timed out)"
        row "gpu tests: $file" "$result" "0 failed" "NO"
        FAILED=1
        grep -E '^(FAILED|ERROR) ' "$log" | head -n 10
    fi
done

# --- 5. the table -----------------------------------------------------------------------------------
echo
{
    printf 'check\tresult\ttarget\tpass?\n'
    cat "$SUMMARY"
} | awk -F'\t' '{ printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4; if (NR == 1) print "|---|---|---|---|" }'
echo
if [ "$FAILED" = 0 ]; then say "PASS (logs: $LOG_DIR)"; else say "FAIL (logs: $LOG_DIR)"; fi
exit "$FAILED"
