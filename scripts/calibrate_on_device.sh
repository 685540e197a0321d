#!/usr/bin/env bash
# The first command on a lent GPU (docs/time-model.md): benchmarks/calibrate.py's parts in the order
# that matters most, whole train steps first, each banked as it goes, all inside one 10-minute
# command, and the bank packed into $OUT (the device tool brings back at most 8 files).
#
#   scripts/calibrate_on_device.sh wheels        # here: what the GPU image lacks, as wheels in
#                                                # .whl/, and MaxText unpacked in one archive there
#   scripts/calibrate_on_device.sh run           # there, carrying .whl: the parts, then
#                                                # $OUT/bank.tgz
#   scripts/calibrate_on_device.sh run FILE      # the parts of FILE instead: lines of SECONDS
#                                                # FLAGS… (each a calibrate run into its own folder)
#   scripts/calibrate_on_device.sh side_by_side  # there, carrying .whl: meshlm and MaxText timed
#                                                # (benchmarks/side_by_side.py), then $OUT/bank.tgz
#
# Then, here: tar -xzf <files_at>/bank.tgz -C benchmarks/results, `python -m benchmarks.calibrate
# --check`, and commit the files.
set -uo pipefail
cd "$(dirname "$0")/.."

# Pure-Python packages the image lacks or holds at other versions, pinned to what the suite tests
# (pip freeze of the dev venv), and tensorstore at the version orbax was tested with.
WHEELS="ml-collections==1.1.0 flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8 etils==1.15.0
        treescope==0.1.10 tensorstore==0.1.86"
# MaxText (benchmarks/peers.py's version) and what its train step imports that the image lacks,
# found by importing it with the image's packages (docs/time-model.md); xprof's 2.23.1, the
# newest whose modules import without Google's internal ones. Unpacked and packed with xz they
# travel in about half their wheels' bytes; what no train step on synthetic data reads stays
# behind (MaxText's tokenizer files, xprof's web viewer), for the working tree and .whl to fit
# the 64 MiB that travel.
MAXTEXT_WHEELS="maxtext==0.2.5 aqtp==0.9.0 drjax==0.2.1 grain==0.2.18 array-record==0.8.6
        omegaconf==2.4.0 pathwaysutils==0.1.13 fastapi==0.115.12 starlette==0.46.2
        uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 qwix==0.1.8 tokamax==0.0.17 einshape==1.0 immutabledict==4.3.1
        portpicker==1.6.0 xprof==2.23.1"
download() {  # download FOLDER NAME==VERSION…: x86-64 wheels for the image's Python 3.12
  local folder=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$folder" "$@"
}
install_wheels() {  # on the GPU: the wheels into /tmp/site, MaxText into /tmp/maxtext-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  if [[ -f .whl/maxtext-site.tar.xz ]]; then
    rm -rf /tmp/maxtext-site && mkdir -p /tmp/maxtext-site &&
      tar -xJf .whl/maxtext-site.tar.xz -C /tmp/maxtext-site || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
}

case "${1:-}" in
  wheels)
    rm -rf .whl
    # shellcheck disable=SC2086  # the names are words
    download .whl $WHEELS || exit 1
    tmp=$(mktemp -d)
    # shellcheck disable=SC2086
    download "$tmp/wheels" $MAXTEXT_WHEELS &&
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" \
        "$tmp"/wheels/*.whl &&
      rm -rf "$tmp/site/maxtext/assets/tokenizers" "$tmp/site/xprof/static" &&
      tar -cf - -C "$tmp/site" . | xz -9 -T0 > .whl/maxtext-site.tar.xz || exit 1
    rm -rf "$tmp"
    du -sh .whl ;;
  side_by_side)
    install_wheels
    out=${OUT:-/tmp/out} bank=/tmp/bank
    mkdir -p "$out" "$bank"
    exec > >(tee "$out/log.txt") 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv ||
      echo "no nvidia-smi: no GPU here (--dry rehearses)"
    timeout "${DEADLINE_S:-560}" python3 -m benchmarks.side_by_side --bank_dir="$bank" \
      --maxtext_path=/tmp/maxtext-site --deadline_s=$((${DEADLINE_S:-560} - 20)) "${@:2}"
    echo "rc=$? after ${SECONDS}s"
    tar -czf "$out/bank.tgz" -C "$bank" . && ls -la "$bank" ;;
  run)
    install_wheels
    out=${OUT:-/tmp/out} bank=/tmp/bank deadline=${DEADLINE_S:-540}
    mkdir -p "$out" "$bank"
    exec > >(tee "$out/log.txt") 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__,
                "optax", optax.__version__, jax.devices())'
    part() {  # part SECONDS FLAGS…: one calibrate run, stopped at its share or the deadline
      local left=$((deadline - SECONDS - 20)) limit=$1; shift
      ((left < limit)) && limit=$left
      ((limit < 30)) && { echo "skipped (no time left): $*"; return; }
      timeout "$limit" python3 -m benchmarks.calibrate --out_dir="$bank" "$@"
      echo "rc=$? after ${SECONDS}s: $*"
    }
    if [[ -n "${2:-}" ]]; then
      n=0
      while read -r seconds flags; do
        [[ -z "$seconds" || "$seconds" == \#* ]] && continue
        n=$((n + 1))
        # shellcheck disable=SC2086  # the flags are words
        part "$seconds" $flags --out_dir="$bank/$n"
      done < "$2"
    else
      # preset rows first; then packed rows: cuDNN's packed layout, and its dense mask (the
      # bias tests/test_timing.py holds CUDNN_BIAS_SLOWDOWN to)
      part 300 --parts=steps --step_precision=default \
        --step_variants=preset,packed,packed+model.cudnn_segments=0 \
        --part_budget_s=130
      part 170 --parts=attention --part_budget_s=120
      part 70 --parts=gemm,copy,host --part_budget_s=30
      part 200 --parts=steps --step_precision=fp8 --step_attention=cudnn --part_budget_s=60 \
        --out_dir="$bank/fp8"
    fi
    tar -czf "$out/bank.tgz" -C "$bank" . && ls -laR "$bank" ;;
  *)
    echo "usage: scripts/calibrate_on_device.sh wheels|run|side_by_side" >&2; exit 2 ;;
esac
