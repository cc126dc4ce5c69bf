"""Typed settings shared by every service, and their command-line flags.

Each service declares one pydantic-settings class. Every field is a flag
(`--max-num-seqs`) and an environment variable (`MESHSERVE_MAX_NUM_SEQS`);
a flag given on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "MESHSERVE_"

S = TypeVar("S", bound=BaseSettings)


class ServiceSettings(BaseSettings):
    """What every gRPC service has: where it listens, how it logs, how it stops."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in containers)")
    port: int = Field(0, description="gRPC port", ge=0, le=65535)
    metrics_port: int = Field(0, description="Prometheus /metrics HTTP port (0: off)", ge=0, le=65535)
    metrics_vllm_alias: bool = Field(
        False,
        description="also export every metric vLLM has under its vllm: name (for vLLM dashboards and the "
        "Gateway API Inference Extension)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="log format (auto: console on a terminal, JSON otherwise)"
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry collector for request spans over OTLP/gRPC (http://collector:4317; https: TLS); "
        "unset: no spans, trace ids still carried for the logs",
    )
    shutdown_grace_period: float = Field(
        30.0, description="seconds in-flight requests get to finish after SIGTERM", ge=0
    )
    # TLS and internal auth: read and checked by services/common/tls.py.
    tls_cert: str | None = Field(
        None, description="PEM certificate (chain) of this service: the port serves TLS; also its client cert"
    )
    tls_key: str | None = Field(None, description="PEM private key of --tls-cert")
    tls_ca: str | None = Field(
        None,
        description="PEM CA bundle: outgoing channels use TLS and verify peers; internal ports then require "
        "client certificates it signed (mTLS)",
    )
    tls_server_name: str | None = Field(
        None, description="name outgoing channels expect in the peer's certificate (unset: the dialled host)"
    )
    tls_client_auth: Literal["auto", "require", "none"] = Field(
        "auto",
        description="client certificates with --tls-ca: auto (required on internal ports, not on the gateway's), "
        "require, none",
    )
    internal_token_file: str | None = Field(
        None,
        description="file with the mesh's shared token: internal APIs require it (authorization: Bearer), "
        "outgoing channels send it",
    )

    @property
    def address(self) -> str:
        """host:port of the gRPC listener."""
        return f"{self.host}:{self.port}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value; argparse reports the ValueError as an invalid value of that flag."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one flag per settings field; unset flags stay absent so the environment can fill them."""
    for name, info in cls.model_fields.items():
        annotation = _unwrap_optional(info.annotation)
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        env = f"{ENV_PREFIX}{name.upper()}"
        default = info.default if info.default is not None else "unset"
        kwargs["help"] = f"{info.description or ''} [env {env}; default {default}]"
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
        elif annotation in (int, float, str):
            kwargs["type"] = annotation
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            # A structured setting is one JSON object (vLLM's --speculative-config); the model checks its keys.
            kwargs["type"] = _json_object
            kwargs["metavar"] = "JSON"
        elif typing.get_origin(annotation) is list:
            # `--api-key a --api-key b` and `--api-key a b` both give [a, b], as vLLM's list flags do.
            kwargs["action"] = "extend"
            kwargs["nargs"] = "+"
            kwargs["type"] = typing.get_args(annotation)[0]
        parser.add_argument(_flag(name), **kwargs)


def settings_from_args(cls: type[S], namespace: argparse.Namespace) -> S:
    """Build settings from parsed flags (which override MESHSERVE_* variables)."""
    given = {k: v for k, v in vars(namespace).items() if k in cls.model_fields}
    return cls(**given)


def describe_settings_error(err: ValidationError) -> str:
    """A refused setting as its flag and variable and what is wrong, for a one-line exit message (a traceback
    names pydantic's internals, not what to change)."""
    parts = []
    for error in err.errors():
        message = str(error["msg"]).removeprefix("Value error, ")
        loc = error["loc"]
        if loc and isinstance(loc[0], str):
            # A whole-settings check names its flags in its message; a field's error needs its name added.
            message = f"{_flag(loc[0])} (env {ENV_PREFIX}{loc[0].upper()}): {message}"
        parts.append(message)
    return "; ".join(parts)
