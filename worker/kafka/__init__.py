"""The Kafka side of the worker: consuming jobs, publishing results, offsets, and the helpers
around a broker (`admin` creates topics, `local_broker` runs a single-node Apache Kafka for
development and tests). Nothing is imported here so that `import tokenmill.kafka.x` stays light.
"""
