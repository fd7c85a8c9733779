"""Stands in for Agent Lightning's `tests/server/conftest.py` when its REST tests run against a live server
(`tests/agl/test_agl_rest_suite.py`): `client` is an httpx client at `AGL_REST_URL` instead of a TestClient
over its in-process app, holding the same fixtures and names its tests import."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

AGL_KEY = os.environ["AGL_SERVER_KEY"]
MODEL_NAME = "test-model"


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(base_url=os.environ["AGL_REST_URL"], timeout=30) as c:
        yield c


@pytest.fixture
def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {AGL_KEY}"}
