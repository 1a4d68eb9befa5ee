"""Print the estimator's predictions for models and clusters far beyond one machine (docs/estimator.md).

    python benchmarks/estimate_table.py            # 7B and 70B on 8 to 1024 ranks, every stage, fp32 and bf16

Adam (8 bytes of optimizer state per fp32 master element), the count rounded up to the world size,
``zero_core.estimate`` from a parameter count. GiB are 2**30 bytes; traffic is what one rank sends
per step (ring algorithms; multiply by the step rate for the bandwidth a link must carry).
"""

from __future__ import annotations

from zero_core import Precision, ZeroConfig, estimate

GiB = 2**30
RANKS = (8, 64, 256, 1024)


def main() -> None:
    for name, psi in (("7B", 7_000_000_000), ("70B", 70_000_000_000)):
        for precision in ("fp32", "bf16"):
            compute = None if precision == "fp32" else precision
            print(f"\n#### {name}, {precision} compute{' (fp32 masters)' if compute else ''}, Adam\n")
            print("| stage | " + " | ".join(f"{n} ranks: state GiB/rank" for n in RANKS) + " | sent GiB/step/rank (any N ≥ 8) |")
            print("|---|" + "---|" * (len(RANKS) + 1))
            for stage in (1, 2, 3):
                config = ZeroConfig(stage=stage, precision=Precision(compute=compute))
                cells = [estimate(psi, world_size=n, config=config) for n in RANKS]
                sent = f"{cells[0].total_bytes_sent / GiB:.1f} – {cells[-1].total_bytes_sent / GiB:.1f}"  # grows to the limit
                print(f"| {stage} | " + " | ".join(f"{e.max_model_state_bytes / GiB:,.1f}" for e in cells) + f" | {sent} |")
            ddp = 16 * psi / GiB
            ring = [2 * 4 * psi * (n - 1) / n / GiB for n in (RANKS[0], RANKS[-1])]  # one fp32 all-reduce
            print("| DDP | " + " | ".join(f"{ddp:,.1f}" for _ in RANKS) + f" | {ring[0]:.1f} – {ring[1]:.1f} |")


    print("\n#### Where the states live: 70B, stage 3, bf16, 64 ranks\n")
    print("| placement | device GiB/rank | host GiB/rank |")
    print("|---|---|---|")
    for placement, options in (("device", {}), ("host", {}), ("static", {"offload_optim_frac": 1.0, "offload_param_frac": 0.0}),
                               ("static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0})):
        config = ZeroConfig(precision=Precision(compute="bf16"), placement=placement, placement_options=options)
        tiers = estimate(70_000_000_000, world_size=64, config=config).tiers[0]
        label = placement + (f" {options}" if options else "")
        print(f"| {label} | {tiers['device'] / GiB:.1f} | {tiers['host'] / GiB:.1f} |")


if __name__ == "__main__":
    main()
