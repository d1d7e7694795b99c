"""Fixtures shared by the tests that drive the session's served model (tests/conftest.py's
`server`) with the official openai client."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="package")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="package")
def model(client):
    return client.models.list().data[0].id
