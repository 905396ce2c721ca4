#!/usr/bin/env bash
# The GPU checks of an offline node in one command, each step under one overall deadline.
#
#   bash bench/gpu_node.sh OUT SECONDS STEP...
#
# run from the source tree copied to the node with its bundle in offline/ (docs/cluster.md, "Offline GPU
# nodes"): for the bench and tests steps `prlmfuse bundle offline` (no checkpoint: bench/gpu.py stands in
# random weights of MiniLM's shape), for the others `--checkpoints minilm-l6 --corpus DIR --trim-embeddings`).
# It installs the bundle, unpacks its corpora, then runs the steps in the order given, each stopped when
# SECONDS (counted from the start) run out, and a step that fails does not stop the next:
#
#   bench     python bench/gpu.py, every section              -> OUT/gpu/gpu.json, OUT/gpu/gpu.log
#   bench:S   bench/gpu.py --only S (its sections, comma-separated) -> OUT/gpu-S/ (commas as '-')
#   probe     the GPU recipe (examples/results-en-ja-base.yaml) for baseline.seed-1 and fused.seed-1,
#             stopped at PROBE_UPDATES updates (default 400)    -> OUT/probe.tar.gz
#   headline  the shipped default at the paper's size (examples/default-en-ja-base.yaml): baseline,
#             default and the baseline matched to it, seed 1, three at once on the GPU, each stopped
#             at HEADLINE_UPDATES updates (default 800) or earlier by its dev loss; its training stops
#             DECODE_SECONDS (default 150) before the deadline so that test is decoded on the GPU
#             without scoring (from the checkpoints the runs have, if training was stopped there),
#             and `prlmfuse score work/headline/results` scores it where MeCab is
#                                                               -> OUT/headline.tar.gz
#   summarization  the summarization comparison at the paper's summarization width
#             (examples/summarization-compare-debian-base.yaml; the bundle must carry its corpus):
#             baseline, fused, default and the baseline matched to the default, seed 1, four at once,
#             each stopped at SUMMARIZATION_UPDATES updates (default 1000), decoded as headline is and
#             scored on the node (ROUGE needs no MeCab)
#                                                               -> OUT/summarization.tar.gz
#   demo      the shipped pipeline.yaml with --device cuda; where sacrebleu's ja-mecab tokenizer does
#             not work (no --with-ja in the bundle) its evaluate stage decodes without scoring, and
#             `prlmfuse score work/demo/results` scores the returned folder
#                                                               -> OUT/demo.tar.gz
#   tests     pytest -m cuda                                    -> OUT/pytest-cuda.txt
#
# OUT/session.txt holds the machine, each step's command with its exit status and seconds, and the
# end of each step's output; OUT/install.log the bundle's install. The tarballs hold each run's logs,
# metrics.jsonl and run.json (no weights) and the pipeline's results. bench/gpu.py exits 1 under
# --only, since the targets of the sections it leaves out count as not met. Give SECONDS a little
# under the time the node is lent for: the logs are packed after the last step stops.
set -uo pipefail
if [ $# -lt 3 ]; then
    echo "usage: bash bench/gpu_node.sh OUT SECONDS STEP... (steps: bench, bench:SECTIONS, probe, headline, summarization, demo, tests)" >&2
    exit 2
fi
out="$1"; seconds="$2"; shift 2
case "$seconds" in '' | *[!0-9]*) echo "gpu_node.sh: SECONDS must be a whole number, got '$seconds'" >&2; exit 2 ;; esac
seconds=$((10#$seconds))
whole_number() {  # NAME VALUE: refuses a setting that is not a whole number
    case "$2" in '' | *[!0-9]*) echo "gpu_node.sh: $1 must be a whole number, got '$2'" >&2; exit 2 ;; esac
}
probe_updates="${PROBE_UPDATES:-400}"; whole_number PROBE_UPDATES "$probe_updates"
headline_updates="${HEADLINE_UPDATES:-800}"; whole_number HEADLINE_UPDATES "$headline_updates"
summarization_updates="${SUMMARIZATION_UPDATES:-1000}"; whole_number SUMMARIZATION_UPDATES "$summarization_updates"
decode_seconds="${DECODE_SECONDS:-150}"; whole_number DECODE_SECONDS "$decode_seconds"
decode_seconds=$((10#$decode_seconds))
sections="grid,step,shapes,train,cache,decode,torchrun,compile,tests"  # bench/gpu.py's --only
for step in "$@"; do
    case "$step" in
    bench | probe | headline | summarization | demo | tests) ;;
    bench:*)
        IFS=, read -ra wanted <<< "${step#bench:}"
        [ ${#wanted[@]} -gt 0 ] || { echo "gpu_node.sh: '$step' names no section; bench/gpu.py's are $sections" >&2; exit 2; }
        for section in "${wanted[@]}"; do
            case ",$sections," in *",$section,"*) ;;
                *) echo "gpu_node.sh: '$step': bench/gpu.py has no section '$section'; its sections are $sections" >&2; exit 2 ;;
            esac
        done ;;
    *) echo "gpu_node.sh: unknown step '$step'; steps: bench, bench:SECTIONS, probe, headline, summarization, demo, tests" >&2; exit 2 ;;
    esac
done
[ -f offline/install.sh ] || { echo "gpu_node.sh: no offline/install.sh here; run from the source tree with its bundle in offline/" >&2; exit 2; }

export PYTHONUNBUFFERED=1
start=$(date +%s)
mkdir -p "$out"
session="$out/session.txt"
say() { echo "$*" | tee -a "$session"; }
margin=10  # seconds kept after the last step, to pack its logs
reserve=0  # seconds a command leaves for the commands of its step that follow it
left() { echo $(( seconds - margin - reserve - ($(date +%s) - start) )); }
# Runs one command under what is left of the deadline, logging it with its exit status and seconds.
timed() {
    local log="$1"; shift
    local budget; budget=$(left)
    if [ "$budget" -le 5 ]; then say "skipped (deadline): $*"; return 1; fi
    say "\$ $*"
    local t0; t0=$(date +%s)
    timeout -k 15 "$budget" "$@" > "$log" 2>&1
    local rc=$?
    say "rc $rc in $(( $(date +%s) - t0 )) s$( { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo ' (stopped at the deadline)')"
    return $rc
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; lscpu | grep "Model name"; } >> "$session" 2>&1
timed "$out/install.log" bash offline/install.sh || { tail -5 "$out/install.log" >> "$session" 2>/dev/null; exit 1; }
# install.sh installs into python3's environment, whose scripts directory may not be on PATH.
command -v prlmfuse > /dev/null || PATH="$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
checkpoint=offline/checkpoints/minilm-l6

# A pipeline file for this node: the checkpoint named by its bundled directory, the workdir under work/.
node_pipeline() {  # SOURCE WORKDIR OUTFILE CORPUS [max_updates]: CORPUS names the bundled corpus it reads
    sed -e "s#^workdir: .*#workdir: ../$2#" -e "s#minilm-l6#$checkpoint#" "$1" > "$3"
    [ -n "${5:-}" ] && sed -i "s#^\(    max_updates:\).*#\1 $5#" "$3"
    # A bundle built with --leave-out zarr: the caches are hdf5 files.
    if ! python3 -c "import zarr" 2> /dev/null; then
        if grep -q "^  backend:" "$3"; then sed -i "s#^  backend: .*#  backend: hdf5#" "$3"
        else sed -i "s#^cache:\$#cache:\n  backend: hdf5#" "$3"; fi
    fi
    mkdir -p "$2/data"
    [ -f "offline/corpus/$4.tar.gz" ] || say "no offline/corpus/$4.tar.gz: the data stage must build $4 on this node"
    for c in offline/corpus/*.tar.gz; do if [ -f "$c" ]; then tar -xzf "$c" -C "$2/data"; fi; done
}
pack() {  # WORKDIR TARBALL FILE...: each run's logs, metrics and run.json, and those of the files that exist
    local workdir="$1" tarball="$2" kept=() f; shift 2
    for f in "$@" "$workdir"/runs/*/ "$workdir"/results; do [ -e "$f" ] && kept+=("$f"); done
    [ ${#kept[@]} -gt 0 ] && tar -czf "$tarball" --exclude='*.safetensors' --exclude='checkpoints' "${kept[@]}" 2>> "$session"
}

# One comparison on the GPU from offline/NAME.yaml (workdir work/NAME): cache, train (stopped DECODE_SECONDS
# before the deadline), decode test from what was saved, then pack. NAME RUNS [evaluate's extra flags].
compare_on_gpu() {
    local name="$1" runs="$2" rc; shift 2
    timed "work/$name/cache.log" prlmfuse run "offline/$name.yaml" --runs "$runs" --device cuda --only cache &&
        { reserve=$decode_seconds; timed "work/$name/train.log" prlmfuse run "offline/$name.yaml" --runs "$runs" --device cuda --only train
          rc=$?; reserve=0
          # Stopped at its deadline (timeout's 124 or 137), each run has saved what it trained: decode that.
          { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && say "training stopped at the deadline: test is decoded from the checkpoints the runs have"
          [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ $rc -eq 137 ]; } &&
        timed "work/$name/decode.log" prlmfuse run "offline/$name.yaml" --runs "$runs" --device cuda --only evaluate "$@"
    tail -4 "work/$name/train.log" "work/$name/decode.log" >> "$session" 2>/dev/null
    pack "work/$name" "$out/$name.tar.gz" "offline/$name.yaml" "work/$name"/*.log
}

for step in "$@"; do
    say "== $step (at $(( $(date +%s) - start )) s)"
    case "$step" in
    bench | bench:*)
        if [ "$step" = bench ]; then only=(); dir="$out/gpu"; else only=(--only "${step#bench:}"); dir="$out/gpu-$(echo "${step#bench:}" | tr , -)"; fi
        timed /tmp/gpu_node-bench.txt python3 bench/gpu.py --out "$dir" --minilm "$checkpoint" ${only[@]+"${only[@]}"}
        grep -v '^  \[' /tmp/gpu_node-bench.txt | grep -v '^RESULT' | tail -30 >> "$session"
        ;;
    probe)
        node_pipeline examples/results-en-ja-base.yaml work/probe offline/probe.yaml bible-en-ja "$probe_updates"
        timed work/probe/cache.log prlmfuse run offline/probe.yaml --runs baseline.seed-1,fused.seed-1 --only cache &&
            timed work/probe/pipeline.log prlmfuse run offline/probe.yaml --runs baseline.seed-1,fused.seed-1 --only train
        tail -3 work/probe/pipeline.log >> "$session" 2>/dev/null
        pack work/probe "$out/probe.tar.gz" offline/probe.yaml work/probe/cache.log work/probe/pipeline.log
        ;;
    headline)
        node_pipeline examples/default-en-ja-base.yaml work/headline offline/headline.yaml bible-en-ja "$headline_updates"
        compare_on_gpu headline baseline,default,baseline-matched-default --no-score
        ;;
    summarization)
        node_pipeline examples/summarization-compare-debian-base.yaml work/summarization offline/summarization.yaml \
            debian-descriptions "$summarization_updates"
        compare_on_gpu summarization baseline,fused,default,baseline-matched-default
        ;;
    demo)
        node_pipeline pipeline.yaml work/demo offline/demo.yaml bible-en-ja
        if python3 -c "import sacrebleu; sacrebleu.BLEU(tokenize='ja-mecab')" 2> /dev/null; then
            timed work/demo/run.log prlmfuse run offline/demo.yaml --device cuda
        else
            say "no MeCab with its dictionary here (sacrebleu's ja-mecab): the demo decodes without scoring"
            timed work/demo/cache.log prlmfuse run offline/demo.yaml --device cuda --only cache &&
                timed work/demo/run.log prlmfuse run offline/demo.yaml --device cuda --only train &&
                timed work/demo/decode.log prlmfuse run offline/demo.yaml --device cuda --only evaluate --no-score
            tail -3 work/demo/decode.log >> "$session" 2>/dev/null
        fi
        tail -12 work/demo/run.log >> "$session" 2>/dev/null
        pack work/demo "$out/demo.tar.gz" offline/demo.yaml work/demo/*.log
        ;;
    tests)
        timed "$out/pytest-cuda.txt" python3 -m pytest -v -m cuda tests/ -p no:cacheprovider
        tail -3 "$out/pytest-cuda.txt" >> "$session"
        ;;
    esac
done
say "done in $(( $(date +%s) - start )) s"
