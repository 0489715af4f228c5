"""The run record and its tracking (the layer above config, model, optim and data; below train).

`record` makes and opens run directories (config, overrides, provenance) with their MLflow run;
`tracker` logs a running job's metrics; `report` draws a run's or sweep's HTML page; `sweep`
ties the jobs of a sweep to one parent run; `secrets` keeps secrets out of everything written
or printed; `backend` holds the tracking URI and the MLflow client (imported lazily: it is slow).
"""
