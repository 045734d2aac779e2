#!/usr/bin/env bash
# GPU check, run from the repository root on a CUDA machine: bash benchmarks/gpu_check.sh
#
# 1. installs the GPU extras (README's GPU command; `python -m pip install uv` first if uv is missing),
# 2. runs every `gpu` test (pytest -m gpu),
# 3. benchmarks/weightsync_gpu.py: a 7B-size bf16 state dict over cuda_ipc / nccl vs a D2D copy,
# 4. benchmarks/rollout_gpu.py: our VLLMEngine vs raw vllm.LLM.generate (tokens/s, target >= 0.90),
# 5. prints one table (check, result, target, pass?).
# Exit status: non-zero if the install failed, a gpu test failed (or pytest did not finish) or a
# benchmark crashed; the benchmarks' targets are reported, not fatal.
#
# Environment (all optional):
#   GPU_CHECK_SKIP_INSTALL=1        skip step 1 (the environment is already synced)
#   GPU_CHECK_LOG_DIR=DIR           where the full logs go (default: a new folder under $TMPDIR or /tmp)
#   GPU_CHECK_INSTALL_TIMEOUT=600   GPU_CHECK_TEST_TIMEOUT=300   (seconds)
#   GPU_CHECK_WEIGHTSYNC_TIMEOUT=150
#   GPU_CHECK_ROLLOUT_TIMEOUT=380   (the whole script; each engine subprocess gets
#   GPU_CHECK_ENGINE_TIMEOUT=170     this much)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

LOG_DIR=${GPU_CHECK_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$LOG_DIR" || exit 2
SUMMARY="$LOG_DIR/summary.tsv"
: >"$SUMMARY"
FAILED=0
T_INSTALL=${GPU_CHECK_INSTALL_TIMEOUT:-600}
T_TESTS=${GPU_CHECK_TEST_TIMEOUT:-300}
T_WS=${GPU_CHECK_WEIGHTSYNC_TIMEOUT:-150}
T_ROLLOUT=${GPU_CHECK_ROLLOUT_TIMEOUT:-380}
T_ENGINE=${GPU_CHECK_ENGINE_TIMEOUT:-170}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0

say() { echo "[gpu_check $(date +%T)] $*"; }
row() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"; }
tail_of() {
    echo "--- last lines of $1 ---"
    tail -n "${2:-25}" "$1"
    echo "---"
}
last_line() { grep -v '^[[:space:]]*$' "$1" | tail -n 1 | cut -c1-160; }
# timeout(1) signals its whole process group (engines' and Ray's workers too), then kills it
limited() {
    local seconds=$1
    shift
    timeout --kill-after=15 "$seconds" "$@"
}

say "logs: $LOG_DIR"

# --- 1. install --------------------------------------------------------------------------------------
INSTALL_CMD=(uv sync --all-packages --extra vllm --extra flash --extra ring --extra liger --extra qlora --locked)
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
    row "install GPU extras (README GPU uv sync)" "skipped (GPU_CHECK_SKIP_INSTALL=1)" "exit 0" "skip"
else
    log="$LOG_DIR/install.log"
    : >"$log"
    if ! command -v uv >/dev/null 2>&1; then
        PY=$(command -v python || command -v python3 || true)
        say "uv not found: ${PY:-python} -m pip install uv"
        if [ -n "$PY" ]; then
            limited 300 "$PY" -m pip install uv >>"$log" 2>&1
            scripts=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)
            export PATH="${scripts:+$scripts:}$HOME/.local/bin:$PATH"
        fi
    fi
    if ! command -v uv >/dev/null 2>&1; then
        row "install GPU extras (README GPU uv sync)" "uv missing and pip install uv failed: $(last_line "$log")" "exit 0" "NO"
        FAILED=1
    else
        say "${INSTALL_CMD[*]} (timeout ${T_INSTALL}s)"
        start=$SECONDS
        limited "$T_INSTALL" "${INSTALL_CMD[@]}" >>"$log" 2>&1
        rc=$?
        if [ "$rc" = 0 ]; then
            row "install GPU extras (README GPU uv sync)" "ok in $((SECONDS - start)) s" "exit 0" "yes"
        else
            why="exit $rc"
            [ "$rc" = 124 ] && why="timed out after ${T_INSTALL} s"
            row "install GPU extras (README GPU uv sync)" "failed ($why): $(last_line "$log")" "exit 0" "NO"
            FAILED=1
            tail_of "$log"
        fi
    fi
fi

if ! command -v uv >/dev/null 2>&1; then
    row "gpu tests" "not run: no uv" "0 failed" "NO"
    row "weightsync_gpu.py" "not run: no uv" "runs" "NO"
    row "rollout_gpu.py" "not run: no uv" "runs" "NO"
    FAILED=1
else
    # --- 2. gpu tests -------------------------------------------------------------------------------
    log="$LOG_DIR/pytest.log"
    say "uv run --no-sync pytest -m gpu -q -p no:cacheprovider (timeout ${T_TESTS}s)"
    start=$SECONDS
    limited "$T_TESTS" uv run --no-sync pytest -m gpu -q -p no:cacheprovider >"$log" 2>&1
    rc=$?
    final=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran' "$log" | tail -n 1)
    count() {
        local n
        n=$(echo "$final" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' | tail -n 1)
        echo "${n:-0}"
    }
    passed=$(count passed)
    failed=$(count failed)
    errors=$(count 'errors?')
    skipped=$(count skipped)
    result="$passed passed, $failed failed, $errors errors, $skipped skipped in $((SECONDS - start)) s"
    if [ "$rc" = 0 ] && [ "$failed" = 0 ] && [ "$errors" = 0 ] && [ "$passed" != 0 ]; then
        row "gpu tests (pytest -m gpu)" "$result" "0 failed, 0 errors" "yes"
    else
        case $rc in
            0) note="" ;;
            124 | 137) note=" (timed out after ${T_TESTS} s)" ;;
            5) note=" (no tests collected)" ;;
            *) note=" (pytest exit $rc)" ;;
        esac
        row "gpu tests (pytest -m gpu)" "$result$note" "0 failed, 0 errors" "NO"
        FAILED=1
        grep -E '^(FAILED|ERROR) ' "$log" | head -n 20
        tail_of "$log" 15
    fi

    # --- 3, 4. benchmarks ---------------------------------------------------------------------------
    # bench NAME TIMEOUT ARGS...: a crash (non-zero exit, or no rows written) is a failure
    bench() {
        local name=$1 seconds=$2
        shift 2
        local log="$LOG_DIR/${name%.py}.log" before after rc why
        before=$(wc -l <"$SUMMARY")
        say "uv run --no-sync python benchmarks/$name $* (timeout ${seconds}s)"
        limited "$seconds" uv run --no-sync python "benchmarks/$name" --summary "$SUMMARY" "$@" >"$log" 2>&1
        rc=$?
        after=$(wc -l <"$SUMMARY")
        if [ "$rc" != 0 ]; then
            FAILED=1
            why="exit $rc"
            case $rc in 124 | 137) why="timed out after $seconds s" ;; esac
            if [ "$after" = "$before" ]; then
                row "$name" "crashed ($why): $(last_line "$log")" "runs" "NO"
            else
                row "$name" "failed ($why): see the rows above" "runs" "NO"
            fi
            tail_of "$log"
        fi
    }
    bench weightsync_gpu.py "$T_WS" --timeout 90
    bench rollout_gpu.py "$T_ROLLOUT" --timeout "$T_ENGINE" --log-dir "$LOG_DIR/rollout"
fi

# --- 5. the table ------------------------------------------------------------------------------------
echo
{
    printf 'check\tresult\ttarget\tpass?\n'
    cat "$SUMMARY"
} | awk -F'\t' '
    { n = NR; for (i = 1; i <= 4; i++) { v = $i; if (length(v) > 110) v = substr(v, 1, 107) "..."; c[n, i] = v; if (length(v) > w[i]) w[i] = length(v) } }
    END {
        for (r = 1; r <= n; r++) {
            line = "|"
            for (i = 1; i <= 4; i++) line = line sprintf(" %-" w[i] "s |", c[r, i])
            print line
            if (r == 1) { sep = "|"; for (i = 1; i <= 4; i++) { d = ""; for (k = 0; k < w[i] + 2; k++) d = d "-"; sep = sep d "|" } print sep }
        }
    }'
echo
if [ "$FAILED" = 0 ]; then
    say "PASS (logs: $LOG_DIR)"
else
    say "FAIL (logs: $LOG_DIR)"
fi
exit "$FAILED"
