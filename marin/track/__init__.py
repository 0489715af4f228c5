"""The run record and its tracking (the layer above config, model, optim and data; below train).

`record` makes and opens run directories (config, overrides, provenance) with their MLflow run;
`tracker` logs a running job's metrics; `report` draws a run's or sweep's HTML page; `sweep`
ties the jobs of a sweep to one parent run; `secrets` keeps secrets out of everything written
or printed; `backend` holds the tracking URI and the MLflow client (imported lazily: it is slow).
"""
import os

# MLflow 3 sends usage telemetry from every process that imports it (and first fetches its settings
# from config.mlflow-telemetry.io), unless it sees a CI variable. A run contacts its store and
# nothing else (a cluster's nodes often reach no internet): off by default in every process that
# tracks, the tracking process included; MLFLOW_DISABLE_TELEMETRY=false in the environment keeps it.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
