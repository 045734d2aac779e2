"""GAE: rlhf_algos.gae against the usual reversed Python loop over time steps.

Run: uv run python benchmarks/algos_gae.py [--repeats 7]
Prints the median wall time of each, the speed-up, and the largest relative difference.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import _summary
import torch
from rlhf_algos import gae


def gae_loop(rewards, values, mask, gamma, lam):
    """The common implementation (e.g. OpenRLHF's): one Python iteration per time step."""
    values = values * mask
    rewards = rewards * mask
    last = torch.zeros(rewards.shape[0])
    out = []
    t_len = rewards.shape[1]
    for t in reversed(range(t_len)):
        next_v = values[:, t + 1] if t < t_len - 1 else 0.0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--time-len", default="1024,8192", help="sequence lengths (batch 256)")
    _summary.add_argument(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, gamma=0.99 lam=0.95")
    print(f"{'shape':>14} {'loop (ms)':>10} {'gae (ms)':>10} {'speed-up':>9} {'max rel diff':>13}")
    for batch, time_len in ((256, int(t)) for t in args.time_len.split(",")):
        rewards = torch.randn(batch, time_len)
        values = torch.randn(batch, time_len)
        lengths = torch.randint(time_len // 4, time_len + 1, (batch,))
        mask = torch.arange(time_len)[None, :] < lengths[:, None]
        ref_adv, ref_ret = gae_loop(rewards, values, mask.float(), 0.99, 0.95)
        adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.95)
        rel = max(
            float((adv - ref_adv).abs().max() / ref_adv.abs().max()),
            float((ret - ref_ret).abs().max() / ref_ret.abs().max()),
        )
        gae(rewards, values, mask, gamma=0.99, lam=0.95)  # warm-up
        t_loop = median_time(
            functools.partial(gae_loop, rewards, values, mask.float(), 0.99, 0.95), args.repeats
        )
        t_ours = median_time(
            functools.partial(gae, rewards, values, mask, gamma=0.99, lam=0.95), args.repeats
        )
        print(
            f"{batch:>5} x {time_len:<6} {t_loop * 1e3:>10.1f} {t_ours * 1e3:>10.1f} "
            f"{t_loop / t_ours:>8.1f}x {rel:>13.2e}"
        )
        _summary.ratio_row(
            args.summary,
            f"algos: gae vs a Python loop ({batch} x {time_len})",
            t_loop / t_ours,
            1.0,
            f"max rel. diff {rel:.0e}",
        )


if __name__ == "__main__":
    main()
