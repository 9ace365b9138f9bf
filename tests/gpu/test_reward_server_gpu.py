"""The reward server on a GPU: a reward that runs out of CUDA memory for real is answered with a
retryable 503, and the server keeps serving. The server's other answers:
tests/unit/test_reward_server.py."""

from __future__ import annotations

import pytest
import torch

from verl_digen.rewards import RewardFn
from verl_digen.rewards.serve import RewardServer
from test_reward_server import raw_request, score_body

pytestmark = pytest.mark.usefixtures("loopback_no_proxy")


class _HugeCudaAllocation(RewardFn):
    """Asks the GPU for far more than it has: a real ``torch.cuda.OutOfMemoryError``."""

    name = "huge_cuda"

    def score_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
        return torch.zeros(images.shape[0])


@pytest.mark.gpu
def test_a_real_cuda_out_of_memory_is_a_503() -> None:
    with RewardServer(_HugeCudaAllocation(), port=0) as srv:
        status, data, headers = raw_request(srv, "POST", "/score", score_body()[0], {"Content-Type": "application/json"})
        assert status == 503 and "ran out of memory" in data["error"] and headers["Retry-After"]
        assert raw_request(srv, "GET", "/health")[0] == 200  # still serving
