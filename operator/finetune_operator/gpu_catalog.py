"""The Azure GPU VM sizes users pick from, as data.

Sources: Azure's VM size pages (learn.microsoft.com/azure/virtual-machines/sizes/gpu-
accelerated/*) for GPUs per VM, GPU memory, host memory (GiB) and interconnect; NVIDIA's
data sheets for
dense (non-sparse) tensor-core peaks; memory per GPU is what `nvidia-smi` reports as
total (MiB), not the marketing gigabytes. Prices are indicative Linux pay-as-you-go
list prices in USD per VM-hour (East US, 2025) and are only used to rank options:
check the Azure pricing calculator before budgeting.
"""

from __future__ import annotations

import difflib
import re

from pydantic import BaseModel, ConfigDict

MiB = 1024**2
GiB = 1024**3


class Gpu(BaseModel):
    """One GPU model."""

    model_config = ConfigDict(frozen=True)
    name: str
    memory_bytes: int
    peak_flops_16bit: float
    """Dense bf16 (fp16 where the GPU has no bf16) tensor-core FLOP/s."""
    bf16: bool
    """Whether the GPU computes in bf16 (Ampere and newer); V100 and T4 need fp16."""
    nvlink_busbw: float | None
    """All-reduce bus bandwidth inside a VM over NVLink, bytes/s; None for PCIe only."""
    memory_bandwidth: float = 1.5e12
    """Device memory bandwidth, bytes/s (the vendors' figures): sampling a token reads
    every weight once, so GRPO's generation time is bound by it."""


class VmSize(BaseModel):
    """One Azure VM size with GPUs."""

    model_config = ConfigDict(frozen=True)
    name: str
    series: str
    gpu: Gpu
    gpus: int
    memory_bytes: int
    """Host memory (RAM) of the VM, as Azure's size tables list it (GiB)."""
    infiniband_gbps: int = 0
    """InfiniBand bandwidth per VM in Gbit/s (0: none, Ethernet only)."""
    price_per_hour: float
    """Indicative pay-as-you-go USD per VM-hour; for ranking only."""

    @property
    def inter_node_busbw(self) -> float:
        """Collective bus bandwidth between VMs, bytes/s: NCCL runs one ring per NIC, so
        it is about 90% of the VM's InfiniBand line rate (ANCHORS: ~46-48 GB/s per 400 Gb/s
        NIC); ~25 Gbit/s effective over Ethernet."""
        gbps = self.infiniband_gbps * 0.9 if self.infiniband_gbps else 25
        return gbps / 8 * 1e9

    @property
    def interconnect(self) -> str:
        inside = "NVLink" if self.gpu.nvlink_busbw and self.gpus > 1 else "PCIe"
        between = f"InfiniBand {self.infiniband_gbps} Gb/s" if self.infiniband_gbps else (
            "Ethernet")
        return f"{inside}; {between}"


T4 = Gpu(name="T4-16GB", memory_bytes=15360 * MiB, peak_flops_16bit=65e12, bf16=False,
         nvlink_busbw=None, memory_bandwidth=320e9)
V100_16 = Gpu(name="V100-16GB", memory_bytes=16384 * MiB, peak_flops_16bit=112e12, bf16=False,
              nvlink_busbw=None, memory_bandwidth=900e9)
V100_32 = Gpu(name="V100-32GB", memory_bytes=32768 * MiB, peak_flops_16bit=125e12, bf16=False,
              nvlink_busbw=130e9, memory_bandwidth=900e9)
A100_40 = Gpu(name="A100-40GB", memory_bytes=40960 * MiB, peak_flops_16bit=312e12, bf16=True,
              nvlink_busbw=230e9, memory_bandwidth=1555e9)
A100_80_PCIE = Gpu(name="A100-80GB-PCIe", memory_bytes=81920 * MiB, peak_flops_16bit=312e12,
                   bf16=True, nvlink_busbw=None, memory_bandwidth=1935e9)
A100_80 = Gpu(name="A100-80GB", memory_bytes=81920 * MiB, peak_flops_16bit=312e12, bf16=True,
              nvlink_busbw=230e9, memory_bandwidth=2039e9)
H100_NVL = Gpu(name="H100-NVL-94GB", memory_bytes=95830 * MiB, peak_flops_16bit=835e12,
               bf16=True, nvlink_busbw=None, memory_bandwidth=3.9e12)
H100_80 = Gpu(name="H100-80GB", memory_bytes=81559 * MiB, peak_flops_16bit=989e12, bf16=True,
              nvlink_busbw=400e9, memory_bandwidth=3.35e12)
H200 = Gpu(name="H200-141GB", memory_bytes=143771 * MiB, peak_flops_16bit=989e12, bf16=True,
           nvlink_busbw=400e9, memory_bandwidth=4.8e12)

VM_SIZES: tuple[VmSize, ...] = (
    VmSize(name="Standard_NC4as_T4_v3", series="NCasT4_v3", gpu=T4, gpus=1,
           memory_bytes=28 * GiB, price_per_hour=0.526),
    VmSize(name="Standard_NC8as_T4_v3", series="NCasT4_v3", gpu=T4, gpus=1,
           memory_bytes=56 * GiB, price_per_hour=0.752),
    VmSize(name="Standard_NC16as_T4_v3", series="NCasT4_v3", gpu=T4, gpus=1,
           memory_bytes=110 * GiB, price_per_hour=1.204),
    VmSize(name="Standard_NC64as_T4_v3", series="NCasT4_v3", gpu=T4, gpus=4,
           memory_bytes=440 * GiB, price_per_hour=4.352),
    VmSize(name="Standard_NC6s_v3", series="NCv3", gpu=V100_16, gpus=1,
           memory_bytes=112 * GiB, price_per_hour=3.06),
    VmSize(name="Standard_NC12s_v3", series="NCv3", gpu=V100_16, gpus=2,
           memory_bytes=224 * GiB, price_per_hour=6.12),
    VmSize(name="Standard_NC24s_v3", series="NCv3", gpu=V100_16, gpus=4,
           memory_bytes=448 * GiB, price_per_hour=12.24),
    VmSize(name="Standard_NC24rs_v3", series="NCv3", gpu=V100_16, gpus=4,
           memory_bytes=448 * GiB, infiniband_gbps=100, price_per_hour=13.46),
    VmSize(name="Standard_ND40rs_v2", series="NDv2", gpu=V100_32, gpus=8,
           memory_bytes=672 * GiB, infiniband_gbps=100, price_per_hour=22.03),
    VmSize(name="Standard_NC24ads_A100_v4", series="NC_A100_v4", gpu=A100_80_PCIE, gpus=1,
           memory_bytes=220 * GiB, price_per_hour=3.673),
    VmSize(name="Standard_NC48ads_A100_v4", series="NC_A100_v4", gpu=A100_80_PCIE, gpus=2,
           memory_bytes=440 * GiB, price_per_hour=7.346),
    VmSize(name="Standard_NC96ads_A100_v4", series="NC_A100_v4", gpu=A100_80_PCIE, gpus=4,
           memory_bytes=880 * GiB, price_per_hour=14.692),
    VmSize(name="Standard_ND96asr_v4", series="NDasrA100_v4", gpu=A100_40, gpus=8,
           memory_bytes=900 * GiB, infiniband_gbps=1600, price_per_hour=27.197),
    VmSize(name="Standard_ND96amsr_A100_v4", series="NDm_A100_v4", gpu=A100_80, gpus=8,
           memory_bytes=1900 * GiB, infiniband_gbps=1600, price_per_hour=32.77),
    VmSize(name="Standard_NC40ads_H100_v5", series="NCads_H100_v5", gpu=H100_NVL, gpus=1,
           memory_bytes=320 * GiB, price_per_hour=6.98),
    VmSize(name="Standard_NC80adis_H100_v5", series="NCads_H100_v5", gpu=H100_NVL, gpus=2,
           memory_bytes=640 * GiB, price_per_hour=13.96),
    VmSize(name="Standard_ND96isr_H100_v5", series="ND_H100_v5", gpu=H100_80, gpus=8,
           memory_bytes=1900 * GiB, infiniband_gbps=3200, price_per_hour=98.32),
    VmSize(name="Standard_ND96isr_H200_v5", series="ND_H200_v5", gpu=H200, gpus=8,
           memory_bytes=1850 * GiB, infiniband_gbps=3200, price_per_hour=110.24),
)
GPUS: tuple[Gpu, ...] = (T4, V100_16, V100_32, A100_40, A100_80_PCIE, A100_80, H100_NVL,
                         H100_80, H200)

def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().removeprefix("standard_"))


_BY_KEY = {_key(vm.name): vm for vm in VM_SIZES}


def gpu_names(gpu: Gpu) -> list[str]:
    """The names a GPU answers to, from its catalog name: `A100-80GB-PCIe` is also
    `A100-80GB` and `A100`; `H100-NVL-94GB` also `H100-NVL` and `H100`."""
    parts = gpu.name.split("-")
    return ["-".join(parts[:n]) for n in range(len(parts), 0, -1)]


def is_vm_size(name: str) -> bool:
    """`name` is an Azure VM size of the catalog (any case, `Standard_` optional), not a GPU."""
    return _key(name) in _BY_KEY


def vm_sizes_with(name: str) -> list[VmSize]:
    """The VM sizes whose GPU answers to `name` (any case, punctuation ignored)."""
    key = _key(name)
    return [vm for vm in VM_SIZES if any(_key(n) == key for n in gpu_names(vm.gpu))]


def find(name: str, gpus_per_node: int = 1) -> VmSize | None:
    """A VM size by its Azure name (with or without `Standard_`, any case), or by a GPU name
    (`A100-80GB`, `H100`, `T4-16GB`): then the smallest VM size with that GPU and at least
    `gpus_per_node` of them (the cheapest of equals), else the one with the most. None when
    the catalog does not know the name."""
    if (vm := _BY_KEY.get(_key(name))) is not None:
        return vm
    candidates = vm_sizes_with(name)
    if not candidates:
        return None
    enough = [vm for vm in candidates if vm.gpus >= gpus_per_node]
    if enough:
        return min(enough, key=lambda vm: (vm.gpus, vm.price_per_hour))
    return max(candidates, key=lambda vm: (vm.gpus, -vm.price_per_hour))


class Card(BaseModel):
    """One GPU of this machine, as `nvidia-smi --query-gpu` reports it."""

    model_config = ConfigDict(frozen=True)
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: float


def cards_from_nvidia_smi(text: str) -> list[Card]:
    """The rows of `nvidia-smi --query-gpu=name,memory.total,memory.free,compute_cap
    --format=csv,noheader,nounits` (MiB); a row it cannot read is left out."""
    cards = []
    for row in text.splitlines():
        fields = [field.strip() for field in row.rsplit(",", 3)]
        try:
            name, total, free, capability = fields[0], *map(float, fields[1:])
        except ValueError:  # '[N/A]', a warning line, a short row
            continue
        cards.append(Card(name=name, total_bytes=int(total * MiB), free_bytes=int(free * MiB),
                          compute_capability=capability))
    return cards


def gpu_of(card: Card) -> Gpu | None:
    """The catalog GPU a card is (`NVIDIA H100 80GB HBM3` is H100-80GB, `NVIDIA A100-SXM4-40GB`
    A100-40GB, `Tesla T4` T4-16GB): same family, the closest memory, PCIe or not as named."""
    words = set(re.split(r"[^a-z0-9]+", card.name.lower()))
    pcie = "pcie" in words

    def family(gpu: Gpu) -> list[str]:
        return gpu.name.lower().split("-")[:2 if "-nvl-" in gpu.name.lower() else 1]

    same = [gpu for gpu in GPUS if set(family(gpu)) <= words]
    return min(same, key=lambda gpu: (abs(gpu.memory_bytes - card.total_bytes) // GiB,
                                      (gpu.nvlink_busbw is None) != pcie), default=None)


def this_machine(cards: list[Card], host_memory_bytes: int) -> VmSize:
    """This machine's GPUs as the planner sees a VM size: each worker gets the least free
    memory among `cards` (another process may hold some of a card), and the speed and
    interconnect of the catalog GPU they are; a card the catalog does not know is planned
    at the speed of the slowest it lists, in bf16 from compute capability 8.0 (Ampere)."""
    known, name = gpu_of(cards[0]), cards[0].name.lower()
    slowest = min(GPUS, key=lambda gpu: gpu.peak_flops_16bit)
    free = min(card.free_bytes for card in cards)
    gpu = Gpu(name=cards[0].name, memory_bytes=free,
              peak_flops_16bit=(known or slowest).peak_flops_16bit,
              bf16=known.bf16 if known else cards[0].compute_capability >= 8.0,
              nvlink_busbw=known.nvlink_busbw if known and "pcie" not in name else None)
    return VmSize(name="this machine", series="local", gpu=gpu, gpus=len(cards),
                  memory_bytes=host_memory_bytes, price_per_hour=0.0)


def known_names() -> list[str]:
    """Every VM size, then every GPU name (`finetune plan` prints GPUs by these)."""
    gpus = dict.fromkeys(n for gpu in GPUS for n in gpu_names(gpu))
    return [vm.name for vm in VM_SIZES] + list(gpus)


def close_names(name: str, n: int = 3) -> list[str]:
    """The catalog's names nearest to `name`, best first: what a name it does not know
    likely meant (a typo, another case, `Standard_` left out)."""
    known = known_names()
    lowered = {k.lower(): k for k in known}
    bare = {k.lower().removeprefix("standard_"): k for k in known
            if k.lower().startswith("standard_")}
    close = difflib.get_close_matches(name.lower(), [*lowered, *bare], n=n * 2, cutoff=0.6)
    return list(dict.fromkeys(lowered.get(match) or bare[match] for match in close))[:n]
