"""`finetune run`: the same FineTuneJob on this machine, under torchrun, no cluster.

One module per concern: `config` (the trainer config, locations opened here), `machine`
(processes and batch fitted to this machine), `ports`, `processes` (torchrun and the steps
before it, restarts), `logs`, `output` (the output folder between runs), `paths` (what
this machine lacks: `finetune validate` warns of it too) and `lock` (a run's hold on its
output folder, which `finetune status` reads). Empty on purpose: `finetune status` loads
`lock` alone, not the planner that `config` brings.
"""
