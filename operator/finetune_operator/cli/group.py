"""The `finetune` click group, apart from `__init__` so that each command module registers
on it (`@main.command`) without importing the package that imports them."""

from __future__ import annotations

import click

EXIT_INVALID = 2
"""An invalid manifest or option: click's own usage errors exit 2 too."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="finetune-operator")
def main() -> None:
    """Fine-tune LLMs from one FineTuneJob manifest: on Kubernetes, on Azure ML, or here.

    \b
      finetune validate job.yaml      check a manifest, each problem with its fix
      finetune render job.yaml        print the objects the operator would create
      finetune plan job.yaml          per-GPU memory, step time, the cheapest GPUs that fit
      finetune run job.yaml           train it on this machine (CPU or local GPUs)
      finetune status NAME --watch    phase, progress bar, events (a cluster's job or a run's)
      finetune logs NAME -f           the trainer's log
      finetune export OUT TARGET      push a trained model to oci:// (KAITO, oras) or hf://
      finetune operator               run the controller (in-cluster, or via KUBECONFIG)
    """
