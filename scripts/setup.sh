#!/usr/bin/env bash
# Idempotent setup: Debian packages, .venv from requirements.lock, Horovod
# built from source (wheel cached outside the repo), the package itself.
set -euo pipefail
cd "$(dirname "$0")/.."

HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-python3.11}
WHEEL_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/distrepro/wheels

# Debian packages, each checked by what it provides (the image's own cmake,
# g++ and Python headers count).
missing=()
need() { command -v "$1" >/dev/null || missing+=("$2"); }
need cmake cmake
need g++ g++
need make make
need chromium chromium
"$PYTHON" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' ||
  missing+=(python3-dev)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

lock_hash=$(sha256sum requirements.lock | cut -c1-16)
if [ "$(cat .venv/.lock-hash 2>/dev/null)" != "$lock_hash" ]; then
  echo "setup: creating .venv from requirements.lock"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.lock
  echo "$lock_hash" > .venv/.lock-hash
fi

tf_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("tensorflow"))')
wheel_dir=$WHEEL_CACHE/horovod-$HOROVOD_VERSION-tf$tf_version
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('horovod') != '$HOROVOD_VERSION')" 2>/dev/null; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "setup: building Horovod $HOROVOD_VERSION against TensorFlow $tf_version (a few minutes)"
    mkdir -p "$wheel_dir.partial"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      MAKEFLAGS=-j"$(nproc)" \
      .venv/bin/pip wheel -q --no-deps --no-build-isolation \
      -w "$wheel_dir.partial" "horovod==$HOROVOD_VERSION"
    rm -rf "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"
  fi
  .venv/bin/pip install -q --no-deps "$wheel_dir"/horovod-*.whl
fi

.venv/bin/python -c 'import distrepro' 2>/dev/null ||
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
