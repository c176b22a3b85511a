"""tokenmill worker: the inference engine (tokenmill.engine) and the Kafka side around it."""
