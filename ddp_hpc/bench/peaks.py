"""The bench model's FLOPs, the cards' peaks, and MFU (achieved FLOP/s over the peak).

**FLOPs of the bench MLP**, from its shapes: a Linear layer of ``a`` inputs and ``b`` outputs
does ``a * b`` multiply-accumulates per sample, 2 FLOPs each forward; backward computes the
gradients of its weights (as many again) and of its inputs (as many again, except for the
first layer: the data needs no gradient). So a step costs ``6 * MACs - 2 * first layer's MACs``
FLOPs per sample: the ``6 * parameters * tokens`` rule, with a sample as the token, without the
one product nothing computes (torch's ``FlopCounterMode`` counts the same; the tests check
it). Biases, ReLUs, the loss and the optimizer are left out (under 0.1 % for the bench sizes),
so MFU is, if anything, slightly low.

**Peaks**: dense (no structured sparsity) tensor-core and CUDA-core figures from NVIDIA's
datasheets, in TFLOP/s. The datasheets list tensor-core TF32/BF16 "with sparsity"; the dense
figure is half of that. Which peak a run is held against: ``fp32`` is float32 matmuls at
torch's ``highest`` (CUDA cores), ``tf32`` float32 matmuls at ``high`` (TF32 tensor cores),
``bf16`` autocast to bfloat16. A card not in the table gets no MFU (said so), never a guess.

AMD's, from AMD's Instinct datasheets, for torch's ROCm build (whose ``get_device_name()``
says ``AMD Instinct ...``): rocBLAS runs float32 matmuls on the matrix cores, so ``fp32`` is
the FP32 matrix figure. An MI250X is two GCDs and torch sees each as one device (Frontier and
LUMI-G: 8 per node): its figures here are half the module's. The MI250X has no TF32: its
``tf32`` is its FP32 matrix figure. Neither was run here: no AMD GPU was at hand.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CardPeaks:
    """One card's dense peaks (TFLOP/s) and where they come from."""

    name: str
    fp32: float
    tf32: float
    bf16: float
    source: str

    def peak(self, precision: str) -> float:
        return {"fp32": self.fp32, "tf32": self.tf32, "bf16": self.bf16}[precision]


#: (pattern matched against ``torch.cuda.get_device_name()``, the card's peaks), first match wins.
PEAKS: tuple[tuple[str, CardPeaks], ...] = (
    (r"NVIDIA H100 (80GB HBM3|SXM5?\b.*)", CardPeaks(
        "H100 SXM", fp32=67.0, tf32=494.5, bf16=989.5,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP32 67 TFLOPS, TF32 989 and BF16 1,979 "
               "TFLOPS with sparsity")),
    (r"NVIDIA H100 PCIe", CardPeaks(
        "H100 PCIe", fp32=51.0, tf32=378.0, bf16=756.5,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe: FP32 51 TFLOPS, TF32 756 and BF16 1,513 "
               "TFLOPS with sparsity")),
    (r"NVIDIA H200( SXM.*| 141GB.*)?", CardPeaks(
        "H200 SXM", fp32=67.0, tf32=494.5, bf16=989.5,
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: FP32 67 TFLOPS, TF32 989 and BF16 1,979 "
               "TFLOPS with sparsity")),
    (r"NVIDIA A100[- ].*", CardPeaks(
        "A100", fp32=19.5, tf32=156.0, bf16=312.0,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe): FP32 19.5 TFLOPS, TF32 156 and BF16 "
               "312 TFLOPS dense")),
    (r"AMD Instinct MI250X.*", CardPeaks(
        "MI250X (one GCD)", fp32=47.85, tf32=47.85, bf16=191.5,
        source="AMD Instinct MI250X datasheet: FP32 matrix 95.7 and BF16 383 TFLOPS per module of two GCDs, "
               "halved for the one GCD torch sees; no TF32 (float32 matmuls run as FP32 matrix)")),
    (r"AMD Instinct MI300X.*", CardPeaks(
        "MI300X", fp32=163.4, tf32=653.7, bf16=1307.4,
        source="AMD Instinct MI300X datasheet: FP32 matrix 163.4, TF32 653.7 and BF16 1307.4 TFLOPS dense")),
)

#: The precisions the device figures run, and the matmul setting each runs float32 matmuls at.
MATMUL_PRECISION = {"fp32": "highest", "tf32": "high", "bf16": "highest"}


def card_peaks(device_name: str) -> CardPeaks | None:
    """The peaks of the card ``torch.cuda.get_device_name()`` names; None for any other."""
    for pattern, peaks in PEAKS:
        if re.fullmatch(pattern, device_name.strip()):
            return peaks
    return None


def mlp_macs_per_sample(input_dim: int, hidden: int, depth: int, classes: int = 10) -> int:
    """Multiply-accumulates of one forward pass of ``make_mlp``'s Linear layers, per sample."""
    widths: Sequence[int] = [input_dim, *[hidden] * depth, classes]
    return sum(a * b for a, b in zip(widths, widths[1:]))


def training_flops_per_sample(input_dim: int, hidden: int, depth: int, classes: int = 10) -> int:
    """FLOPs of one training step per sample: 2 per MAC forward, 4 backward (2 for the first layer)."""
    first = input_dim * (hidden if depth else classes)
    return 6 * mlp_macs_per_sample(input_dim, hidden, depth, classes) - 2 * first


def mfu(samples_per_s: float, flops_per_sample: int, device_name: str, precision: str,
        devices: int = 1) -> dict[str, object]:
    """Achieved TFLOP/s and, where the card is known, MFU over ``devices`` of its peak."""
    achieved = samples_per_s * flops_per_sample / 1e12
    peaks = card_peaks(device_name)
    if peaks is None:
        return {"achieved_tflop_s": achieved, "mfu": None, "peak_tflop_s": None,
                "mfu_note": f"MFU not given: no peak known for {device_name!r} (ddp_hpc/bench/peaks.py)"}
    peak = peaks.peak(precision) * devices
    return {"achieved_tflop_s": achieved, "mfu": achieved / peak, "peak_tflop_s": peak,
            "card": peaks.name, "peak_source": peaks.source}
