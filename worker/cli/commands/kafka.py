"""`tokenmill kafka start|stop|status|create-topic`: a local single-node Apache Kafka.

The node listens on 127.0.0.1 only and keeps all its state in --data-dir, so `stop` then `start`
keeps every topic and record. It is meant for development, demos and tests, not production.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from tokenmill.cli.engine_options import positive_int

_DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def _port(value: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {value}")
    return port


def _bool(value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _config_item(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, val


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kafka",
        help="run a local single-node Apache Kafka (development and tests)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=lambda args: _usage(parser))
    actions = parser.add_subparsers(dest="kafka_command", metavar="ACTION")

    def node_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data-dir", default=None,
                       help="where the node keeps its config, log and data "
                            "(default: $TOKENMILL_CACHE/kafka/data, i.e. ~/.cache/tokenmill/kafka/data)")

    start = actions.add_parser("start", help="start the node in the background and wait until it answers")
    node_options(start)
    start.add_argument("--port", type=_port, default=None,
                       help="client port on 127.0.0.1 (default: the port of the last start on this "
                            "data dir, else 9092)")
    start.add_argument("--controller-port", type=_port, default=None,
                       help="KRaft controller port (default: a free port, then the same one on restarts)")
    start.add_argument("--auto-create-topics", type=_bool, default=True,
                       help="let produce/metadata requests create unknown topics (default: true)")
    start.add_argument("--timeout", type=positive_int, default=120,
                       help="seconds to wait for the node to answer (default: 120)")
    start.set_defaults(func=_start)

    stop = actions.add_parser("stop", help="stop the node cleanly (SIGTERM, SIGKILL after --timeout)")
    node_options(stop)
    stop.add_argument("--timeout", type=positive_int, default=60, help="seconds before SIGKILL (default: 60)")
    stop.set_defaults(func=_stop)

    status = actions.add_parser("status", help="exit 0 if the node runs and answers, 3 if stopped")
    node_options(status)
    status.set_defaults(func=_status)

    create = actions.add_parser("create-topic", help="create a topic (fine if it exists with that many partitions)")
    create.add_argument("name", help="topic name")
    create.add_argument("--partitions", type=positive_int, default=1, help="partition count (default: 1)")
    create.add_argument("--replication-factor", type=positive_int, default=1,
                        help="replicas per partition (default: 1, what a single node allows)")
    # extend + nargs: repeatable on the command line, comma-separated in TOKENMILL_CONFIG.
    create.add_argument("--config", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="topic configs (e.g. --config retention.ms=86400000 cleanup.policy=delete)")
    create.add_argument("--bootstrap-servers", default=_DEFAULT_BOOTSTRAP,
                        help=f"Kafka bootstrap servers (default: {_DEFAULT_BOOTSTRAP})")
    create.add_argument("--timeout", type=positive_int, default=30, help="seconds to wait (default: 30)")
    create.set_defaults(func=_create_topic)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _broker(args: argparse.Namespace, with_ports: bool = False):
    from tokenmill.kafka.local_broker import LocalKafka

    if with_ports:
        return LocalKafka(port=args.port, data_dir=args.data_dir, controller_port=args.controller_port)
    return LocalKafka(data_dir=args.data_dir)


def _reports_node_errors(verb: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[..., int]]:
    """A node action whose LocalKafkaError becomes one line on stderr and exit code 1."""

    def wrap(action: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
        @functools.wraps(action)
        def run(args: argparse.Namespace) -> int:
            from tokenmill.kafka.local_broker import LocalKafkaError

            try:
                return action(args)
            except LocalKafkaError as exc:
                print(f"tokenmill kafka {verb}: {exc}", file=sys.stderr)
                return 1

        return run

    return wrap


@_reports_node_errors("start")
def _start(args: argparse.Namespace) -> int:
    broker = _broker(args, with_ports=True)
    broker.start(timeout=args.timeout, auto_create_topics=args.auto_create_topics)
    print(f"kafka running: bootstrap {broker.bootstrap}, data {broker.data_dir}, log {broker.log_file}")
    return 0


@_reports_node_errors("stop")
def _stop(args: argparse.Namespace) -> int:
    broker = _broker(args)
    broker.stop(timeout=args.timeout)
    print(f"kafka stopped: data {broker.data_dir}")
    return 0


@_reports_node_errors("status")
def _status(args: argparse.Namespace) -> int:
    status = _broker(args).status()
    print(status.message)
    if status.running:
        return 0
    return 3 if status.pid is None else 4


def _create_topic(args: argparse.Namespace) -> int:
    from tokenmill.kafka.admin import TopicError, TopicSpec, ensure_topics_sync

    try:
        config = dict(_config_item(item) for item in args.config)
    except argparse.ArgumentTypeError as exc:
        print(f"tokenmill kafka create-topic: --config: {exc}", file=sys.stderr)
        return 2
    spec = TopicSpec(args.name, args.partitions, args.replication_factor, config)
    try:
        ensure_topics_sync(args.bootstrap_servers, [spec], timeout=args.timeout)
    except TopicError as exc:
        print(f"tokenmill kafka create-topic: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # connection problems come as aiokafka errors; say what and where
        print(f"tokenmill kafka create-topic: cannot reach Kafka at {args.bootstrap_servers}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"topic {args.name}: {args.partitions} partition(s)")
    return 0
