import sys, torch
from edgeinfer.backends.torch import triton_decode as td
from edgeinfer.quant.packed import PackedMatrix
from edgeinfer.quant.kernels import SplitWorkspace
bn, bk, warps, split, reg = map(int, sys.argv[1:6])
n, k = tuple(map(int, sys.argv[6].split("x")))
glu = n == 17920
dev, bf = torch.device("cuda"), torch.bfloat16
codes = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
scales = (torch.rand(n, k // 128, device=dev) * 0.004 + 0.001).to(bf)
w = PackedMatrix(codes, scales, None, 4, 128, (n, k))
x = torch.randn(1, k, device=dev, dtype=bf)
nw = torch.ones(k, device=dev, dtype=bf) if glu else None
res = None if glu else torch.randn(1, n, device=dev, dtype=bf)
cfg = td.PackedGemvConfig(bn, bk, warps, split, reg or None)
ws = SplitWorkspace(dev)
for _ in range(6):
    td.packed_gemv(x, w, cfg, norm_weight=nw, eps=1e-6, glu=glu, residual=res, workspace=ws)
torch.cuda.synchronize()
