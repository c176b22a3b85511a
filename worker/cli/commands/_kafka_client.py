"""Kafka connection and security flags, shared by the worker and the client commands
(produce, tail, backfill, demo), so every command accepts the same options with the same meaning;
and how those commands report a broker that refuses them (the same exit codes as the worker)."""

from __future__ import annotations

import argparse

from tokenmill.kafka.security import SASL_MECHANISMS, SECURITY_PROTOCOLS


def add_kafka_client_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    g = parser.add_argument_group("Kafka connection")
    g.add_argument("--bootstrap-servers", required=required, metavar="HOST:PORT[,...]",
                   help="Kafka bootstrap servers")
    add_kafka_security_args(g)


def add_kafka_security_args(group) -> None:
    """SSL and SASL (PLAIN / SCRAM) options on an argument parser or group."""
    group.add_argument("--security-protocol", default="PLAINTEXT", choices=SECURITY_PROTOCOLS)
    group.add_argument("--sasl-mechanism", default=None, choices=SASL_MECHANISMS)
    group.add_argument("--sasl-username", default=None)
    group.add_argument("--sasl-password", default=None,
                       help="prefer TOKENMILL_SASL_PASSWORD or --sasl-password-file (flags show in `ps`)")
    group.add_argument("--sasl-password-file", default=None, metavar="PATH")
    group.add_argument("--ssl-cafile", default=None, metavar="PATH")
    group.add_argument("--ssl-certfile", default=None, metavar="PATH")
    group.add_argument("--ssl-keyfile", default=None, metavar="PATH")
    group.add_argument("--ssl-key-password-file", default=None, metavar="PATH")
    group.add_argument("--ssl-no-check-hostname", action="store_true",
                       help="do not check the broker certificate's host name (test set-ups only)")


def kafka_security_from_args(args: argparse.Namespace):
    """KafkaSecurity from the flags of add_kafka_security_args (secrets read from files or flags)."""
    from tokenmill.kafka.security import KafkaSecurity, read_secret

    return KafkaSecurity(
        protocol=args.security_protocol,
        sasl_mechanism=args.sasl_mechanism,
        sasl_username=args.sasl_username,
        sasl_password=read_secret(args.sasl_password, args.sasl_password_file, "SASL password"),
        ssl_cafile=args.ssl_cafile,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_key_password=read_secret(None, args.ssl_key_password_file, "SSL key password"),
        ssl_check_hostname=not args.ssl_no_check_hostname,
    )


def kafka_client_kwargs(args: argparse.Namespace) -> dict:
    """aiokafka keyword arguments from the flags; ValueError names every bad combination."""
    return kafka_security_from_args(args).aiokafka_kwargs()


def client_error_exit(prog: str, exc: Exception, *, bad_input: tuple[type[Exception], ...] = ()) -> int:
    """For a command's handler, on any exception: print one line and return the exit code when
    the broker refused the credentials or an ACL is missing (76 authentication, 77 authorization;
    worker/kafka/security.py), or when exc is one of ``bad_input`` (2); re-raise anything else."""
    import sys

    from tokenmill.kafka.security import access_denied

    if isinstance(exc, bad_input):
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    denied = access_denied(exc)
    if denied is None:
        raise exc
    print(f"{prog}: {denied}", file=sys.stderr)
    return denied.exit_code
