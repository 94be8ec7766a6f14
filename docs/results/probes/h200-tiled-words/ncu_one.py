import sys, torch
from edgeinfer.quant import kernels, tensor_core
rows, bn, bk, split, st, tiled = map(int, sys.argv[1:7])
n, k = (17920, 1536) if len(sys.argv) < 8 else tuple(map(int, sys.argv[7].split("x")))
dev, bf = torch.device("cuda"), torch.bfloat16
codes = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
scales = (torch.rand(n, k // 128, device=dev) * 0.004 + 0.001).to(bf)
if tiled:
    codes = tensor_core.tile_words(codes)
x = torch.randn(rows, k, device=dev, dtype=bf)
ws = kernels.SplitWorkspace(dev)
for _ in range(6):
    tensor_core.mma_mm(x, codes, scales, None, n, 128, bn=bn, bk=bk, split=split, warps=4, workspace=ws,
                       ahead=st - 1, tiled=bool(tiled))
torch.cuda.synchronize()
