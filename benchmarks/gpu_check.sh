#!/usr/bin/env bash
# One check on a machine with a GPU (the project's first run on one): the swarm's demo
# with its peers on the GPU and its exactness against `train --reference` (on the CPU),
# then pipeline.py's full mode on the CPU alone (CUDA_VISIBLE_DEVICES=) for figures from
# a quiet many-core machine. Run from the tree, with no pip install of the project:
#
#   bash benchmarks/gpu_check.sh [SECONDS]    # the whole run's budget (default 300)
#
# The wheels of hivemind and of every dependency the machine lacks lie in .whl/
# (ignored by git; cp312, manylinux x86_64; see docs/benchmarks.md), made where pip
# reaches an index (the versions of .venv's `pip freeze`; no `==` shown here):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 --platform any -d .whl hivemind==1.1.12 base58 blake3 cffi pycparser \
#     cryptography dill mmh3 multiaddr protobuf py-multihash py-cid py-multibase py-multicodec morphys \
#     pydantic pydantic_core annotated-types typing-inspection typing_extensions netaddr ConfigArgParse
#   pip wheel --no-deps -w .whl prefetch_generator python-baseconv varint    # sdists only
# Logs and JSON lines go to $OUT
# (default /tmp/gpu_check), each part under its own time limit, so a part that hangs
# or fails leaves the others their time. GPU_CHECK_STEPS sets the demo's steps (40),
# GPU_CHECK_PARTS the parts to run (default "demo pipeline"; also "gpu_pipeline").
# The anchor's quiet-machine figures alone (issue 31: pipelining_tokens_per_s,
# swarm_vs_pipelining, spot_check_cost), pipeline.py's full mode on the CPU and nothing else:
#   GPU_CHECK_PARTS=pipeline bash benchmarks/gpu_check.sh 240
# its JSON in $OUT/pipeline_cpu.json, its log in $OUT/pipeline_cpu.err; a run cut short by
# its limit leaves the JSON empty, and the figures each part logged as it ended are in
# $OUT/pipeline_cpu.figures (the load average before and after is in the output).
set -u
BUDGET=${1:-300}
START=$SECONDS
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu_check}
SITE=/tmp/site
STEPS=${GPU_CHECK_STEPS:-40}
PARTS=${GPU_CHECK_PARTS:-"demo pipeline"}
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
left() { echo $((BUDGET - (SECONDS - START))); }
say() { echo "== $(date -u +%H:%M:%S) [+$((SECONDS - START))s] $*"; }

say "installing the wheels to $SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl || exit 1
chmod +x "$SITE/hivemind/hivemind_cli/p2pd"
# every Python process sees $SITE ahead of the image's own packages (its protobuf, say), the
# zygote and peers the demo and the benchmarks start too (they set PYTHONPATH to the tree alone)
PURE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! echo "import sys; sys.path.insert(next((i for i, p in enumerate(sys.path) if p.endswith('-packages')), len(sys.path)), '$SITE')" >"$PURE/00-fusionllm-site.pth"; then
    say "$PURE is not writable: installing into the interpreter's own packages instead"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$ROOT"/.whl/*.whl || exit 1
fi
export PYTHONPATH=$ROOT
# the `fusionllm` command, from the tree
mkdir -p "$WORK/bin"
printf '#!/bin/sh\nexec python3 -m fusionllm "$@"\n' >"$WORK/bin/fusionllm"
chmod +x "$WORK/bin/fusionllm"
export PATH=$WORK/bin:$PATH

say "the machine"
nvidia-smi -L
nproc
uptime
python3 -c 'import sys, torch, hivemind, google.protobuf as pb
print("python", sys.version.split()[0], "torch", torch.__version__, "hivemind", hivemind.__version__, "protobuf", pb.__version__)
print("torch.cuda.is_available()", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
ls -l "$SITE/hivemind/hivemind_cli/p2pd"
fusionllm --help | head -2

demo() {
    say "demo: 4 peers on the GPU, $STEPS steps, then train --reference on the CPU and compare"
    cd "$WORK" || return
    (sleep 25; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv) &
    timeout -k 5 "${1}" fusionllm demo --steps "$STEPS" --seed 0 --save "$WORK/gpu.safetensors" >"$OUT/demo_gpu.log" 2>&1
    say "demo exited $?"
    grep -v "it/s\]\|s/it\]" "$OUT/demo_gpu.log" | tail -40
    timeout -k 5 120 fusionllm train --reference --steps "$STEPS" --seed 0 --save "$WORK/ref.safetensors" 2>&1 | tail -3
    for tol in 1e-5 1e-4 1e-3; do
        fusionllm compare "$WORK/gpu.safetensors" "$WORK/ref.safetensors" --tol "$tol" && break
    done
    tar -czf "$OUT/demo_logs.tgz" -C /tmp $(cd /tmp && ls -d fusionllm-demo-* 2>/dev/null) 2>/dev/null
    cd "$ROOT" || return
}

pipeline() {  # $1: seconds, $2: CUDA_VISIBLE_DEVICES, $3: the files' name
    say "benchmarks/pipeline.py full mode, CUDA_VISIBLE_DEVICES='$2', ${1}s at most"
    CUDA_VISIBLE_DEVICES=$2 timeout -k 5 "$1" python3 benchmarks/pipeline.py >"$OUT/$3.json" 2>"$OUT/$3.err"
    say "pipeline.py exited $?"
    uptime
    cat "$OUT/$3.json"
    grep "pipeline.py:\|Error\|error" "$OUT/$3.err" | tail -20
    grep -o "[a-z0-9]* swarm: SwarmRun(tokens_per_s=[0-9.]*\|reference [0-9.]* tokens/s\|pipelining: [0-9.]* tokens/s, median step [0-9.]* ms\|pipelining failed.*" "$OUT/$3.err" >"$OUT/$3.figures"
}

for part in $PARTS; do
    case $part in
    demo) demo $(( $(left) < 150 ? $(left) : 150 )) ;;
    pipeline) pipeline $(( $(left) - 10 )) "" pipeline_cpu ;;
    gpu_pipeline) pipeline $(( $(left) - 10 )) 0 pipeline_gpu ;;
    esac
done
say "done"
