"""The azureml backend: the same FineTuneJob as an Azure ML distributed command job.

`jobspec` builds the job (pure, offline), `states` reads Azure ML's answers into what the
reconciler needs (pure), `client` talks to the workspace through azure-ai-ml, and
`backend` ties them to the Backend interface. azure-ai-ml is the optional `azure` extra:
nothing here imports it until a job needs it. `rules` is what it says of a manifest before
anything runs; it and this package import none of the others.
"""
