import pytest
import torch


def ragged_mask(batch: int, time: int, *, gen: torch.Generator, holes: bool) -> torch.Tensor:
    """Rows start after a random prompt, end at a random length, and (optionally) have holes."""
    mask = torch.zeros(batch, time, dtype=torch.bool)
    for b in range(batch):
        start = int(torch.randint(0, time // 3, (1,), generator=gen))
        end = int(torch.randint(start + 1, time + 1, (1,), generator=gen))
        mask[b, start:end] = True
        if holes and end - start > 4:
            for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
                h0 = int(torch.randint(start + 1, end - 1, (1,), generator=gen))
                mask[b, h0 : h0 + int(torch.randint(1, 4, (1,), generator=gen))] = False
    return mask


@pytest.fixture
def make_mask():
    return ragged_mask


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
