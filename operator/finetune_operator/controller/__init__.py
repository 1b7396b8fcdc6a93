"""The operator's control loop, the layer that acts: kopf's watches put a job's key in the
work queue (`workqueue`), a few reconcilers drain it (`reconcilers`: observe the backend, ask
`reconcile` what to do, do it, patch the status), launches take turns (`pacing`), and
FineTuneSweeps share the queue and the reconcilers (`sweeps`).

Kept empty: `finetune --help` reads `pacing`'s defaults without loading kopf.
"""
