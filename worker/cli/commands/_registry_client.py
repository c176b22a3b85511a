"""Schema Registry flags, shared by the worker and the client commands (produce, tail, backfill,
eval), so each accepts the same options with the same meaning (worker/kafka/registry.py); and how
a client command reports a registry that refuses it or does not answer."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.kafka.registry import RegistrySettings

# The exit codes of a refusal, as for the broker's (worker/kafka/security.py): 76 the credentials,
# 77 the permission; any other registry failure exits 1.
EXIT_AUTHENTICATION = 76
EXIT_AUTHORIZATION = 77


def add_schema_registry_args(group, *, what: str) -> None:
    """The registry's URL and credentials (like the broker's: basic auth, TLS) on a parser or
    group; ``what`` says what the option changes for this command (its help)."""
    group.add_argument("--schema-registry", default=None, metavar="URL",
                       help=f"a Confluent-compatible schema registry (opt in): {what}")
    group.add_argument("--schema-registry-user", default=None, help="basic auth user (also the URL's user-info)")
    group.add_argument("--schema-registry-password", default=None,
                       help="prefer TOKENMILL_SCHEMA_REGISTRY_PASSWORD or --schema-registry-password-file "
                            "(flags show in `ps`)")
    group.add_argument("--schema-registry-password-file", default=None, metavar="PATH")
    group.add_argument("--schema-registry-ca", default=None, metavar="PATH", help="CA file for an https registry")
    group.add_argument("--schema-registry-cert", default=None, metavar="PATH",
                       help="client certificate for mutual TLS (with --schema-registry-key)")
    group.add_argument("--schema-registry-key", default=None, metavar="PATH")


def registry_settings_from_args(args: argparse.Namespace, *, result_format: str = "json") -> RegistrySettings | None:
    """RegistrySettings from the flags of add_schema_registry_args; None without --schema-registry.
    ValueError names every bad combination."""
    from tokenmill.kafka.registry import RegistrySettings
    from tokenmill.kafka.security import read_secret

    if not args.schema_registry:
        given = [flag for flag, value in (
            ("--schema-registry-user", args.schema_registry_user),
            ("--schema-registry-password", args.schema_registry_password),
            ("--schema-registry-password-file", args.schema_registry_password_file),
            ("--schema-registry-ca", args.schema_registry_ca),
            ("--schema-registry-cert", args.schema_registry_cert),
            ("--schema-registry-key", args.schema_registry_key)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --schema-registry")
        return None
    password = read_secret(args.schema_registry_password, args.schema_registry_password_file,
                           "schema registry password")
    settings = RegistrySettings(args.schema_registry, args.schema_registry_user,
                                password.reveal() if password else None, args.schema_registry_ca,
                                args.schema_registry_cert, args.schema_registry_key, result_format=result_format)
    problems = settings.problems()
    if problems:
        raise ValueError("; ".join(problems))
    return settings


def registry_error_exit(prog: str, exc: BaseException) -> int | None:
    """For a command's handler: print one line and return the exit code when exc is the
    registry's refusal or silence (76 refused credentials, 77 no permission, else 1); None for
    any other exception."""
    import sys

    from tokenmill.kafka.registry import RegistryError, RegistryUnreachable

    if isinstance(exc, RegistryUnreachable):
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    if not isinstance(exc, RegistryError):
        return None
    print(f"{prog}: {exc}", file=sys.stderr)
    return {401: EXIT_AUTHENTICATION, 403: EXIT_AUTHORIZATION}.get(exc.status, 1)
