#!/usr/bin/env bash
# Wheels of transformers and its dependencies for a GPU machine that reaches no package index: run here (PyPI is
# reachable), then carry the folder with the device run (`carry: [".gpu_wheels"]`, 64 MiB at most; torch and numpy are
# the machine's own). PY_VERSION: the GPU machine's Python (its first run prints it), e.g. 3.12.
set -eu
PY_VERSION=${PY_VERSION:-3.11}
WHEELS=${WHEELS:-.gpu_wheels}
mkdir -p "$WHEELS"
python3 -m pip download --quiet --dest "$WHEELS" --only-binary=:all: --python-version "$PY_VERSION" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 --no-deps
python3 -m pip download --quiet --dest "$WHEELS" --only-binary=:all: --python-version "$PY_VERSION" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    huggingface-hub pyyaml regex packaging filelock fsspec tqdm typing-extensions hf-xet typer click shellingham \
    rich markdown-it-py mdurl pygments annotated-doc httpx httpcore anyio idna certifi h11 sniffio --no-deps
du -sh "$WHEELS"
