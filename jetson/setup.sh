#!/usr/bin/env bash
# Install edgeinfer on a Jetson into a virtual environment that uses JetPack's own
# CUDA-enabled PyTorch and sees JetPack's TensorRT Python bindings.
#
#   bash jetson/setup.sh [options]
#
#   --prefix DIR         install under DIR (default /opt/edgeinfer; the venv is DIR/venv)
#   --source SPEC        what to pip-install: a source folder or a requirement
#                        (default: the checkout this script lives in, else "edgeinfer")
#   --jetpack 6|7        skip reading /etc/nv_tegra_release (inside a container build)
#   --torch-wheel URL    a PyTorch wheel to use instead of the default for the JetPack
#   --torch-index URL    a pip index to take torch from instead
#   --with-ort-gpu       replace onnxruntime with the CUDA/TensorRT build for Jetson
#   --no-verify-cuda     do not require torch.cuda.is_available() (container builds)
#   --service            install the systemd unit and /etc/default/edgeinfer (needs root)
#
# Why a venv with --system-site-packages: JetPack installs TensorRT's Python bindings with
# apt (python3-libnvinfer) into the system Python; PyPI has no CUDA build of torch for
# JetPack 6, so torch comes from NVIDIA's own wheel, and every later pip install is
# constrained to that exact torch so nothing replaces it with a CPU wheel.
set -euo pipefail

PREFIX=/opt/edgeinfer
SOURCE=
JETPACK=
TORCH_WHEEL=${EDGEINFER_TORCH_WHEEL:-}
TORCH_INDEX=${EDGEINFER_TORCH_INDEX:-}
WITH_ORT_GPU=0
VERIFY_CUDA=1
SERVICE=0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# NVIDIA's PyTorch build for JetPack 6.1/6.2 (CUDA 12.6, Python 3.10).
JP6_TORCH_WHEEL=https://developer.download.nvidia.com/compute/redist/jp/v61/pytorch/torch-2.5.0a0+872d972e41.nv24.08.17622132-cp310-cp310-linux_aarch64.whl
JP6_ORT_INDEX=https://pypi.jetson-ai-lab.io/jp6/cu126
# JetPack 7 (Thor) follows the SBSA layout: CUDA 13 aarch64 wheels apply.
JP7_TORCH_INDEX=https://pypi.jetson-ai-lab.io/sbsa/cu130
JP7_ORT_INDEX=https://pypi.jetson-ai-lab.io/sbsa/cu130
PYTORCH_JETSON_DOC=https://docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform/index.html

die() { echo "setup: error: $*" >&2; exit 1; }
log() { echo "==> $*"; }
warn() { echo "setup: warning: $*" >&2; }

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

parse_args() {
    while [[ $# -gt 0 ]]; do
        case $1 in
            --prefix) PREFIX=$2; shift 2 ;;
            --source) SOURCE=$2; shift 2 ;;
            --jetpack) JETPACK=$2; shift 2 ;;
            --torch-wheel) TORCH_WHEEL=$2; shift 2 ;;
            --torch-index) TORCH_INDEX=$2; shift 2 ;;
            --with-ort-gpu) WITH_ORT_GPU=1; shift ;;
            --no-verify-cuda) VERIFY_CUDA=0; shift ;;
            --service) SERVICE=1; shift ;;
            -h|--help) usage 0 ;;
            *) echo "setup: unknown option $1" >&2; usage 2 ;;
        esac
    done
    if [[ -z $SOURCE ]]; then
        if [[ -f $HERE/../pyproject.toml ]]; then SOURCE=$(cd "$HERE/.." && pwd); else SOURCE=edgeinfer; fi
    fi
}

# Sets JETPACK from /etc/nv_tegra_release unless given.
detect_jetpack() {
    if [[ -n $JETPACK ]]; then return; fi
    local line major revision
    line=$(head -n1 /etc/nv_tegra_release 2>/dev/null) \
        || die "no /etc/nv_tegra_release: not a Jetson (inside a container, pass --jetpack 6 or 7)"
    major=$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1/p' <<<"$line")
    revision=$(sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\2/p' <<<"$line")
    log "L4T R$major.$revision"
    case $major in
        38) JETPACK=7 ;;
        36)
            JETPACK=6
            if [[ $revision == 3.* || $revision == 2.* ]] && [[ -z $TORCH_WHEEL$TORCH_INDEX ]]; then
                die "JetPack 6.0 (L4T 36.$revision) ships PyTorch 2.4.0a0, older than edgeinfer needs; " \
                    "upgrade to JetPack 6.1 or later, or pass --torch-wheel"
            fi ;;
        35) die "JetPack 5 (L4T R35) has Python 3.8; edgeinfer needs Python >= 3.10: flash JetPack 6.1 or later" ;;
        *) die "L4T R$major is not a JetPack edgeinfer supports (6.1+ on Orin, 7.x on Thor)" ;;
    esac
}

choose_sources() {
    case $JETPACK in
        6) PYTHON=python3.10; ORT_INDEX=$JP6_ORT_INDEX
           if [[ -z $TORCH_WHEEL$TORCH_INDEX ]]; then TORCH_WHEEL=$JP6_TORCH_WHEEL; fi ;;
        7) PYTHON=python3.12; ORT_INDEX=$JP7_ORT_INDEX
           if [[ -z $TORCH_WHEEL$TORCH_INDEX ]]; then TORCH_INDEX=$JP7_TORCH_INDEX; fi ;;
        *) die "--jetpack must be 6 or 7, got $JETPACK" ;;
    esac
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found (it is JetPack $JETPACK's system Python)"
}

ensure_apt_packages() {
    local missing=() package
    for package in python3-venv python3-pip libopenblas0; do
        dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        [[ $EUID -eq 0 ]] || die "missing ${missing[*]}: run sudo apt-get install -y ${missing[*]}"
        log "apt-get install ${missing[*]}"
        apt-get update -qq && apt-get install -y --no-install-recommends "${missing[@]}"
    fi
    dpkg -s python3-libnvinfer >/dev/null 2>&1 \
        || warn "python3-libnvinfer is not installed: no TensorRT backend (sudo apt install python3-libnvinfer)"
}

create_venv() {
    log "virtual environment $PREFIX/venv ($PYTHON, with JetPack's system packages visible)"
    mkdir -p "$PREFIX"
    "$PYTHON" -m venv --system-site-packages "$PREFIX/venv"
    PIP=("$PREFIX/venv/bin/python" -m pip)
    "${PIP[@]}" install --quiet --upgrade pip wheel
}

install_torch() {
    if [[ -n $TORCH_WHEEL ]]; then
        log "torch from $TORCH_WHEEL"
        # NVIDIA's JetPack 6 wheels are built against NumPy 1.x.
        "${PIP[@]}" install "numpy<2" "$TORCH_WHEEL"
    else
        log "torch from $TORCH_INDEX"
        "${PIP[@]}" install --index-url "$TORCH_INDEX" torch
    fi
    if [[ $VERIFY_CUDA -eq 1 ]] && ! "$PREFIX/venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        die "torch is installed but cannot use CUDA. A missing library (libcusparseLt, libcudnn) is the usual cause: see $PYTORCH_JETSON_DOC"
    fi
}

write_constraints() {
    local torch_version
    torch_version=$("$PREFIX/venv/bin/python" -c 'import torch; print(torch.__version__)')
    {
        echo "torch==$torch_version"
        if [[ $JETPACK == 6 ]]; then echo "numpy<2"; fi
    } >"$PREFIX/constraints.txt"
    log "pinned torch==$torch_version in $PREFIX/constraints.txt"
}

install_edgeinfer() {
    log "edgeinfer from $SOURCE"
    "${PIP[@]}" install --constraint "$PREFIX/constraints.txt" "$SOURCE"
    if [[ $WITH_ORT_GPU -eq 1 ]]; then
        log "onnxruntime-gpu from $ORT_INDEX"
        "${PIP[@]}" uninstall -y onnxruntime
        "${PIP[@]}" install --constraint "$PREFIX/constraints.txt" --extra-index-url "$ORT_INDEX" onnxruntime-gpu
    fi
}

install_service() {
    [[ $EUID -eq 0 ]] || die "--service needs root"
    id edgeinfer >/dev/null 2>&1 || useradd --system --home-dir /var/lib/edgeinfer --shell /usr/sbin/nologin \
        --groups video,render edgeinfer
    sed "s#/opt/edgeinfer/venv#$PREFIX/venv#g" "$HERE/edgeinfer.service" >/etc/systemd/system/edgeinfer.service
    [[ -f /etc/default/edgeinfer ]] || install -m 0644 "$HERE/edgeinfer.env" /etc/default/edgeinfer
    systemctl daemon-reload
    log "installed edgeinfer.service: edit /etc/default/edgeinfer, then: sudo systemctl enable --now edgeinfer"
}

main() {
    parse_args "$@"
    detect_jetpack
    choose_sources
    ensure_apt_packages
    create_venv
    install_torch
    write_constraints
    install_edgeinfer
    if [[ $SERVICE -eq 1 ]]; then install_service; fi
    log "done: $PREFIX/venv/bin/edgeinfer"
    "$PREFIX/venv/bin/edgeinfer" doctor || warn "edgeinfer doctor reported problems (see above)"
}

main "$@"
