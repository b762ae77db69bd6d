#!/usr/bin/env bash
# Idempotent setup of the main job: Debian packages (scripts/packages.sh main),
# .venv from the lock, Horovod built from source with MPI + Gloo (+ NCCL on a GPU
# machine), the package itself.
#
#   GPU=1 | GPU=0          force the GPU or the CPU variant (default: GPU=1 when
#                          nvidia-smi lists a GPU)
#   CUDA_HOME=DIR          the CUDA 12 toolkit for the GPU build (default: nvcc on
#                          PATH, then /usr/local/cuda)
#   DISTREPRO_WHEEL_CACHE  where built Horovod wheels are kept, one folder a variant
#   scripts/setup.sh --print-build-env   print the Horovod build environment, build nothing
set -euo pipefail
cd "$(dirname "$0")/.."

HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-python3.11}
WHEEL_CACHE=${DISTREPRO_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/distrepro/wheels}
CUDA_CC_LIST=70,75,80,86,89,90 # V100 (sm_70) to H100 (sm_90)

die() {
  echo "setup: $*" >&2
  exit 1
}
pin() { sed -n "s/^$1==\([^ ]*\).*/\1/p" "$2"; }

if [ -z "${GPU:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    GPU=1
  else
    GPU=0
  fi
fi

site_packages=.venv/lib/python$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_python_version())')/site-packages
if [ "$GPU" = 1 ]; then
  lock=requirements-gpu.lock
  if [ -n "${CUDA_HOME:-}" ]; then
    nvcc=$CUDA_HOME/bin/nvcc
  else
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  fi
  advice="Horovod's NCCL build needs a CUDA 12 toolkit (nvcc 12.x, e.g. NVIDIA's cuda-toolkit-12-4 package or a CUDA 12 image), found by CUDA_HOME, nvcc on PATH or /usr/local/cuda; GPU=0 builds the CPU variant instead"
  [ -x "$nvcc" ] || die "GPU=1 but there is no nvcc at $nvcc. $advice"
  cuda_version=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  [ "${cuda_version%%.*}" = 12 ] || die "GPU=1 but $nvcc is CUDA ${cuda_version:-of unknown version}. $advice"
  cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}
  nccl=$PWD/$site_packages/nvidia/nccl
  variant=cuda$cuda_version-nccl$(pin nvidia-nccl-cu12 "$lock")
else
  lock=requirements.lock
  variant=cpu
fi
tf_version=$(pin tensorflow "$lock")
wheel_dir=$WHEEL_CACHE/horovod-$HOROVOD_VERSION-tf$tf_version-$variant-mpi-gloo

horovod_build_env() {
  echo HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
  echo HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
  if [ "$GPU" = 1 ]; then
    echo HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="$cuda_home"
    echo HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl/lib" HOROVOD_NCCL_LINK=SHARED
    echo HOROVOD_BUILD_CUDA_CC_LIST=$CUDA_CC_LIST
  fi
}

if [ "${1:-}" = --print-build-env ]; then
  echo "variant=$variant lock=$lock wheel=$wheel_dir"
  horovod_build_env
  exit 0
fi

bash scripts/packages.sh main # Debian packages first: nothing is created without them

lock_hash=$(sha256sum "$lock" | cut -c1-16)
if [ "$(cat .venv/.lock-hash 2>/dev/null)" != "$lock_hash" ]; then
  echo "setup: installing .venv from $lock"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r "$lock"
  echo "$lock_hash" >.venv/.lock-hash
fi

if [ "$(cat .venv/.horovod-wheel 2>/dev/null)" != "$wheel_dir" ]; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "setup: building Horovod $HOROVOD_VERSION ($variant, MPI + Gloo) against TensorFlow $tf_version (about 6 minutes on 2 cores)"
    if [ "$GPU" = 1 ]; then
      ln -sf libnccl.so.2 "$nccl/lib/libnccl.so" # the wheel ships only the soname
    fi
    rm -rf "$wheel_dir.partial" && mkdir -p "$wheel_dir.partial"
    # shellcheck disable=SC2046
    env $(horovod_build_env) MAKEFLAGS=-j"$(nproc)" \
      .venv/bin/pip wheel -q --no-deps --no-build-isolation --no-cache-dir \
      -w "$wheel_dir.partial" "horovod==$HOROVOD_VERSION"
    rm -rf "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"
  fi
  .venv/bin/pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  echo "$wheel_dir" >.venv/.horovod-wheel
fi

.venv/bin/python -c 'import distrepro' 2>/dev/null ||
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
