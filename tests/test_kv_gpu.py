"""The KV tiers on a GPU: a CUDA pool, the pinned host tier, the side stream; codecs on the device."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.engine import Engine, EngineConfig, SamplingParams
from edgeinfer.kv.codec import BlockGeometry, fp8_supported, make_codec
from tests.conftest import noise_image

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FORCED = SamplingParams(max_new_tokens=24, min_new_tokens=24)
QUESTIONS = [
    ("what is in the image ?", [noise_image(128, 96, seed=1)]),
    ("describe this picture", []),
    ("how many red circle are there in the top left of the image ?", [noise_image(64, 64, seed=5)]),
    ("color", [noise_image(80, 128, seed=7), noise_image(64, 96, seed=8)]),
]


def run(path, **config):
    engine = Engine.load(path, config=EngineConfig(device="cuda", **config))
    results = engine.run_until_done([engine.submit(q, im, FORCED) for q, im in QUESTIONS])
    counters, metrics = engine.counters, engine.kv_metrics()
    engine.close()
    return [r.token_ids for r in results], counters, metrics


SQUEEZED = dict(block_size=4, num_blocks=30, max_batch_size=4, high_watermark=0.4, low_watermark=0.2)


def test_pinned_host_tier_on_a_gpu_keeps_tokens(checkpoint, tmp_path):
    want, _, _ = run(checkpoint("smolvlm"), num_blocks=256, max_batch_size=4)
    got, counters, metrics = run(checkpoint("smolvlm"), host_tier_mb=4, disk_tier_mb=4, disk_dir=str(tmp_path),
                                 **SQUEEZED)
    assert got == want
    assert counters["preemptions"] > 0 and counters["restored_blocks"] > 0 and metrics.transfer_s > 0


def test_bf16_pool_with_cuda_graphs_under_spilling(checkpoint, tmp_path):
    """bf16 results depend on batch shapes, which preemption changes: the first token must agree
    everywhere, and the first divergence is reported."""
    want, _, _ = run(checkpoint("smolvlm"), dtype="bfloat16", num_blocks=256, max_batch_size=4, cuda_graphs=True)
    got, counters, _ = run(checkpoint("smolvlm"), dtype="bfloat16", host_tier_mb=4, host_precision="int8",
                           disk_tier_mb=4, disk_dir=str(tmp_path), cuda_graphs=True, **SQUEEZED)
    positions = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(want, got)]
    print(f"bf16 + int8 host tier + CUDA graphs: first divergence per request (None = identical): {positions}")
    assert all(p is None or p > 0 for p in positions) and counters["restored_blocks"] > 0


@pytest.mark.parametrize("name,bound", [("full", 0.0), ("int8", 1 / 127), ("fp8", 1 / 16)])
def test_codecs_on_the_device_keep_their_error_bound(name, bound):
    """Encoded on the GPU, decoded on the GPU: within the codec's bound of the original (GPU and CPU
    may round a value to neighbouring quanta, so they are not compared with each other)."""
    if name == "fp8" and not fp8_supported("cuda"):
        pytest.skip("no float8_e4m3fn on this GPU")
    geometry = BlockGeometry(2, 16, 2, 64, torch.bfloat16)
    k = torch.randn(3, *geometry.block_shape).to(torch.bfloat16)
    v = torch.randn(3, *geometry.block_shape).to(torch.bfloat16)
    codec = make_codec(name, geometry, "cuda")
    k2, v2 = codec.decode(codec.encode(k.cuda(), v.cuda()))
    for x, y in ((k.float(), k2.float().cpu()), (v.float(), v2.float().cpu())):
        amax = x.abs().amax(dim=(2, 4), keepdim=True)
        assert ((x - y).abs() <= amax * bound + amax * 2**-8).all()  # + one bf16 rounding of the output


def test_to_host_gives_the_values_a_busy_stream_makes():
    """A copy to the host (a picture's embeddings for the disk tier, blocks spilled to disk) waits on an
    event for the copy queued behind the stream's work, never reading the host buffer before it lands."""
    from edgeinfer.kv.worker import to_host

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the stream is busy well past the copy's queuing
        made = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 3
        host = to_host(made)
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, torch.arange(1 << 20, dtype=torch.float32) * 3)
