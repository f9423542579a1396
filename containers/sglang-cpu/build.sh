#!/usr/bin/env bash
# Build SGLang's own environment for CPU machines (tests, laptops): `make sglang` -> .venv-sglang.
# sglang 0.5.23's wheel pins a CUDA torch, flashinfer and sgl-kernel (CUDA-only wheels), so it never goes into the
# project venv. Here: the CPU torch first, sglang and torchvision without their dependencies, every other
# requirement pinned (requirements.txt, frozen from a working environment) and installed without resolution so
# nothing pulls a CUDA torch; then two patches: torchvision's CUDA extension and the op registrations that need it
# are left out (sglang imports torchvision's transforms only), and sgl_kernel is posttrain's stand-in (its names
# raise if called; SGLang's CPU engine, SGLANG_USE_CPU_ENGINE=1, calls none for a dense model). GPU machines use
# the pinned image instead (containers/gpu-rollout).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-.venv-sglang}"
py="${PY:-python3}"
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q --no-deps sglang==0.5.23 torchvision==0.28.0 compressed-tensors==0.18.0
"$venv/bin/pip" install -q --no-deps -r "$here/requirements.txt"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mv "$site/torchvision/_C.so" "$site/torchvision/_C.so.cuda-only"
sed -i '/^    _autograd_registrations,$/d; /^    _meta_registrations,$/d' "$site/torchvision/__init__.py"
cp -r "$here/sgl_kernel" "$site/"
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c "import sglang.srt.entrypoints.http_server" 2>/dev/null
touch "$venv/.built"
echo "built $venv: $("$venv/bin/python" -c 'import sglang; print("sglang", sglang.__version__)')"
