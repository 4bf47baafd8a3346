#!/usr/bin/env bash
# Download the wheels bench/gpu/wheels.txt names into bench/gpu/wheels/ (needs the network;
# run it here, then carry bench/gpu/wheels to the device: bench/gpu/README.md).
# PyYAML has compiled wheels: one per CPython 3.10-3.13 for x86_64 Linux, as the device's
# Python version is not known in advance. antlr4-python3-runtime 4.9.3 exists only as a source
# archive on PyPI, so it is built into a (pure Python) wheel here with pip wheel.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
dest="$here/wheels"
mkdir -p "$dest"
grep -v '^#' "$here/wheels.txt" | while read -r pin; do
    [[ -z "$pin" ]] && continue
    case "$pin" in
    PyYAML==*)
        for version in 3.10 3.11 3.12 3.13; do
            "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest" \
                --python-version "$version" --platform manylinux_2_17_x86_64 "$pin"
        done ;;
    antlr4-python3-runtime==*)
        "$python" -m pip wheel --quiet --no-deps -w "$dest" "$pin" ;;
    *)
        "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest" "$pin" ;;
    esac
done
du -ch "$dest"/*.whl | tail -1
