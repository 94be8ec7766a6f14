#!/usr/bin/env bash
# On an H200: the present code, bf16, 8-bit and 4-bit at batch 1 and 16. On anything else: the 8-bit gate|up
# integer-dot tiles pair at batch 1 (exp/w8-gateup-tiles.patch).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "H200: present code"; MAX=${MAX:-585} BS=1,16 W=bf16,w4a16-h8,w8a16-h8 TEST=0 bash exp/dev-present.sh
else
  echo "not an H200: the w8 gate|up pair"; PATCH=exp/w8-gateup-tiles.patch BMAX=${BMAX:-390} MAX=${MAX:-585} bash exp/dev-w8patch.sh
fi
