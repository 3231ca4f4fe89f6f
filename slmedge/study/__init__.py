"""Studies: a grid of compress -> export -> evaluate jobs from one TOML file, run once each
(shared, resumable) on a local process pool or a Ray cluster, then a report."""
