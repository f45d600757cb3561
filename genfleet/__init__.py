"""genfleet: bulk LLM generation on a GPU fleet.

The package is the repository's three folders under one name, through relative links:
`genfleet.common` (settings, records, the store, the ledger, the readers), `genfleet.producer`
(staging, enqueue, status, export) and `genfleet.workers` (the Celery worker, the engine, the
power-watch). `genfleet.cli` is the one module above both sides: the `genfleet` command.
"""
