"""Providers: the ones requested that this ONNX Runtime build has; never a silent swap to
another when none of them is here (issue 41, item 8)."""

from __future__ import annotations

import logging

import onnxruntime as ort
import pytest

from service.errors import BundleError
from service.runtime.sessions import chosen_providers, default_providers

MISSING = "NoSuchExecutionProvider"


def test_a_missing_provider_beside_a_present_one_is_dropped_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="r4t.sessions"):
        assert chosen_providers([MISSING, "CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert MISSING in caplog.text


def test_only_missing_providers_are_refused_naming_what_the_build_has():
    with pytest.raises(BundleError, match=MISSING) as refused:
        chosen_providers([MISSING])
    assert "CPUExecutionProvider" in str(refused.value)


def test_no_request_takes_the_default():
    assert chosen_providers(None) == default_providers()
    assert set(default_providers()) <= set(ort.get_available_providers())
