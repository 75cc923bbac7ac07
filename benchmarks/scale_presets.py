"""Hardware presets of the weak-scaling model (`dagrl bench scale`): devices and networks.

Each figure names its source; docs/scaling.md lists them with the assumptions built on them.
Bandwidths are per device and per direction, in bytes/s; latencies (alpha) in seconds per
message step of a collective. `link_efficiency` is the share of a link's peak that collectives
reach (NCCL's bus bandwidth on a healthy fabric is typically 80-90% of the link rate; we take
the low end). The local preset's network is fitted here (gloo over loopback), not published.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


class PresetError(ValueError):
    """A hardware parameter that cannot describe a machine (message names the key)."""


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float                 # dense peak FLOP/s of one device, training dtype
    devices_per_node: int
    alpha_intra: float           # s per message step inside a node
    bw_intra: float              # B/s per device per direction inside a node
    alpha_inter: float           # s per message step across nodes
    bw_inter: float              # B/s per device per direction across nodes (its own NIC)
    link_efficiency: float = 0.8
    # CPU cores the devices share (the local preset: workers are processes on these cores;
    # 0 = every device has its own compute, as accelerators do).
    host_cores: float = 0.0
    # The single controller's driver: its node's network to the workers (Ray object transfers
    # use the host network, not the collective fabric), bytes/s.
    driver_nic: float = 50e9
    # Device memory bandwidth (B/s) and the share of it decode reaches: decode reads the
    # weights once per step and each row's KV cache, so on accelerators it is bound by memory,
    # not FLOPs. 0 = not modelled (the local preset: there decode is bound by per-operator
    # overhead, which the calibrated decode cost holds).
    mem_bw: float = 0.0
    mem_efficiency: float = 0.8
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("flops", "bw_intra", "bw_inter", "driver_nic"):
            if not getattr(self, key) > 0:
                raise PresetError(f"hardware.{key} must be > 0 (got {getattr(self, key)})")
        for key in ("alpha_intra", "alpha_inter"):
            if getattr(self, key) < 0:
                raise PresetError(f"hardware.{key} must be >= 0 (got {getattr(self, key)})")
        if self.devices_per_node < 1:
            raise PresetError("hardware.devices_per_node must be >= 1")
        if not 0 < self.link_efficiency <= 1:
            raise PresetError("hardware.link_efficiency must be in (0, 1]")
        if self.mem_bw < 0:
            raise PresetError(f"hardware.mem_bw must be >= 0 (got {self.mem_bw})")
        if not 0 < self.mem_efficiency <= 1:
            raise PresetError("hardware.mem_efficiency must be in (0, 1]")
        if self.host_cores < 0:
            raise PresetError("hardware.host_cores must be >= 0")

    def link(self, participants: int, stride: int = 1) -> tuple[float, float]:
        """(alpha, seconds per byte) of a collective over `participants` devices `stride`
        ranks apart (ranks fill nodes in order): the slowest link it crosses (a collective
        spanning nodes runs at the per-device NIC's rate)."""
        if participants * stride <= self.devices_per_node:
            return self.alpha_intra, 1.0 / (self.bw_intra * self.link_efficiency)
        return self.alpha_inter, 1.0 / (self.bw_inter * self.link_efficiency)

    def to_dict(self) -> dict:
        return asdict(self)


GB = 1e9

# NVIDIA DGX H100 / HGX H100 8-GPU nodes on an NDR InfiniBand fabric.
# - H100 SXM5 BF16 dense: 989.4 TFLOP/s (NVIDIA H100 datasheet; 1,979 is with sparsity).
# - HBM3: 3.35 TB/s (NVIDIA H100 datasheet, SXM).
# - NVLink 4: 18 links x 50 GB/s = 900 GB/s bidirectional per GPU -> 450 GB/s per direction
#   (NVIDIA H100 datasheet / Hopper architecture whitepaper).
# - 8x ConnectX-7 single-port 400 Gb/s InfiniBand per node, one per GPU (NVIDIA DGX BasePOD
#   reference architecture, "NVIDIA DGX H200 and H100 Systems") -> 50 GB/s per GPU per direction.
# - Latencies: 3 us per NVLink message step, 8 us per InfiniBand step (our assumption for
#   NCCL's per-step cost incl. software; the 1024-device result is insensitive to them, see
#   docs/scaling.md's sensitivity table).
NVLINK_IB = Hardware(
    name="nvlink-ib", flops=989.4e12, devices_per_node=8,
    alpha_intra=3e-6, bw_intra=450 * GB, alpha_inter=8e-6, bw_inter=50 * GB, mem_bw=3350 * GB,
    source="H100 SXM5 datasheet; DGX BasePOD RA (8x CX-7 400G/node); NVLink4 900 GB/s bidir")

# Huawei Atlas 800T A2-class nodes: 8 Ascend 910B NPUs, HCCS inside the node, RoCE between
# nodes. Huawei publishes no per-chip 910B datasheet; these are secondary-source figures and
# the preset is indicative only:
# - FP16 ~320 TFLOP/s per 910B (reported; the 2019 Ascend 910 was 256 TFLOP/s, Hot Chips 31);
# - HCCS: 56 GB/s per link, 7 links in a full mesh (392 GB/s per chip, reported) -> 196 GB/s
#   per direction when all peers are used at once (all-gather / all-to-all inside a node);
# - RoCE v2 200 GbE per NPU -> 25 GB/s per direction;
# - HBM2e 64 GB at ~1.6 TB/s (reported);
# - latencies 5 us (HCCS) and 15 us (RoCE): our assumption, higher than InfiniBand's.
ASCEND_HCCS_ROCE = Hardware(
    name="ascend-hccs-roce", flops=320e12, devices_per_node=8,
    alpha_intra=5e-6, bw_intra=196 * GB, alpha_inter=15e-6, bw_inter=25 * GB,
    driver_nic=25 * GB, mem_bw=1600 * GB,
    source="secondary reports: 910B ~320 TFLOPS FP16, HCCS 7x56 GB/s, 200GE RoCE per NPU")

PRESETS = {h.name: h for h in (NVLINK_IB, ASCEND_HCCS_ROCE)}


def local_hardware(flops: float, alpha: float, seconds_per_byte: float,
                   cores: float) -> Hardware:
    """This machine: CPU worker processes on `cores` cores, gloo over loopback (one node)."""
    return Hardware(name="local", flops=flops, devices_per_node=1 << 20, alpha_intra=alpha,
                    bw_intra=1.0 / seconds_per_byte, alpha_inter=alpha,
                    bw_inter=1.0 / seconds_per_byte, link_efficiency=1.0, host_cores=cores,
                    driver_nic=1.0 / seconds_per_byte,
                    source="fitted on this machine (gloo, loopback; matmul peak measured)")


def with_overrides(hw: Hardware, overrides: dict[str, float]) -> Hardware:
    """`hw` with some fields replaced (`--hw key=value`); unknown keys are errors."""
    known = set(asdict(hw)) - {"name", "source"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise PresetError(f"--hw: unknown key(s) {unknown}; known: {sorted(known)}")
    return replace(hw, **{k: type(getattr(hw, k))(v) for k, v in overrides.items()})
