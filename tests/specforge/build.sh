#!/usr/bin/env bash
# Build the environment of the `specforge` test tier: SpecForge 0.2.0, whose own build_eagle3_dataset
# loads datagen's specforge export (tests/specforge/test_eagle3.py).
#
#   tests/specforge/build.sh VENV_DIR      (make specforge-env calls it with .venv-specforge)
#
# SpecForge pins torch 2.11.0 (a CUDA build from the index, several GB) and sglang 0.5.14 for its
# training and serving paths; its data path (specforge.data) needs torch, transformers and datasets
# only. So: CPU torch from the machine's local wheel (torch==2.13.0+cpu), transformers at SpecForge's
# pin, and SpecForge itself with --no-deps. Built once per recipe in ~/.cache/datagen/specforge-envs
# (SPECFORGE_ENVS) and VENV_DIR linked to it; the stamp file is the last thing written.
set -euo pipefail
venv=${1:?usage: build.sh VENV_DIR}
python=${PYTHON:-python3}
packages="torch==2.13.0 transformers==5.8.1 datasets pydantic openai-harmony tqdm pyyaml safetensors accelerate"
recipe=$( (cat "$0"; echo "$packages specforge==0.2.0"; "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
envs=${SPECFORGE_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/datagen/specforge-envs}
cached="$envs/$recipe"
mkdir -p "$envs"
exec 9>"$envs/.lock"
flock 9
if [ ! -f "$cached/.installed" ]; then
  rm -rf "$cached"
  "$python" -m venv "$cached"
  # shellcheck disable=SC2086
  "$cached/bin/python" -m pip install -q $packages
  "$cached/bin/python" -m pip install -q --no-deps specforge==0.2.0
  "$cached/bin/python" -c 'import specforge.data.preprocessing, transformers, datasets'
  touch "$cached/.installed"
fi
ln -sfn "$cached" "$venv"
echo "specforge environment: $venv -> $cached"
