"""Runtime glue between the asyncio Kafka side and the engine thread."""
