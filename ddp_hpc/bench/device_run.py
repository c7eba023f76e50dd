"""``ddp-hpc bench mfu``: the Trainer against a hand-written loop on the device the ranks
get, in fp32, TF32 and bf16, each also as MFU (model FLOP utilisation).

One launch (torchrun) of ``ddp_hpc.bench.worker device``: each rank takes ddp_hpc's own
device choice for ``--device`` (``auto``: ``cuda:LOCAL_RANK`` with nccl on a CUDA host), and
for each precision the two loops alternate round by round, as in the CPU plan. No checkpoint
in the timed epochs (the stall is ``--checkpoints``' figure): the Trainer's save at the end of
training falls in one more epoch, untimed, which the hand-written loop runs too. MFU: samples/s x the model's FLOPs
per sample (``peaks.py``: about 6 x multiply-accumulates) over the card's dense peak for that
precision x the ranks; a card without a known peak (a CPU too) gets the achieved TFLOP/s
and no MFU, with the reason.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddp_hpc.bench.peaks import MATMUL_PRECISION, mfu, training_flops_per_sample
from ddp_hpc.bench.results_file import check_output, merge_into
from ddp_hpc.bench.runner import ModelSize, launch, machine_info, spread


@dataclass(frozen=True)
class DevicePlan:
    model: ModelSize
    rounds: int
    epochs: int                  # timed epochs per fit, after one warm-up epoch
    precisions: tuple[str, ...]


#: The issue-39 model: 1024 -> 8 x 4096 -> 10, batch 1024 (0.73 GFLOP per sample per step).
DEVICE_FULL = DevicePlan(ModelSize("device MLP", 1024, 4096, 8, 1024, 65536), rounds=2, epochs=2,
                         precisions=("fp32", "tf32", "bf16"))
#: A smoke run (``--quick``; ``scripts/gpu-check.sh --cpu``): fp32 and autocast; tf32 differs
#: from fp32 only by the matmul setting, which tests/test_matmul_precision.py checks.
DEVICE_QUICK = DevicePlan(ModelSize("device MLP (quick)", 64, 128, 2, 32, 256), rounds=2, epochs=1,
                          precisions=("fp32", "bf16"))


def measure_device(plan: DevicePlan, device: str, ranks: int, workdir: Path, progress) -> dict[str, Any]:
    model = plan.model
    flops = training_flops_per_sample(model.input_dim, model.hidden, model.depth)
    result = launch("device", ranks, [*model.args(), "--device", device, "--precisions", ",".join(plan.precisions),
                                      "--epochs", str(plan.epochs), "--rounds", str(plan.rounds),
                                      "--checkpoint-every-epochs", "0", "--cooldown-epochs", "1"], workdir)
    rows = []
    for precision, runs in result["by_precision"].items():
        row: dict[str, Any] = {"precision": precision, "float32_matmul_precision": MATMUL_PRECISION[precision],
                               "autocast": "bf16" if precision == "bf16" else None}
        for loop in ("trainer", "handwritten"):
            rates = [r["samples_per_s"] for r in runs[loop]]
            row[f"{loop}_samples_per_s"] = rates
            row[f"{loop}_mean_step_s"] = [r["mean_step_s"] for r in runs[loop]]
            row[loop] = mfu(statistics.fmean(rates), flops, result["device_name"], precision, result["world_size"])
        paired = [t / h for t, h in zip(row["trainer_mean_step_s"], row["handwritten_mean_step_s"])]
        row.update(paired_ratios=paired, paired_ratio_spread=spread(paired), order=runs["order"])
        rows.append(row)
        progress(f"device {result['device']} {precision}: " + "  ".join(
            f"{loop} {statistics.fmean(row[f'{loop}_samples_per_s']):.0f} samples/s" for loop in ("trainer", "handwritten")))
    return {"device": result["device"], "backend": result["backend"], "device_name": result["device_name"],
            "world_size": result["world_size"], "model": asdict(model), "flops_per_sample": flops,
            "flops_note": "per sample: 2 x multiply-accumulates of the Linear layers forward, 4 x backward (2 x for "
                          "the first layer, whose input needs no gradient); "
                          "biases, activations, loss and optimizer left out",
            "rounds": plan.rounds, "epochs_timed": plan.epochs, "rows": rows}


def format_device(section: dict[str, Any]) -> str:
    lines = [f"== on {section['device']} ({section['device_name']}, {section['backend']}, "
             f"{section['world_size']} rank(s)): Trainer vs hand-written loop, "
             f"{section['flops_per_sample'] / 1e9:.3g} GFLOP per sample per step =="]
    for row in section["rows"]:
        cells = []
        for loop in ("trainer", "handwritten"):
            figures = row[loop]
            share = f", MFU {figures['mfu']:.3f}" if figures["mfu"] is not None else ""
            cells.append(f"{loop} {statistics.fmean(row[f'{loop}_samples_per_s']):.0f} samples/s "
                         f"{figures['achieved_tflop_s']:.3g} TFLOP/s{share}")
        lines.append(f"{row['precision']:<5} " + "  ".join(cells) + "  paired step ratio "
                     + ", ".join(f"{r:.3f}" for r in row["paired_ratios"]))
    first = section["rows"][0]["trainer"] if section["rows"] else {}
    if first.get("mfu") is None and first:
        lines.append(first["mfu_note"])
    elif first:
        lines.append(f"peaks: {first['card']} ({first['peak_source']})")
    return "\n".join(lines)


def run_device_bench(output: Path, device: str, ranks: int, quick: bool) -> dict[str, Any]:
    """``ddp-hpc bench mfu``: measure, print, merge into ``output`` as ``device_loops``."""
    check_output(output)
    plan = DEVICE_QUICK if quick else DEVICE_FULL
    with tempfile.TemporaryDirectory(prefix="ddp-hpc-bench-") as tmp:
        section = measure_device(plan, device, ranks, Path(tmp),
                                 lambda m: print(f"bench: {m}", file=sys.stderr, flush=True))
    section.update(command=f"ddp-hpc bench mfu --device {device}" + (" --quick" if quick else ""),
                   machine={**machine_info(), "backend": section["backend"], "device": section["device"]})
    merge_into(output, {"device_loops": section})
    print(format_device(section))
    return section
