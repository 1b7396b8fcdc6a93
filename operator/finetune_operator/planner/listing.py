"""What the planner knows, as `finetune plan --list-gpus` and `--list-models` print it: the
catalog's GPUs and Azure VM sizes (`catalog`), and the built-in table's models
(`known_models`), as tables for people and as camelCase JSON."""

from __future__ import annotations

from typing import Any

from finetune_operator import gpu_catalog as catalog
from finetune_operator.planner import known_models
from finetune_operator.planner.architecture import ConfigError, from_hf_config
from finetune_operator.planner.compute import EXPECTED_MFU
from finetune_operator.planner.plan import gib
from finetune_operator.planner.report import count


def gpus() -> list[dict[str, Any]]:
    """Every GPU of the catalog: the names `--gpu-type` takes for it, its memory, speed,
    and the VM sizes that have it."""
    return [{"name": gpu.name, "alsoMatchedBy": catalog.gpu_names(gpu)[1:],
             "memoryBytes": gpu.memory_bytes, "bf16": gpu.bf16,
             "peakFlops16bit": gpu.peak_flops_16bit, "nvlink": gpu.nvlink_busbw is not None,
             "assumedMfu": EXPECTED_MFU.get(gpu.name, 0.35),
             "vmSizes": [vm.name for vm in catalog.VM_SIZES if vm.gpu == gpu]}
            for gpu in catalog.GPUS]


def vm_sizes() -> list[dict[str, Any]]:
    """Every Azure VM size of the catalog."""
    return [{"name": vm.name, "series": vm.series, "gpu": vm.gpu.name, "gpus": vm.gpus,
             "gpuMemoryBytes": vm.gpu.memory_bytes, "memoryBytes": vm.memory_bytes,
             "infinibandGbps": vm.infiniband_gbps, "interconnect": vm.interconnect,
             "pricePerHour": vm.price_per_hour}
            for vm in catalog.VM_SIZES]


def models() -> list[dict[str, Any]]:
    """Every model of the built-in table, with its parameters as the planner counts them."""
    rows = []
    for name, config in known_models.KNOWN_MODELS.items():
        try:
            shape = from_hf_config(config)
        except ConfigError:  # a broken entry is the table's test's to find; listed anyway
            rows.append({"name": name, "modelType": config.get("model_type")})
            continue
        rows.append({"name": name, "modelType": shape.model_type,
                     "totalParams": shape.total_params, "layers": shape.num_layers,
                     "hiddenSize": shape.hidden_size, "vocabSize": shape.vocab_size,
                     "contextLength": shape.context_length})
    return rows


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Columns padded to their widest cell; those in `right` aligned right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in [header, *rows]]


def gpus_table() -> str:
    """`finetune plan --list-gpus`: the GPUs, then the VM sizes."""
    gpu_rows = [[g["name"], ", ".join(g["alsoMatchedBy"]) or "-", gib(g["memoryBytes"]),
                 "yes" if g["bf16"] else "no (fp16)", f"{g['peakFlops16bit'] / 1e12:,.0f}",
                 f"{g['assumedMfu']:.0%}", "NVLink" if g["nvlink"] else "PCIe"]
                for g in gpus()]
    vm_rows = [[v["name"], v["series"], f"{v['gpus']} x {v['gpu']}", gib(v["memoryBytes"]),
                v["interconnect"], f"{v['pricePerHour']:.2f}"] for v in vm_sizes()]
    return "\n".join([
        "GPUs (`--gpu-type` and spec.resources.gpuType take any of these names, any case: "
        "the smallest VM size below with that GPU and at least gpusPerNode of them):",
        *_table(["GPU", "also matched by", "memory", "bf16", "16-bit TFLOP/s",
                 "assumed MFU", "between GPUs"], gpu_rows, {2, 4, 5}),
        "",
        "Azure VM sizes (also taken by name, `Standard_` optional; prices: indicative list "
        "prices, USD per VM-hour, for ranking only):",
        *_table(["VM size", "series", "GPUs", "host memory", "interconnect", "$/hour"],
                vm_rows, {3, 5})])


def models_table() -> str:
    """`finetune plan --list-models`: the built-in table."""
    rows = [[m["name"], m.get("modelType") or "?", count(m.get("totalParams")),
             str(m.get("layers", "?")), str(m.get("hiddenSize", "?")),
             str(m.get("vocabSize", "?")), str(m.get("contextLength") or "-")]
            for m in models()]
    return "\n".join([
        "Models of the planner's built-in table (`--model NAME`, or hf://NAME in "
        "spec.model.uri; planned from this table when the hub is not asked or cannot be "
        "reached):",
        *_table(["model", "type", "parameters", "layers", "hidden", "vocabulary", "context"],
                rows, {2, 3, 4, 5, 6})])
