#!/usr/bin/env bash
# The first GPU hour in one command (bench/gpu/README.md): bench/gpu/run.sh OUT [--cpu]
# Installs the carried wheels (bench/gpu/wheels.txt) offline into a folder of their own, then
# runs bench/gpu/gpu_check.py, which prints the device's versions, runs every stage under its
# budget and writes OUT/gpu_report.json and OUT/gpu_report.md after each stage.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: bench/gpu/run.sh OUT [--cpu]}"
shift
python="${PYTHON:-python3}"
site="${AXONN_GPU_SITE:-/tmp/axonn_gpu_site}"
pins=$(grep -v '^#' "$here/wheels.txt" | grep -v '^$')
missing=$("$python" - "$pins" <<'PY'
import importlib.util, sys
names = {"hydra-core": "hydra", "antlr4-python3-runtime": "antlr4", "PyYAML": "yaml",
         "typing_extensions": "typing_extensions"}
pins = [p.split("==")[0] for p in sys.argv[1].split()]
print(" ".join(p for p in pins if importlib.util.find_spec(names.get(p, p)) is None))
PY
)
if [[ -n "$missing" ]]; then
    if ! ls "$here"/wheels/*.whl >/dev/null 2>&1; then
        echo "run.sh: missing $missing and no wheels in bench/gpu/wheels: run bench/gpu/fetch_wheels.sh here and carry bench/gpu/wheels" >&2
        exit 2
    fi
    # shellcheck disable=SC2086
    "$python" -m pip install --quiet --no-index --no-deps --target "$site" \
        --find-links "$here/wheels" $pins
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" "$here/gpu_check.py" --out "$out" "$@"
