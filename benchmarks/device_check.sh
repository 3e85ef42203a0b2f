#!/usr/bin/env bash
# The device check (issue 16): on a machine with an NVIDIA GPU, in at most 8 minutes, run in order
#   1. tests        the suite's CUDA-marked tests (python -m pytest -m cuda -q -n 0: in one process, on the one device)
#   2. generate     mar-probe generate --model mar_base (random weights) once per registered strategy, then
#      strategies   benchmarks/bench_strategies.py: every strategy's speed-up over full (mar_base, few steps)
#   3. record       benchmarks/bench_record.py --device cuda: recording throughput vs the disk's raw write speed
#   4. torchrun     a 2-process torchrun record (mar_tiny), then mar-probe verify of its store
# after describing the machine (nvidia-smi, lscpu, torch, the CUDA device). Every step is timed, its exit code
# recorded and its output kept in logs/; a failing step is reported and the script goes on; the exit code is 1
# when any step failed. Each step runs under `timeout`, capped by what is left of the whole run's budget.
#
# Results in the output folder: summary.md, device_check.json (steps, speed-ups, recording throughput, machine),
# machine.txt, steps.tsv, logs/<step>.log and what the steps wrote (generate/, strategies/, record*.json).
#
#   bash benchmarks/device_check.sh                          # on the GPU machine -> benchmarks/results/device_check/
#   bash benchmarks/device_check.sh --device cpu             # dry run on a CPU machine (about 1-2 minutes)
#   bash benchmarks/device_check.sh --only tests,torchrun    # some steps only
#
# --device cpu is a dry run so that the script cannot rot: the same steps, each shrunk to the least that still
# exercises it (the cuda-marked tests are collected and skip, mar_tiny instead of mar_base, a few steps), on the CPU;
# its default folder is benchmarks/results/device_check_cpu/ so that it never overwrites a GPU machine's results.
set -u

usage() {
    cat <<'EOF'
usage: bash benchmarks/device_check.sh [--device cuda|cpu] [--out DIR] [--python PATH] [--only STEPS]
                                       [--budget SECONDS]

  --device cuda|cpu  cuda (default): the device check on a GPU machine (at most 8 minutes);
                     cpu: a dry run of the same steps, shrunk, on a CPU machine
  --out DIR          results folder (default: benchmarks/results/device_check, or device_check_cpu with --device cpu)
  --python PATH      the Python interpreter with mar_probe installed (default: python on PATH)
  --only STEPS       comma-separated steps to run, of: machine, tests, generate, strategies, record, torchrun
                     (default: all)
  --budget SECONDS   wall-clock budget of the whole run; each step's timeout is capped by what is left
                     (default: 460 with --device cuda, 240 with --device cpu)
EOF
}

die() { echo "device_check.sh: error: $*" >&2; echo "run with --help for the flags" >&2; exit 2; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE=cuda
OUT=""
PYTHON="${PYTHON:-$(command -v python || command -v python3 || echo python)}"
ONLY=""
BUDGET=""
GROUPS_ALL="machine tests generate strategies record torchrun"

while [ $# -gt 0 ]; do
    case "$1" in
        --device) [ $# -ge 2 ] || die "--device needs a value: cuda or cpu"; DEVICE="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT="$2"; shift 2 ;;
        --python) [ $# -ge 2 ] || die "--python needs a path"; PYTHON="$2"; shift 2 ;;
        --only) [ $# -ge 2 ] || die "--only needs a comma-separated list of steps"; ONLY="$2"; shift 2 ;;
        --budget) [ $# -ge 2 ] || die "--budget needs a number of seconds"; BUDGET="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1'" ;;
    esac
done

case "$DEVICE" in
    cuda|cpu) ;;
    *) die "unknown device '$DEVICE'; expected 'cuda' or 'cpu'" ;;
esac
if [ -n "$ONLY" ]; then
    for g in ${ONLY//,/ }; do
        case " $GROUPS_ALL " in
            *" $g "*) ;;
            *) die "unknown step '$g' in --only; expected some of: ${GROUPS_ALL// /, }" ;;
        esac
    done
fi
if [ -z "$BUDGET" ]; then
    if [ "$DEVICE" = cuda ]; then BUDGET=460; else BUDGET=240; fi
fi
case "$BUDGET" in
    ''|*[!0-9]*) die "--budget must be a whole number of seconds, got '$BUDGET'" ;;
esac
[ "$BUDGET" -ge 10 ] || die "--budget must be at least 10 seconds, got '$BUDGET'"

if [ -z "$OUT" ]; then
    if [ "$DEVICE" = cuda ]; then OUT="$ROOT/benchmarks/results/device_check"
    else OUT="$ROOT/benchmarks/results/device_check_cpu"; fi
fi
mkdir -p "$OUT" || die "cannot create the output folder '$OUT'"
OUT="$(cd "$OUT" && pwd)"
# what this script writes (and nothing else) is replaced: no stale result survives a rerun
rm -rf "$OUT/logs" "$OUT/generate" "$OUT/strategies" "$OUT/scratch" "$OUT/torchrun.zarr"
rm -f "$OUT/steps.tsv" "$OUT/summary.md" "$OUT/device_check.json" "$OUT/machine.txt" "$OUT/machine.json" \
      "$OUT/machine.md" "$OUT"/record*.json "$OUT/record_summary.json" "$OUT/record_summary.md"
mkdir -p "$OUT/logs"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # one torch thread per process (shared CPUs; GPU work needs none)
export PYTHONUNBUFFERED=1
export MPLBACKEND=Agg
cd "$ROOT" || die "cannot enter the repository '$ROOT'"

# ---- per-device settings: the GPU run, and the dry run shrunk to the minimum -------------------------------------
if [ "$DEVICE" = cuda ]; then
    GEN_ARGS=(--model mar_base --device cuda --threads 1 --num-samples 4 --num-iter 16 --num-sampling-steps 25
              --cfg 3.0)
    BENCH_STRATEGIES=(--preset mar_base --strategies all --rounds 2 --num-iter 32 --num-sampling-steps 50 --cfg 3.0
                      --device cuda --threads 1)
    BENCH_RECORD=(--device cuda --num-iter 16 --full-samples 2 --num-samples 2 --base-samples 1 --rounds 2
                  --base-rounds 2 --codec-steps 2 --raw-mib 256)
    TORCHRUN_ARGS=(--num-samples 8 --num-iter 8 --batch-size 2)
    LIMIT_MACHINE=60; LIMIT_TESTS=150; LIMIT_GENERATE=150; LIMIT_STRATEGIES=150; LIMIT_RECORD=150
    LIMIT_TORCHRUN=90; LIMIT_VERIFY=45
else
    GEN_ARGS=(--model mar_tiny --device cpu --threads 1 --num-samples 1 --num-iter 2 --num-sampling-steps 2
              --cfg 3.0)
    BENCH_STRATEGIES=(--tiny --strategies all --rounds 2 --device cpu --threads 1)
    BENCH_RECORD=(--tiny --device cpu)
    TORCHRUN_ARGS=(--num-samples 2 --num-iter 4 --batch-size 1)
    LIMIT_MACHINE=30; LIMIT_TESTS=90; LIMIT_GENERATE=90; LIMIT_STRATEGIES=90; LIMIT_RECORD=90
    LIMIT_TORCHRUN=90; LIMIT_VERIFY=30
fi

# ---- the step runner ---------------------------------------------------------------------------------------------
START_NS=$(date +%s%N)
FAILED=0
STEPS_TSV="$OUT/steps.tsv"
printf 'step\tstatus\trc\tseconds\tlimit_s\tlog\tdetail\n' > "$STEPS_TSV"

selected() {   # is the step group $1 among --only (everything when --only is not given)?
    [ -z "$ONLY" ] && return 0
    case ",$ONLY," in *",$1,"*) return 0 ;; esac
    return 1
}

seconds_since() {   # seconds (3 decimals) since the nanosecond time $1
    local ms=$(( ($(date +%s%N) - $1) / 1000000 ))
    printf '%d.%03d' $((ms / 1000)) $((ms % 1000))
}

last_line() {   # the last non-empty line of a log, printable ASCII only (progress bars end lines with \r)
    [ -f "$1" ] || return 0
    tail -c 4000 "$1" | tr '\r' '\n' | LC_ALL=C tr -cd '\11\12\40-\176' | grep -v '^[[:space:]]*$' | tail -n 1 |
        cut -c 1-200
}

add_row() {   # name status rc seconds limit log detail
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$6" "${7//$'\t'/ }" >> "$STEPS_TSV"
    printf '[device_check] %-28s %-8s rc=%-4s %8ss  %s\n' "$1" "$2" "$3" "$4" "$7"
}

run_step() {   # run_step NAME LIMIT_SECONDS COMMAND...: one timed step under timeout; its row in steps.tsv
    local name=$1 limit=$2 log status rc t0 secs left a
    shift 2
    log="$OUT/logs/${name//:/_}.log"
    left=$(( BUDGET - ($(date +%s%N) - START_NS) / 1000000000 ))
    if [ "$left" -lt 5 ]; then
        add_row "$name" skipped 124 0.000 0 "$log" "not run: the ${BUDGET} s budget is spent"
        FAILED=$((FAILED + 1))
        return 124
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    t0=$(date +%s%N)
    {   # the command, first line of the log (an inline Python program shown by its first line)
        printf '$'
        for a in "$@"; do
            if [ "${#a}" -gt 160 ]; then printf ' <%s ...>' "$(head -n 1 <<< "$a" | cut -c 1-80)"; else printf ' %q' "$a"; fi
        done
        printf '\n'
    } > "$log"
    timeout --kill-after=10 "$limit" "$@" < /dev/null >> "$log" 2>&1
    rc=$?
    secs=$(seconds_since "$t0")
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=FAIL ;;
    esac
    if [ "$rc" -ne 0 ]; then
        FAILED=$((FAILED + 1))
        echo "[device_check] $name failed (rc $rc); the end of ${log#"$ROOT"/}:" >&2
        tail -n 15 "$log" | tr '\r' '\n' | tail -n 15 >&2
    fi
    if [ "$status" = timeout ]; then
        add_row "$name" "$status" "$rc" "$secs" "$limit" "$log" "killed after ${limit} s; $(last_line "$log")"
    else
        add_row "$name" "$status" "$rc" "$secs" "$limit" "$log" "$(last_line "$log")"
    fi
    return "$rc"
}

# ---- the Python pieces (stdlib + mar_probe; each writes its JSON atomically) ------------------------------------
IFS= read -r -d '' MACHINE_PY <<'PY'
import json, os, platform, sys
import torch
from mar_probe.machine import machine
out, want = sys.argv[1], sys.argv[2]
m = machine()
cuda = torch.cuda.is_available()
m.update(python_executable=sys.executable, torch_cuda=torch.version.cuda, cuda_available=cuda,
         cudnn=torch.backends.cudnn.version() if cuda else None, platform=platform.platform(),
         cuda_devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [])
if cuda:
    p = torch.cuda.get_device_properties(0)
    m.update(cuda_capability=f"{p.major}.{p.minor}", cuda_memory_gib=round(p.total_memory / 2**30, 1))
tmp = os.path.join(out, "machine.json.tmp")
with open(tmp, "w") as f:
    json.dump(m, f, indent=2)
os.replace(tmp, os.path.join(out, "machine.json"))
gpu = ", ".join(m["cuda_devices"]) or "none visible to torch"
with open(os.path.join(out, "machine.md"), "w") as f:
    f.write(f"- host {m['host']}, {m['cpu']} ({m['cores']} cores), Python {m['python']}\n"
            f"- torch {m['torch']} (CUDA build: {m['torch_cuda']}), torch.cuda.get_device_name: {gpu}\n")
print(json.dumps(m, indent=2))
print(f"torch {m['torch']}, CUDA build {m['torch_cuda']}, devices: {gpu}; {m['cpu']} ({m['cores']} cores)")
if want == "cuda" and not cuda:
    sys.exit(f"--device cuda, but torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
             f"{torch.version.cuda!r}); install a CUDA build of torch (docs/device-check.md) or use --device cpu")
PY

IFS= read -r -d '' GENERATE_PY <<'PY'
"""mar-probe generate (the CLI's own main) once per registered strategy, in one process: the imports and CUDA
start-up are paid once. One line per strategy: GENERATE <name> <exit code> <seconds>."""
import sys, time, traceback
from mar_probe import strategies
from mar_probe.cli import main
out, args = sys.argv[1], sys.argv[2:]
names = strategies.available()
print("strategies:", ",".join(names), flush=True)
failed = 0
for name in names:
    t0 = time.perf_counter()
    try:
        rc = main(["generate", *args, "--strategy", name, "--out", f"{out}/{name}"])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        rc = 1
    failed += rc != 0
    print(f"GENERATE\t{name}\t{rc}\t{time.perf_counter() - t0:.3f}", flush=True)
print(f"generate: {len(names) - failed} of {len(names)} strategies exited 0", flush=True)
sys.exit(f"{failed} of {len(names)} strategies failed" if failed else 0)
PY

IFS= read -r -d '' SPEEDUPS_PY <<'PY'
"""Each strategy's speed-up over full from bench_strategies' JSON -> strategies/speedups.json and .md."""
import glob, json, math, os, sys
folder = sys.argv[1]
found = sorted(glob.glob(os.path.join(folder, "strategies_*.json")))
if len(found) != 1:
    sys.exit(f"expected one strategies_*.json in {folder!r}, found {found!r}")
payload = json.load(open(found[0]))
rows, bad = {}, []
for label, r in payload["results"].items():
    rows[label] = {"end_to_end": r["speedup"]["end_to_end"], "end_to_end_median": r["speedup_median"]["end_to_end"],
                   "transformer": r["speedup"]["transformer"], "flop_ratio": r["flop_ratio"]["end_to_end"],
                   "seconds": r["seconds"]["end_to_end"], "steps": r["steps"]}
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
               for k, v in rows[label].items() if k != "steps"):
        bad.append(label)
s = payload["settings"]
out = {"source": os.path.basename(found[0]), "settings": s, "speedups": rows}
tmp = os.path.join(folder, "speedups.json.tmp")
with open(tmp, "w") as f:
    json.dump(out, f, indent=2)
os.replace(tmp, os.path.join(folder, "speedups.json"))
lines = [f"{s['preset']} (random weights), batch {s['batch']}, {s['num_iter']} steps, {s['num_sampling_steps']} "
         f"diffusion steps, CFG {s['cfg']}, {s['rounds']} rounds, device {s['device']}:", "",
         "| strategy | best s | speed-up end to end (best / median) | speed-up transformer | FLOP ratio |",
         "|---|---:|---:|---:|---:|"]
for label, r in rows.items():
    lines.append(f"| {label} | {r['seconds']:.3f} | {r['end_to_end']:.2f}x / {r['end_to_end_median']:.2f}x | "
                 f"{r['transformer']:.2f}x | {r['flop_ratio']:.2f}x |")
with open(os.path.join(folder, "speedups.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("; ".join(f"{k} {v['end_to_end']:.2f}x" for k, v in rows.items()))
if bad:
    sys.exit(f"speed-ups that are not positive finite numbers: {bad!r}")
PY

IFS= read -r -d '' RECORD_PY <<'PY'
"""Recording throughput vs raw disk speed per model from bench_record's JSON -> record_summary.json and .md."""
import glob, json, os, sys
folder = sys.argv[1]
found = sorted(glob.glob(os.path.join(folder, "record*.json")))
found = [f for f in found if not f.endswith("record_summary.json")]
if len(found) != 1:
    sys.exit(f"expected one record*.json in {folder!r}, found {found!r}")
payload = json.load(open(found[0]))
rows = {}
for m in payload["models"]:
    f, light = m["full"], m["light"]
    raw = sum(f["raw_write_bytes_per_s"].values()) / len(f["raw_write_bytes_per_s"])
    rows[m["model"]] = {"preset": m["preset"], "logical_mib_per_s": f["logical_bytes_per_s"] / 2**20,
                        "raw_disk_mib_per_s": raw / 2**20, "fraction_of_raw_disk": f["fraction_of_raw_disk"],
                        "compression_ratio": f["compression_ratio"], "light_overhead_median": light["overhead_median"],
                        "num_iter": m["num_iter"]}
out = {"source": os.path.basename(found[0]), "device": payload["settings"]["device"], "models": rows}
tmp = os.path.join(folder, "record_summary.json.tmp")
with open(tmp, "w") as fh:
    json.dump(out, fh, indent=2)
os.replace(tmp, os.path.join(folder, "record_summary.json"))
lines = [f"device {out['device']} (bench_record.py; goals: >= 50% of raw disk, light overhead <= 1.1x):", "",
         "| model | steps | full capture MiB/s | raw disk MiB/s | fraction of raw | compression | light overhead |",
         "|---|---:|---:|---:|---:|---:|---:|"]
for name, r in rows.items():
    lines.append(f"| {name} ({r['preset']}) | {r['num_iter']} | {r['logical_mib_per_s']:.1f} | "
                 f"{r['raw_disk_mib_per_s']:.0f} | {r['fraction_of_raw_disk']:.1%} | {r['compression_ratio']:.2f}x | "
                 f"{r['light_overhead_median']:.2f}x |")
with open(os.path.join(folder, "record_summary.md"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
print("; ".join(f"{k} {v['logical_mib_per_s']:.1f} MiB/s = {v['fraction_of_raw_disk']:.1%} of raw disk"
                for k, v in rows.items()))
PY

describe_machine() {   # machine.txt: what the machine is; machine.json/.md: torch's view of it (the Python part)
    local out=$1 python=$2 device=$3 rc=0
    {
        echo "# device check machine description, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo; echo "## uname"; uname -a
        echo; echo "## nvidia-smi"
        if command -v nvidia-smi >/dev/null 2>&1; then
            nvidia-smi 2>&1
            nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1
        else
            echo "nvidia-smi not found"
        fi
        echo; echo "## lscpu"; lscpu 2>&1 || echo "lscpu not found"
        echo; echo "## memory"; free -g 2>&1 || true
        echo; echo "## disk of the output folder"; df -h "$out" 2>&1 || true
        echo; echo "## python and torch ($python)"
    } > "$out/machine.txt"
    "$python" -c "$MACHINE_PY" "$out" "$device" >> "$out/machine.txt" 2>&1 || rc=$?
    cat "$out/machine.txt"
    return "$rc"
}
export -f describe_machine
export MACHINE_PY

# ---- the steps ---------------------------------------------------------------------------------------------------
echo "[device_check] device $DEVICE$([ "$DEVICE" = cpu ] && echo ' (dry run)'), python $PYTHON, budget ${BUDGET} s, out $OUT"

if selected machine; then
    run_step machine "$LIMIT_MACHINE" bash -c 'describe_machine "$@"' _ "$OUT" "$PYTHON" "$DEVICE"
fi

if selected tests; then
    run_step tests "$LIMIT_TESTS" "$PYTHON" -m pytest -m cuda -q -n 0 -p no:cacheprovider --junitxml "$OUT/logs/tests.xml"
fi

if selected generate; then
    mkdir -p "$OUT/generate"
    run_step generate "$LIMIT_GENERATE" "$PYTHON" -c "$GENERATE_PY" "$OUT/generate" "${GEN_ARGS[@]}"
    # one row per strategy, from the driver's GENERATE lines (name, exit code, seconds)
    while IFS=$'\t' read -r _ name rc secs; do
        if [ "$rc" = 0 ]; then status=ok; else status=FAIL; FAILED=$((FAILED + 1)); fi
        detail="no output"
        [ -f "$OUT/generate/$name/samples.npz" ] && detail="wrote generate/$name/samples.npz"
        add_row "generate:$name" "$status" "$rc" "$secs" - "$OUT/logs/generate.log" "$detail"
    done < <(grep -a '^GENERATE	' "$OUT/logs/generate.log" 2>/dev/null)
fi

if selected strategies; then
    mkdir -p "$OUT/strategies"
    run_step strategies "$LIMIT_STRATEGIES" "$PYTHON" benchmarks/bench_strategies.py "${BENCH_STRATEGIES[@]}" \
        --out "$OUT/strategies" --tag device_check
    run_step strategies:speedups 30 "$PYTHON" -c "$SPEEDUPS_PY" "$OUT/strategies"
fi

if selected record; then
    # bench_record writes results/<--out>.json: an absolute --out puts it here (pathlib joins onto the absolute path)
    run_step record "$LIMIT_RECORD" "$PYTHON" benchmarks/bench_record.py "${BENCH_RECORD[@]}" \
        --scratch "$OUT/scratch" --out "$OUT/record"
    rm -rf "$OUT/scratch"
    run_step record:throughput 30 "$PYTHON" -c "$RECORD_PY" "$OUT"
fi

if selected torchrun; then
    # each rank records its part on cuda:LOCAL_RANK (CUDA) or the CPU (gloo); then the whole store must verify
    run_step torchrun "$LIMIT_TORCHRUN" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m mar_probe record --model mar_tiny --device "$DEVICE" --threads 1 "${TORCHRUN_ARGS[@]}" --cfg 2.0 \
        --out "$OUT/torchrun.zarr"
    run_step torchrun:verify "$LIMIT_VERIFY" "$PYTHON" -m mar_probe.cli verify "$OUT/torchrun.zarr"
fi

# ---- summary.md and device_check.json (written by bash: they must exist even when Python is broken) -------------
TOTAL=$(seconds_since "$START_NS")
NSTEPS=$(( $(wc -l < "$STEPS_TSV") - 1 ))

json_str() {   # a JSON string of $1 (printable ASCII; backslashes, quotes and tabs escaped)
    local s
    s=$(printf '%s' "$1" | LC_ALL=C tr -cd '\11\40-\176')
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/\\t}
    printf '"%s"' "$s"
}

json_num() {   # $1 if it is a number, else null
    case "$1" in
        ''|-|*[!0-9.-]*) printf 'null' ;;
        *) printf '%s' "$1" ;;
    esac
}

json_file() {   # the contents of a JSON file the steps wrote, or null when it is missing or empty
    if [ -s "$1" ]; then cat "$1"; else printf 'null'; fi
}

{
    echo "# Device check ($DEVICE$([ "$DEVICE" = cpu ] && echo ', dry run'))"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M:%S UTC'), ${TOTAL} s wall in all (budget ${BUDGET} s), python \`$PYTHON\`."
    if [ "$FAILED" -eq 0 ]; then
        echo "**All $NSTEPS steps passed.**"
    else
        echo "**$FAILED of $NSTEPS steps failed:** $(awk -F'\t' 'NR > 1 && $2 != "ok" {printf "%s%s", sep, $1; sep=", "}' "$STEPS_TSV")."
    fi
    echo
    echo "## Machine"
    echo
    if [ -s "$OUT/machine.md" ]; then cat "$OUT/machine.md"; fi
    if [ -f "$OUT/machine.txt" ]; then
        gpu=$(grep -A1 '^name, driver_version' "$OUT/machine.txt" | tail -n 1)
        cpu=$(grep -m1 '^Model name' "$OUT/machine.txt" | sed 's/^Model name:[[:space:]]*//')
        echo "- nvidia-smi: ${gpu:-none}; lscpu: ${cpu:-unknown} (the whole description: machine.txt)"
    fi
    echo
    echo "## Steps"
    echo
    echo "| step | status | exit code | seconds | limit s | detail |"
    echo "|---|---|---:|---:|---:|---|"
    awk -F'\t' 'NR > 1 {d = $7; gsub(/\|/, "\\|", d); printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, d}' \
        "$STEPS_TSV"
    echo
    echo "Logs: logs/<step>.log (the first line of each is its command)."
    if [ "$DEVICE" = cuda ] && selected torchrun; then
        ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
        [ "${ngpu:-0}" -lt 2 ] && echo "Note: ${ngpu:-0} GPU(s) listed by nvidia-smi; the torchrun ranks run on" \
            "cuda:LOCAL_RANK, so rank 1 needs a second GPU (cuda:1)."
    fi
    if [ -s "$OUT/strategies/speedups.md" ]; then
        echo; echo "## Speed-ups over full"; echo; cat "$OUT/strategies/speedups.md"
    fi
    if [ -s "$OUT/record_summary.md" ]; then
        echo; echo "## Recording throughput"; echo; cat "$OUT/record_summary.md"
    fi
} > "$OUT/summary.md"

{
    printf '{\n  "device": %s,\n  "dry_run": %s,\n' "$(json_str "$DEVICE")" "$([ "$DEVICE" = cpu ] && echo true || echo false)"
    printf '  "python": %s,\n  "budget_s": %s,\n  "seconds": %s,\n' "$(json_str "$PYTHON")" "$BUDGET" "$TOTAL"
    printf '  "date": %s,\n  "failed": %s,\n  "passed": %s,\n' "$(json_str "$(date -u '+%Y-%m-%d %H:%M:%S UTC')")" \
        "$FAILED" "$([ "$FAILED" -eq 0 ] && echo true || echo false)"
    printf '  "steps": ['
    sep=""
    while IFS=$'\t' read -r name status rc secs limit log detail; do
        printf '%s\n    {"name": %s, "status": %s, "rc": %s, "seconds": %s, "limit_s": %s, "log": %s, "detail": %s}' \
            "$sep" "$(json_str "$name")" "$(json_str "$status")" "$(json_num "$rc")" "$(json_num "$secs")" \
            "$(json_num "$limit")" "$(json_str "${log#"$OUT"/}")" "$(json_str "$detail")"
        sep=","
    done < <(tail -n +2 "$STEPS_TSV")
    printf '\n  ],\n  "speedups": '
    json_file "$OUT/strategies/speedups.json"
    printf ',\n  "record": '
    json_file "$OUT/record_summary.json"
    printf ',\n  "machine": '
    json_file "$OUT/machine.json"
    printf '\n}\n'
} > "$OUT/device_check.json"

echo "[device_check] $((NSTEPS - FAILED)) of $NSTEPS steps passed in ${TOTAL} s; see ${OUT}/summary.md"
[ "$FAILED" -eq 0 ]
