#!/usr/bin/env bash
# Set up this computer for axonn_launch: a virtual environment in .venv with the CPU
# build of torch 2.13 (unless a torch is already there), the package and its test tools.
# As root on Debian/Ubuntu it also installs OpenMPI (for the mpirun tests).
# On a GPU cluster use the site's CUDA/ROCm torch instead: see README.md.
# One line as each phase starts, with the time so far: the downloads take minutes, and
# silence reads as a hang.
set -euo pipefail
cd "$(dirname "$0")/../.."

SECONDS=0
phase() { printf 'set up [%4ss]: %s\n' "$SECONDS" "$1"; }

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v mpirun >/dev/null; then
    phase "OpenMPI (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

PYTHON="${PYTHON:-python3}"
phase "virtual environment .venv, pip"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    phase "torch 2.13 (the longest download)"
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
phase "axonn_launch (editable) with its test tools"
.venv/bin/python -m pip install -q -e ".[test]"
# Bytecode now, not in the first run's 4 ranks at once: pip compiles what it installs, but
# not this package (installed in place) nor a torch that was already there. Up-to-date
# files are skipped; torch's files for newer Pythons do not compile, hence -qq and || true.
phase "bytecode of axonn_launch and torch"
.venv/bin/python -m compileall -q axonn_launch
TORCH_DIR="$(.venv/bin/python -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')"
.venv/bin/python -m compileall -qq "$TORCH_DIR" || true
echo "set up [${SECONDS}s]: done: $(.venv/bin/python -c 'import torch, axonn_launch; print("torch", torch.__version__, "| axonn_launch", axonn_launch.__version__)')"
