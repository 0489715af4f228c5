"""Run records and MLflow tracking.

`record` makes and opens run directories (config, overrides, provenance) together with their
MLflow run; `tracker` logs a running job's metrics; `companion` runs both in a child process for
a local run, so MLflow never weighs on the training process; `sweep` ties the jobs of a sweep to one parent
run; `reproduce` recomposes a saved run. `backend` holds what they share: the tracking URI, the
MLflow client and the redaction of secrets. MLflow is imported lazily (it is slow to import).
"""
