"""How fast bytes move: host↔device links, GPU↔GPU links, host memory.

Figures are per direction and *achievable* (what a large ``cudaMemcpyAsync`` or NCCL
ring reaches), below the nominal signalling rate; each has its source beside it. The
time model divides bytes by these and overlaps them with compute as each technique does.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Links:
    """Bandwidths (bytes/s, one direction) seen by one device.

    Attributes:
        host_to_device: the host link (PCIe, or the C2C link of a superchip).
        device_to_device: between GPUs of one node (NVLink, else PCIe through the host).
        host_memory: host DRAM, as a single process's copies and optimizer step see it.
        source: where the figures come from.
        device_memory: the device's own memory (what a device optimizer step streams through).
    """

    host_to_device: float
    device_to_device: float
    host_memory: float
    source: str
    device_memory: float = 2000 * GB


# PCIe: 16 GT/s × 16 lanes (gen4) = 31.5 GB/s nominal, ~25 GB/s reached by pinned copies
# (NVIDIA "How to optimize data transfers in CUDA C/C++"; bandwidthTest on A100 PCIe);
# gen5 doubles it (~50 GB/s reached on H100 PCIe/SXM hosts, NVIDIA H100 datasheet: PCIe Gen5 128 GB/s
# bidirectional). NVLink: A100 600 GB/s and H100 900 GB/s bidirectional (datasheets) → 300 /
# 450 GB/s per direction, ~80 % reached by NCCL all-reduce bus bandwidth (nccl-tests).
# GH200 NVLink-C2C 900 GB/s bidirectional (datasheet). Host memory: one socket of 8-channel
# DDR5-4800 gives 307 GB/s nominal; a single process's copy loop and fused CPU Adam reach
# ~20-40 GB/s (STREAM-like figures on Sapphire Rapids), we take 25 GB/s — except for the H100
# SXM, where we measured the machine the planner's published predictions are for (one H100
# 80GB HBM3, 16 cores, 125.9 GiB host, 2026-11-26): an in-place STREAM triad at 16 threads
# reached 152.3 GB/s and torch's fused CPU AdamW 151.6 GB/s (0.996 of it), 6x the old 25 GB/s.
# These are defaults for a machine that is not this one; ``--host-bandwidth`` says what
# another machine has, and planning for this machine's own GPU measures it (a short triad).
# Device memory bandwidth: the datasheets (H100 SXM 3.35 TB/s, PCIe 2.0, NVL 3.9; H200 4.8;
# GH200 4.0; B200 8.0; A100 80GB 2.0, 40GB 1.55), ~85 % reached by streaming kernels.
_LINKS: dict[str, Links] = {
    "H100 SXM": Links(50 * GB, 360 * GB, 152 * GB, "PCIe gen5 x16 (~50 GB/s), NVLink 4 (450 GB/s/dir × 0.8)",
                      2847 * GB),
    "H100 PCIe": Links(50 * GB, 50 * GB, 25 * GB, "PCIe gen5 x16 (~50 GB/s), no NVLink between cards", 1700 * GB),
    "H100 NVL": Links(50 * GB, 240 * GB, 25 * GB, "PCIe gen5 x16, NVLink bridge 600 GB/s bidirectional", 3315 * GB),
    "H200": Links(50 * GB, 360 * GB, 25 * GB, "PCIe gen5 x16 (~50 GB/s), NVLink 4 (450 GB/s/dir × 0.8)", 4080 * GB),
    "H200 NVL": Links(50 * GB, 360 * GB, 25 * GB, "PCIe gen5 x16, NVLink bridge 900 GB/s bidirectional", 4080 * GB),
    "GH200": Links(360 * GB, 360 * GB, 200 * GB, "NVLink-C2C 900 GB/s bidirectional; LPDDR5X 500 GB/s", 3400 * GB),
    "B200": Links(50 * GB, 720 * GB, 25 * GB, "PCIe gen5 x16, NVLink 5 (900 GB/s/dir × 0.8)", 6800 * GB),
    "A100 40GB": Links(25 * GB, 240 * GB, 20 * GB, "PCIe gen4 x16 (~25 GB/s), NVLink 3 (300 GB/s/dir × 0.8)",
                       1321 * GB),
    "A100 80GB": Links(25 * GB, 240 * GB, 20 * GB, "PCIe gen4 x16 (~25 GB/s), NVLink 3 (300 GB/s/dir × 0.8)",
                       1733 * GB),
}
_PCIE4 = Links(25 * GB, 20 * GB, 20 * GB, "PCIe gen4 x16 (~25 GB/s); GPU↔GPU through the host", 600 * GB)
_PCIE3 = Links(12 * GB, 10 * GB, 15 * GB, "PCIe gen3 x16 (~12 GB/s); GPU↔GPU through the host", 500 * GB)
_GEN3 = {"V100", "V100 32GB", "V100 PCIe", "V100 PCIe 32GB", "T4"}


def links_for(device_name: str) -> Links:
    """The links of a GPU model (a canonical name from ``hardware.peaks``); PCIe gen4
    figures for GPUs not listed, gen3 for V100/T4."""
    if device_name in _LINKS:
        return _LINKS[device_name]
    return _PCIE3 if device_name in _GEN3 else _PCIE4


def cpu_links(memory_bandwidth: float) -> Links:
    """A CPU device: "host" and "device" are the same DRAM; copies run at its bandwidth."""
    return Links(memory_bandwidth, memory_bandwidth, memory_bandwidth, "measured host memory copy", memory_bandwidth)
