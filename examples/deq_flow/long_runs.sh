#!/usr/bin/env bash
# Start, or resume, issue #32's long runs: DEQ-Flow and its explicit RAFT twin under one recipe (README.md,
# "Long runs (issue #32)"). Run from the repository root, every session, unchanged:
#     bash examples/deq_flow/long_runs.sh            # RUNS=runs/deq_flow, PYTHON=python by default
#     PAIR=size128 RUNS=runs/size128 bash examples/deq_flow/long_runs.sh   # the 128x128 pair (README)
#     PAIR=steps12 RUNS=runs/steps12 bash examples/deq_flow/long_runs.sh   # the 12-step recipe, 20,000 steps
# Each run is a background process at nice 19 in its own autogroup (it takes idle CPU only), 1 thread, its
# pid in RUNS/NAME.pid and its output appended to RUNS/NAME.log; train.py resumes from RUNS/NAME/checkpoint
# and refuses other options than the run's first start (RUNS/NAME/run.json). A run whose recorded pid is
# still alive is left alone, so that two processes never write one folder.
set -euo pipefail
RUNS=${RUNS:-runs/deq_flow}  # outside git's view: runs/ is in .gitignore
PYTHON=${PYTHON:-python}
PAIR=${PAIR:-i32}
case $PAIR in
    i32)  # the 20,000-step runs at 64x64, the original's recipe scaled down
        COMMON=(--steps 20000 --seed 0 --batch-size 8 --size 64 64 --lr 4e-4 --keep-every 250 --save-every 50)
        DEQ=(deq-flow-i32 --model deq-flow-cpu-synth --deq '{"n_states": 6}')
        TWIN=(raft-i32 --model deq-flow-cpu-raft-baseline) ;;
    size128)  # 4,000 steps at 128x128 (a 16x16 grid at 1/8 resolution), DEQ-Flow with the drift term
        COMMON=(--steps 4000 --seed 0 --batch-size 8 --size 128 128 --lr 4e-4 --keep-every 250 --save-every 50)
        DEQ=(deq-flow --model deq-flow-cpu-synth --deq '{"n_states": 6}' --flow-residual-weight 0.5)
        TWIN=(raft --model deq-flow-cpu-raft-baseline) ;;
    steps12)  # 20,000 steps at 64x64, DEQ-Flow with the closest 4,000-step probe's recipe (drift 0.5, 12 steps)
        COMMON=(--steps 20000 --seed 0 --batch-size 8 --size 64 64 --lr 4e-4 --keep-every 250 --save-every 50)
        DEQ=(deq-flow --model deq-flow-cpu-synth --deq '{"n_states": 6, "f_max_iter": 12}' --flow-residual-weight 0.5)
        TWIN=(raft --model deq-flow-cpu-raft-baseline) ;;
    *) echo "PAIR must be i32, size128 or steps12, got $PAIR" >&2; exit 2 ;;
esac
mkdir -p "$RUNS"

start() {  # NAME, then the model's own train.py options
    local name=$1 pid
    shift
    if [[ -f $RUNS/$name/summary.json ]]; then
        echo "$name: finished ($RUNS/$name/model)"
        return
    fi
    if [[ -f $RUNS/$name.pid ]] && pid=$(cat "$RUNS/$name.pid") && [[ -r /proc/$pid/cmdline ]] \
        && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "--out $RUNS/$name "; then
        echo "$name: already running as pid $pid"
        return
    fi
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=$PWD setsid nohup nice -n 19 "$PYTHON" \
        examples/deq_flow/train.py --out "$RUNS/$name" "$@" "${COMMON[@]}" >> "$RUNS/$name.log" 2>&1 < /dev/null &
    sleep 1
    pid=$(pgrep -n -f -- "--out $RUNS/$name ")  # not $!: that can move this shell's own autogroup
    echo 19 > "/proc/$pid/autogroup"
    echo "$pid" > "$RUNS/$name.pid"
    echo "$name: pid $pid, $(cat "/proc/$pid/autogroup"), log $RUNS/$name.log"
}

start "${DEQ[@]}"
start "${TWIN[@]}"
echo "this shell: $(cat /proc/$$/autogroup)"
