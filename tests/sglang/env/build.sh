#!/usr/bin/env bash
# Build the interpreter environment that runs real SGLang on CPU for the `sglang` test tier.
#
#   tests/sglang/env/build.sh VENV_DIR      (make sglang-cpu calls it with .venv-sglang)
#
# A separate environment, as in production where [server] python names the interpreter that has
# SGLang. CPU torch comes from the machine's local wheel (torch==2.13.0+cpu: pip fails rather than
# fetch a CUDA build); sglang and torchvision are installed with --no-deps and the rest is only what
# the CPU path imports (requirements.txt). The wheels are kept in a wheelhouse outside the checkout
# (SGLANG_WHEELS, else ~/.cache/datagen/sglang-wheels; pip's own HTTP cache stores nothing from the
# package index here), filled once per recipe: a rebuild installs from it without the network. Two
# adjustments make SGLang's text path import on a machine without CUDA:
#  - torchvision on the package index is a CUDA build whose operator library cannot load next to
#    CPU torch; two of its fake-kernel registrations are unconditional and fail at import, so they
#    are made conditional like the others (SGLang imports torchvision's transforms, never its ops);
#  - a `vllm` shim names the rotary kernel SGLang imports (and never calls) on an unknown platform.
# The environment is written only when it is complete: the stamp file is the last thing created.
#
# The environment does not depend on the checkout, so it is built once per recipe (this script, the
# requirements, the shims, the pinned versions and the Python version) in a cache outside the checkout
# (SGLANG_ENVS, else ~/.cache/datagen/sglang-envs/<recipe>) and VENV_DIR is made a link to it: a fresh
# clone on a machine that built it before links it in a second instead of spending two minutes
# unpacking 2.2 GB. Builds of one recipe are serialised with flock; SGLANG_ENVS=none builds in place.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:?usage: build.sh VENV_DIR}
python=${PYTHON:-python3}
stamp="$venv/.installed"
SGLANG_VERSION=0.5.23
TORCHVISION_VERSION=0.28.0

wheels=${SGLANG_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/datagen/sglang-wheels}
recipe=$( (cat "$here/requirements.txt"; echo "$SGLANG_VERSION $TORCHVISION_VERSION") | sha256sum | cut -c1-16)

envs=${SGLANG_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/datagen/sglang-envs}
if [ "$envs" != none ] && [ -z "${_SGLANG_IN_CACHE:-}" ]; then
  env_recipe=$( (cat "$0" "$here/requirements.txt"; find "$here/shims" -type f -print0 | sort -z | xargs -0 cat;
                 "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
  cached="$envs/$env_recipe"
  mkdir -p "$envs"
  exec 9>"$cached.lock"
  flock 9
  if ! [ -f "$cached/.installed" ]; then
    _SGLANG_IN_CACHE=1 "$0" "$cached"
  fi
  rm -rf "$venv"
  ln -sfn "$cached" "$venv"
  touch "$cached/.installed"  # newer than this checkout's recipe files: make sees it built
  echo "sglang environment: $venv -> $cached"
  exit 0
fi

rm -rf "$venv"
"$python" -m venv "$venv"
py="$venv/bin/python"
pip() {  # this machine's pip configuration names file indexes that do not exist for every package
  "$py" -m pip --quiet --disable-pip-version-check "$@" 2> >(grep -v 'is ignored: it is neither a file' >&2)
}
nodeps=("sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION")
if ! [ -f "$wheels/.complete-$recipe" ]; then
  mkdir -p "$wheels"
  pip download --dest "$wheels" -r "$here/requirements.txt"
  pip download --dest "$wheels" --no-deps "${nodeps[@]}"
  touch "$wheels/.complete-$recipe"
fi
pip install --no-compile --no-index --find-links "$wheels" -r "$here/requirements.txt"
pip install --no-compile --no-index --find-links "$wheels" --no-deps "${nodeps[@]}"

site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/torchvision/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::([a-z_]+)"\)$/@register_meta("\1")/' "$meta"
if grep -q '^@torch.library.register_fake' "$meta"; then
  echo "build.sh: torchvision $TORCHVISION_VERSION still registers fake kernels unconditionally" >&2
  exit 1
fi
cp -r "$here/shims/vllm" "$site/"

# Byte-compile everything once, here. Packages go in with --no-compile (pip would compile them one by
# one, slower), and where PYTHONDONTWRITEBYTECODE is set (these machines and CI set it) no process ever
# writes a .pyc: every SGLang process (server, scheduler, detokenizer) would compile its imports again,
# ~48 s of CPU for the server modules instead of ~22 s. compileall exits 1 for the few files that are
# not Python 3 (vendored test data); the import check below is what proves the environment.
env -u PYTHONDONTWRITEBYTECODE "$py" -m compileall -q -j 0 "$site" >/dev/null || true

# Fail here, not in the tests: CPU torch, and SGLang's server modules import.
"$py" - <<'EOF'
import torch
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
import sglang.launch_server  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401
import sglang.srt.model_executor.model_runner  # noqa: F401
import sglang.srt.models.qwen3  # noqa: F401
import tokenizers  # noqa: F401  (data/models/make_tiny_model.py)
print(f"sglang environment ready: torch {torch.__version__}")
EOF
touch "$stamp"
