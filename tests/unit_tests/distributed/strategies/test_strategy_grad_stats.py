"""--log-num-zeros-in-grad and --log-params-norm over sharded parameters: every strategy
reports what the single-process reference model has."""

import pytest
import torch
import torch.nn.functional as F

from _dist_helpers import H, ROWS_PER_RANK, build_pair, local_rows, world
from _strategy_common import Net, case_id, sharding, strategy_cases
from megatron.core.distributed.mfsdp_v2 import microbatch
from megatron.core.optimizer import count_zeros, get_params_norm

CASES = strategy_cases()


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_zero_count_and_params_norm_match_the_reference(case):
    model, reference, ctx = build_pair(Net, **sharding(case))
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS_PER_RANK * world(), H, generator=generator)
    x[:, :3] = 0  # three input features unused: their columns of inp.weight get zero gradients
    y = torch.randn(ROWS_PER_RANK * world(), H, generator=generator)
    F.mse_loss(reference(x), y).backward()
    with microbatch(ctx, is_last=True):
        F.mse_loss(model(local_rows(x)), local_rows(y)).backward()
    expected_zeros = sum(int((p.grad == 0).sum()) for p in reference.parameters())
    assert expected_zeros >= 3 * reference.inp.weight.shape[0]
    assert count_zeros(list(model.parameters())) == expected_zeros
    expected_norm = torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))
    assert torch.allclose(get_params_norm(list(model.parameters())), expected_norm, rtol=1e-5)
