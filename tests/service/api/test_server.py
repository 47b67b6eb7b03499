"""`r4t serve` wiring and the JSON log lines."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
from pathlib import Path

from service.api.middleware import request_id_var
from service.api.server import JsonFormatter, log_config, register
from service.settings import Settings


def test_serve_subcommand_is_registered_with_its_flags():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", type=Path, default=Path("models/default"))
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["--bundle", "models/x", "serve", "--port", "9001",
                              "--routes", "ar=1"])
    assert args.command == "serve" and args.port == 9001 and args.routes == "ar=1"
    assert callable(args.func)


def test_log_lines_are_json_with_the_request_id():
    record = logging.LogRecord("r4t.test", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    record.http = {"status": 200}
    token = request_id_var.set("req-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert line["message"] == "hello you" and line["request_id"] == "req-1"
    assert line["http"] == {"status": 200} and line["level"] == "info"


def test_log_config_is_accepted_by_dictconfig():
    logging.config.dictConfig(log_config("warning"))
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("R4T_ROUTES", "diffusion=3,ar=1")
    monkeypatch.setenv("R4T_MAX_BATCH_SIZE", "8")
    settings = Settings()
    assert settings.route_weights == {"diffusion": 3.0, "ar": 1.0}
    assert settings.max_batch_size == 8 and settings.provider_list is None
    assert "admin_token" not in settings.public()
