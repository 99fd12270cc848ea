"""A bare, hand-written training loop: the baseline the launcher's overhead is measured against.

Same model, data, optimizer (fused AdamW), loss (the chunked one, `model(x, y)`) and threads as
`train`, none of the launcher (no Hydra, no metrics sinks, no console, no runner). Prints the median
tokens/s over the steps after the first as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from launcher.config import DataConfig, ModelConfig
from launcher.data import BatchLoader, load_splits
from launcher.model.init import initialized_model


def main(steps: int, micro: int, seq_len: int, threads: int, cache_dir: str) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = initialized_model(ModelConfig(), 0, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loader = BatchLoader(load_splits(DataConfig(cache_dir=cache_dir)).train, seq_len, micro, seed=0)
    rates = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = loader.next_batch()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        rates.append(micro * seq_len / (time.perf_counter() - t0))
    print(json.dumps({"tokens_per_s": statistics.median(rates[1:])}))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), sys.argv[5])
