"""The pipeline's plumbing: the DAG as data (graph), running a node (nodes: cache, Ray, manifest,
publish), a run's start and end (run), the artifact store, leases, code digests, MLflow lineage, gates."""
