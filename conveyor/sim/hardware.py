"""Hardware descriptions: peak FLOP/s, memory bandwidth and size, and the interconnect for tensor
parallelism. Datasheet peaks (dense, no sparsity); a cost model divides by them, so its times are
lower bounds unless `efficiency` is set below 1.

"this-machine" is read from the JSON `conveyor bench roofline` writes (measured streaming
bandwidth and decode-shaped matmul throughput), so it describes the CPU the engine runs on.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from conveyor.errors import ConfigError

DEFAULT_ROOFLINE_JSON = "out/roofline/roofline.json"


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: dict[str, float] = field(hash=False)  # dtype -> FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: float  # per device
    interconnect_bandwidth: float = 0.0  # bytes/s one way per device (NVLink, PCIe), for all-reduce
    allreduce_latency_s: float = 10e-6  # fixed cost of one all-reduce call
    # Prefill -> decode KV handover (conveyor simulate --prefill-workers): bytes/s one way per device,
    # each tp shard moving its slice over its own link. Default: the GPU's cross-node NIC (RDMA), the
    # conservative path; P and D in one NVLink node would be nearer interconnect_bandwidth.
    kv_transfer_bandwidth: float = 10e9
    step_overhead_s: float = 1e-3  # per engine step: scheduling, launches, sampling bookkeeping
    flops_efficiency: float = 1.0  # achieved / peak
    bandwidth_efficiency: float = 1.0
    note: str = ""

    def flops(self, dtype: str) -> float:
        peak = self.peak_flops.get(dtype) or self.peak_flops.get("bfloat16")
        if not peak:
            raise ConfigError(f"hardware {self.name!r} has no FLOP/s figure for {dtype}")
        return peak * self.flops_efficiency

    @property
    def bandwidth(self) -> float:
        return self.memory_bandwidth * self.bandwidth_efficiency


GB = 1e9
HARDWARE: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        "h100", {"bfloat16": 989e12, "float16": 989e12, "fp8": 1979e12, "float32": 67e12},
        memory_bandwidth=3350 * GB, memory_bytes=80 * GB, interconnect_bandwidth=450 * GB,
        kv_transfer_bandwidth=50 * GB,
        note="H100 SXM5 80GB: HBM3 3.35 TB/s, NVLink 4 900 GB/s both ways, 400 Gb/s NIC per GPU",
    ),
    "a100": HardwareSpec(
        "a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        memory_bandwidth=2039 * GB, memory_bytes=80 * GB, interconnect_bandwidth=300 * GB,
        kv_transfer_bandwidth=25 * GB,
        note="A100 SXM4 80GB: HBM2e 2.04 TB/s, NVLink 3 600 GB/s both ways, 200 Gb/s NIC per GPU",
    ),
    "l4": HardwareSpec(
        "l4", {"bfloat16": 121e12, "float16": 121e12, "fp8": 242e12, "float32": 30.3e12},
        memory_bandwidth=300 * GB, memory_bytes=24 * GB, interconnect_bandwidth=32 * GB,
        allreduce_latency_s=30e-6, kv_transfer_bandwidth=12.5 * GB,
        note="L4 24GB: GDDR6 300 GB/s, PCIe Gen4 x16, 100 Gb/s Ethernet",
    ),
}
ALIASES = {"h100-sxm": "h100", "a100-80gb": "a100", "a100-80g": "a100", "cpu": "this-machine"}


def this_machine(roofline_json: str | Path = DEFAULT_ROOFLINE_JSON) -> HardwareSpec:
    """The CPU the engine runs on, from `conveyor bench roofline`'s measured peaks."""
    path = Path(roofline_json)
    if not path.exists():
        raise ConfigError(
            f"{path} not found: run `conveyor bench roofline --num-threads 1 --output-dir {path.parent}` "
            "first, or pass --roofline-json"
        )
    peaks = json.loads(path.read_text())["peaks"]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareSpec(
        "this-machine", {"float32": peaks["fp32_gflops"] * 1e9, "bfloat16": peaks["bf16_gflops"] * 1e9},
        memory_bandwidth=peaks["bandwidth_gbs"] * GB, memory_bytes=float(memory),
        step_overhead_s=0.5e-3, note=f"measured by conveyor bench roofline ({path})",
    )


def hardware_key(name: str) -> str:
    """A hardware name as HARDWARE (or "this-machine") spells it, aliases resolved."""
    return ALIASES.get(name.lower(), name.lower())


def get_hardware(name: str, roofline_json: str | Path | None = None, efficiency: float | None = None) -> HardwareSpec:
    key = hardware_key(name)
    if key == "this-machine":
        spec = this_machine(roofline_json or DEFAULT_ROOFLINE_JSON)
    elif key in HARDWARE:
        spec = HARDWARE[key]
    else:
        raise ConfigError(f"unknown hardware {name!r}; choose from {', '.join([*HARDWARE, 'this-machine'])}")
    if efficiency is not None:
        if not 0 < efficiency <= 1:
            raise ConfigError("efficiency must be in (0, 1]")
        spec = replace(spec, flops_efficiency=efficiency, bandwidth_efficiency=efficiency)
    return spec


HARDWARE_NAMES = (*HARDWARE, "this-machine")
