"""tokenmill worker: the inference engine (worker.engine) and the Kafka side around it."""
