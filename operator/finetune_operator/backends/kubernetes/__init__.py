"""The kubernetes backend: torchrun pods on this cluster (AKS GPU node pools or any other).

One FineTuneJob becomes a ConfigMap (the trainer config), a headless Service (stable DNS
for rank 0) and an Indexed Job with one pod per node: the Job controller is the engine,
the completion index is the node rank. `render` is a pure function of the job and the
operator settings; the kopf handlers create what it returns.

`workers` renders those objects (pure, offline), `states` reads the Job, its pods, their
events and Kueue's Workload into what the reconciler needs (pure), and `backend` ties them
to the Backend interface with the API calls. `rules` is what it says of a manifest before
anything runs; it and this package import none of the others (validating a manifest loads
no client).
"""
