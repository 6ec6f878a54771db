#!/usr/bin/env bash
# Source this first in every command on the GPU machine:  source scripts/device_setup.sh
# Installs the carried wheels (.whl/) and Kiln itself without touching the image's torch.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_setup: wheel install failed (did you carry .whl?)"; return 1 2>/dev/null || exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || { echo "device_setup: pip install -e . failed"; return 1 2>/dev/null || exit 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - <<'PY'
import torch, transformers, kiln
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
print(f"device_setup: {name}, torch {torch.__version__}, transformers {transformers.__version__}, kiln {kiln.__version__}")
PY
