"""Kafka connection flags shared by the client commands (produce, tail, backfill, demo)."""

from __future__ import annotations

import argparse

from worker.kafka.security import SASL_MECHANISMS, SECURITY_PROTOCOLS


def add_kafka_client_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    g = parser.add_argument_group("Kafka connection")
    g.add_argument("--bootstrap-servers", required=required, metavar="HOST:PORT[,...]",
                   help="Kafka bootstrap servers")
    g.add_argument("--security-protocol", default="PLAINTEXT", choices=SECURITY_PROTOCOLS)
    g.add_argument("--sasl-mechanism", choices=SASL_MECHANISMS)
    g.add_argument("--sasl-username")
    g.add_argument("--sasl-password", help="prefer --sasl-password-file or TOKENMILL_SASL_PASSWORD")
    g.add_argument("--sasl-password-file", metavar="PATH")
    g.add_argument("--ssl-cafile", metavar="PATH")
    g.add_argument("--ssl-certfile", metavar="PATH")
    g.add_argument("--ssl-keyfile", metavar="PATH")


def kafka_client_kwargs(args: argparse.Namespace) -> dict:
    """aiokafka keyword arguments from the flags; ValueError names every bad combination."""
    from worker.kafka.security import KafkaSecurity, read_secret

    sec = KafkaSecurity(
        protocol=args.security_protocol,
        sasl_mechanism=args.sasl_mechanism,
        sasl_username=args.sasl_username,
        sasl_password=read_secret(args.sasl_password, args.sasl_password_file, "SASL password"),
        ssl_cafile=args.ssl_cafile,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    return sec.aiokafka_kwargs()
